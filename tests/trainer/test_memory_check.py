"""The answer at launch (``metrics.memory_check``): the trainer plans its own layout before any
collective and stops -- or warns -- when a rank needs more than its share of the host RAM (CPU) or its
GPU, naming the numbers and the cheapest fixes.

The issue's case: ``NPROC=8 ./launch.sh +experiment=38m_ddp`` on a 24 GiB host was OOM-killed after
80 s (5.7 GB RSS per rank x 8). The check is run on that config in-process with the host's RAM set to
24 GiB (no 8 ranks are started), then one real 2-rank launch is stopped the same way.
"""

from __future__ import annotations

import os
import subprocess

import pytest
import torch

from models.errors import ConfigError
from tests.configs import REPO, tiny_config
from trainer.config import compose_config
from trainer.planner import fit
from trainer.planner.cluster import GIB


def test_38m_ddp_on_8_cpu_ranks_of_a_24_gib_host_is_stopped_with_fixes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(fit, "host_memory_bytes", lambda: 24 * GIB)
    # A freshly launched rank's own footprint (interpreter, torch, libraries: ~0.5 GiB), not this
    # pytest process's, which grows over a whole suite run with everything earlier tests imported.
    monkeypatch.setattr(fit, "process_rss_bytes", lambda: 0.5 * GIB)
    cfg = compose_config("+experiment=38m_ddp")
    result = fit.check_memory(cfg, torch.device("cpu"), local_world_size=8, world_size=8)
    print(f"\n38m_ddp x 8 ranks: {result.need_bytes / GIB:.2f} GiB per rank planned\n{result.message}")
    assert not result.fits and 8 * result.need_bytes > 24 * GIB
    assert "x 8 rank(s)" in result.message and "3.00 GiB per rank" in result.message
    assert "training.compile=true saves less" in result.message  # the preset compiles: an upper bound
    fixes = result.message.split("Cheapest fixes: ")[1]
    assert fixes.startswith("training.activation_checkpoint=full ->")
    assert "training.micro_batch_size=" in fixes and "(FSDP)" in fixes
    # Every fix the message calls a fit is one: re-planned with it, the check passes.
    for fix in (f.strip() for f in fixes.split(";")):
        if "(fits)" not in fix:
            continue
        overrides = fix.split(" -> ")[0].split(" (")[0].split()
        again = fit.check_memory(compose_config("+experiment=38m_ddp", *overrides), torch.device("cpu"), 8, 8)
        assert again.fits, (fix, again.message)
    # Two ranks of the same host get 12 GiB each: the default layout of 2 ranks fits. Per rank it needs
    # about the same (one microbatch's activations), a little more: at the loss's backward the earlier
    # microbatches' gradients are live (4 accumulation steps instead of 1).
    two = fit.check_memory(
        compose_config("+experiment=38m_ddp", "parallelism.dp_replicate=2"), torch.device("cpu"), 2, 2
    )
    assert two.fits and two.need_bytes == pytest.approx(result.need_bytes, rel=0.02)


def _trainer_dims(cfg, world_size: int):
    """The layout as ``Trainer._validate_and_load_data`` validates it."""
    from trainer.planner.context import dims_of

    return dims_of(cfg, world_size, "cpu")


def test_the_check_plans_the_trainers_validated_layout(monkeypatch: pytest.MonkeyPatch) -> None:
    """Given the trainer's ``ParallelDims`` the check plans them as they are (no second validation of
    the layout; only the fixes it re-plans, which change the layout, are validated) to the same
    answer; whether DDP is on is the layout's own ``ddp_enabled`` (dp_shard=-1 that resolves to 1
    included), so the FSDP and ZeRO-1 fixes are offered there too."""
    from trainer.planner import context

    monkeypatch.setattr(fit, "host_memory_bytes", lambda: 24 * GIB)
    monkeypatch.setattr(fit, "process_rss_bytes", lambda: 0.5 * GIB)
    cpu = torch.device("cpu")
    two = compose_config("+experiment=38m_ddp", "parallelism.dp_replicate=2")
    eight = compose_config("+experiment=38m_ddp")
    two_dims, eight_dims = _trainer_dims(two, 2), _trainer_dims(eight, 8)  # the trainer's, validated
    validations: list[int] = []
    validate = context.validated_dims
    monkeypatch.setattr(context, "validated_dims", lambda *a, **k: validations.append(1) or validate(*a, **k))
    fits = fit.check_memory(two, cpu, 2, 2)
    assert fits.fits and validations == [1]
    assert fit.check_memory(two, cpu, 2, 2, dims=two_dims) == fits and validations == [1]
    assert fit.check_memory(eight, cpu, 8, 8, dims=eight_dims) == fit.check_memory(eight, cpu, 8, 8)
    resolved = compose_config("+experiment=38m_ddp", "parallelism.dp_shard=-1")
    result = fit.check_memory(resolved, cpu, 8, 8, dims=_trainer_dims(resolved, 8))
    assert not result.fits and "(FSDP)" in result.message and "(ZeRO-1)" in result.message


def test_trainer_errors_before_any_output_or_warns(tmp_path, monkeypatch: pytest.MonkeyPatch, capfd) -> None:
    """``error`` (default): ConfigError in the constructor, no run folder; ``warn``: trains, logs why;
    ``off``: no check. The host here has 64 MiB (fewer than the tiny run's own process)."""
    from trainer.train import Trainer

    monkeypatch.setattr(fit, "host_memory_bytes", lambda: 64 * 2**20)
    run = tmp_path / "run"
    with pytest.raises(
        ConfigError, match=r"metrics.memory_check=error: the planned memory of a rank does not fit"
    ):
        Trainer(tiny_config(str(run), "training.steps=1", "checkpoint.enable=false"))
    assert not run.exists(), "the check runs before the run folder is written"
    capfd.readouterr()
    trainer = Trainer(
        tiny_config(str(run), "training.steps=1", "checkpoint.enable=false", "metrics.memory_check=warn")
    )
    try:
        assert trainer.train()
    finally:
        trainer.close()
    logged = capfd.readouterr()
    assert "metrics.memory_check=warn: the planned memory of a rank does not fit" in logged.out + logged.err
    trainer = Trainer(
        tiny_config(
            str(tmp_path / "off"), "training.steps=1", "checkpoint.enable=false", "metrics.memory_check=off"
        )
    )
    trainer.close()


@pytest.mark.slow
def test_launch_stops_before_the_first_step(tmp_path) -> None:
    """A real ``./launch.sh`` of 2 CPU ranks whose plan needs more than half this host's RAM each:
    every rank exits 2 with the numbers before any collective, and leaves no run folder."""
    args = ("+experiment=38m_ddp", "parallelism.dp_replicate=2", "training.micro_batch_size=256")
    need = fit.check_memory(compose_config(*args), torch.device("cpu"), 2, 2).need_bytes
    if 2 * need <= fit.host_memory_bytes():
        pytest.skip(f"this host has {fit.host_memory_bytes() / GIB:.0f} GiB: the layout fits")
    dump = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")}
    proc = subprocess.run(
        ["./launch.sh", *args, f"job.dump_folder={dump}"],
        cwd=REPO,
        env=env | {"NPROC": "2", "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode != 0
    for rank in (0, 1):
        lines = [
            ln
            for ln in proc.stderr.splitlines()
            if ln.startswith(f"[rank{rank}] config error: metrics.memory_check")
        ]
        assert lines, proc.stderr[-3000:]
        assert "x 2 rank(s)" in lines[0] and "training.activation_checkpoint=full ->" in lines[0]
    print("\n" + lines[0])
    assert not dump.exists()
