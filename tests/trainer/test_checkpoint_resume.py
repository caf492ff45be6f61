"""Exact resume: 2N steps straight == N steps, stop, resume, N steps (bitwise, fp32 CPU, gloo).

Each layout runs real Trainers inside a spawned process group (one launch per world size runs
its layouts in turn, each in its own folder): the straight run, a run stopped after step 4 (it
checkpoints there), and a fresh Trainer on the same folder that resumes. The async variant also resumes
from a checkpoint that was written in the background
while later steps ran, proving the saved values are those of the saved step.

Training draws from the global RNG (a test-only dropout hook on every block's feed-forward,
``dropout_noise``), so the per-rank RNG state is part of what must be restored: a resumed
Trainer whose RNG is reset instead (the negative control at the end) diverges.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess

import pytest
import torch

from tests.configs import REPO, TINY, tiny_config
from tests.dist import run_distributed
from trainer.config import TrainConfig

pytestmark = pytest.mark.slow

DETERMINISTIC = ("training.deterministic=true",)
LAYOUTS = {
    "single": (1, []),
    "fsdp_x2_async": (2, ["parallelism.dp_shard=2", "checkpoint.async_mode=async"]),
    "custom_ddp_zero1_x2": (
        2,
        ["parallelism.dp_replicate=2", "parallelism.dp_shard=1", "parallelism.ddp.sharded_optimizer=true"],
    ),
    "pp_x2": (2, ["parallelism.pp=2", "parallelism.dp_shard=1"]),
}


def _losses(history: list[dict]) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in history if "loss" in r}


def dropout_noise(trainer) -> None:  # noqa: ANN001
    """Test hook: dropout (p=0.1) on every block's feed-forward output, drawing its masks from
    torch's global (per-rank) RNG -- a stand-in for any model component that uses the RNG."""
    import torch.nn.functional as F

    def hook(module, inputs, output):  # noqa: ANN001, ANN202
        return F.dropout(output, p=0.1, training=True)

    for part in trainer.model_parts:
        for block in part.layers.values():
            block.feed_forward.register_forward_hook(hook)


def _trainer(cfg: TrainConfig):  # noqa: ANN202
    from trainer.train import Trainer

    trainer = Trainer(cfg)
    dropout_noise(trainer)
    return trainer


def _run(cfg: TrainConfig, until: int | None = None) -> tuple[dict[int, float], torch.Tensor]:
    trainer = _trainer(cfg)
    try:
        history = trainer.train(until_step=until)
    finally:
        trainer.close()
    return _losses(history), torch.get_rng_state()


def _resume_worker(rank: int, world_size: int, tmp: str, overrides: list[str]) -> dict:
    ck = ["checkpoint.enable=true", "checkpoint.interval=2", *DETERMINISTIC, *overrides]
    straight, _ = _run(tiny_config(os.path.join(tmp, "straight"), *ck))
    first, rng_at_stop = _run(tiny_config(os.path.join(tmp, "resumed"), *ck), until=4)
    seed = tiny_config(tmp).training.seed
    # Training drew from the RNG: its state is not the freshly seeded one a new Trainer starts with.
    rng_drawn = not torch.equal(rng_at_stop, torch.Generator().manual_seed(seed).get_state())

    trainer = _trainer(tiny_config(os.path.join(tmp, "resumed"), *ck))  # load_step=-1: the newest
    resumed_step = trainer.state.step
    rng_restored = torch.equal(torch.get_rng_state(), rng_at_stop)
    second = _losses(trainer.train())
    trainer.close()
    # Resume again from step 2, written (async: in the background) while steps 3-4 ran.
    from_two, _ = _run(tiny_config(os.path.join(tmp, "resumed"), *ck, "checkpoint.load_step=2"))
    # Negative control: resume from step 4 but reseed instead of restoring the RNG state.
    trainer = _trainer(tiny_config(os.path.join(tmp, "resumed"), *ck, "checkpoint.load_step=4"))
    torch.manual_seed(seed + trainer.state.step)
    unrestored = _losses(trainer.train())
    trainer.close()
    return {
        "straight": straight,
        "first": first,
        "second": second,
        "from_two": from_two,
        "resumed_step": resumed_step,
        "rng_drawn": rng_drawn,
        "rng_restored": rng_restored,
        "unrestored": unrestored,
    }


def _layouts_worker(rank: int, world_size: int, tmp: str, layouts: list[str]) -> dict[str, dict]:
    """Every layout of this world size in turn, each in its own folder (one launch for all)."""
    return {
        name: _resume_worker(rank, world_size, os.path.join(tmp, name), LAYOUTS[name][1]) for name in layouts
    }


@pytest.fixture(scope="module")
def resume_results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict] | BaseException]:
    """Per layout, every rank's results; one launch per world size (a failed launch fails its layouts)."""
    tmp = str(tmp_path_factory.mktemp("resume"))
    out: dict[str, list[dict] | BaseException] = {}
    for world in sorted({w for w, _ in LAYOUTS.values()}):
        names = [n for n, (w, _) in LAYOUTS.items() if w == world]
        try:
            per_rank = run_distributed(_layouts_worker, world, tmp, names, timeout=900)
        except Exception as e:  # noqa: BLE001 -- re-raised by each of the launch's layouts
            out.update({n: e for n in names})
            continue
        out.update({n: [r[n] for r in per_rank] for n in names})
    return out


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_exact_resume(layout: str, resume_results: dict) -> None:
    results = resume_results[layout]
    if isinstance(results, BaseException):
        raise results
    r = results[0]
    assert sorted(r["straight"]) == list(range(1, 9))
    assert r["resumed_step"] == 4 and r["rng_drawn"] and r["rng_restored"]
    assert sorted(r["first"]) == [1, 2, 3, 4] and sorted(r["second"]) == [5, 6, 7, 8]
    # Bitwise: the resumed run continues with exactly the uninterrupted run's losses.
    assert {**r["first"], **r["second"]} == r["straight"], layout
    assert r["from_two"] == {s: r["straight"][s] for s in range(3, 9)}
    # Without the RNG state the same checkpoint gives other losses: the check above can fail.
    assert sorted(r["unrestored"]) == [5, 6, 7, 8]
    assert all(r["unrestored"][s] != r["straight"][s] for s in range(5, 9)), r["unrestored"]
    for other in results[1:]:  # every rank reports the same (globally reduced) losses
        assert other["straight"] == r["straight"] and other["second"] == r["second"]


def test_torchrun_restart_after_crash_resumes_exactly(tmp_path) -> None:
    """torchrun --max-restarts=1: a rank is SIGKILLed after step 5 in the first attempt; the
    restart resumes from step 4 and logs the same losses as an uninterrupted run."""
    common = [
        *TINY,
        *DETERMINISTIC,
        "parallelism.dp_shard=2",
        "checkpoint.enable=true",
        "checkpoint.interval=2",
        "checkpoint.keep_latest=2",
    ]
    # TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: with the store shared between torchrun's rendezvous
    # and init_process_group, a restarted gloo group can read the dead attempt's addresses and
    # fail to connect (pytorch/pytorch#135712).
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        MESHWRIGHT_TEST_CRASH_AT="after_step@5",
        TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1",
    )
    env.pop("RANK", None)
    env.pop("WORLD_SIZE", None)

    def start(dump: str, run_env: dict) -> subprocess.Popen:
        cmd = [
            "torchrun",
            "--standalone",
            "--nproc_per_node=2",
            "--max-restarts=1",
            "trainer/main.py",
            *common,
            f"job.dump_folder={dump}",
        ]
        # Own session: on a timeout the workers die with torchrun instead of lingering. Output to
        # files: the two jobs run side by side, and a full pipe would stall one of them.
        with open(f"{dump}.out", "w") as out, open(f"{dump}.err", "w") as err:
            return subprocess.Popen(
                cmd, cwd=REPO, env=run_env, stdout=out, stderr=err, text=True, start_new_session=True
            )

    def finish(proc: subprocess.Popen, dump: str) -> subprocess.CompletedProcess:
        try:
            proc.wait(timeout=240)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        out, err = ((tmp_path / f"{dump}.{n}").read_text() for n in ("out", "err"))
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)

    # The crashing job and the uninterrupted one run side by side.
    clean_env = {k: v for k, v in env.items() if k != "MESHWRIGHT_TEST_CRASH_AT"}
    procs = {
        "crash": start(str(tmp_path / "crash"), env),
        "straight": start(str(tmp_path / "straight"), clean_env),
    }
    crashed, straight = (finish(procs[name], name) for name in ("crash", "straight"))
    assert crashed.returncode == 0, crashed.stderr[-3000:]
    assert straight.returncode == 0, straight.stderr[-3000:]

    def records(dump: str) -> list[tuple[int, float]]:
        lines = (tmp_path / dump / "metrics.jsonl").read_text().splitlines()
        return [(r["step"], r["loss"]) for r in map(json.loads, lines) if "loss" in r]

    got, want = records("crash"), records("straight")
    # First attempt logged 1..5 and died; the restart resumed at step 4, dropped its record of
    # step 5 from metrics.jsonl and logged 5..8: each step once.
    assert got == want and [s for s, _ in got] == [1, 2, 3, 4, 5, 6, 7, 8]
    assert "loaded step 4" in crashed.stdout + crashed.stderr
    assert sorted(os.listdir(tmp_path / "crash" / "checkpoints")) == ["step-6", "step-8"]
