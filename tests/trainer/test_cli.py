"""The user-facing commands, run for real: ./launch.sh and torchrun with bad configs."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from tests.configs import REPO

pytestmark = pytest.mark.slow


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = "1"
    env.pop("RANK", None)
    env.pop("WORLD_SIZE", None)
    return env


def _torchrun(nproc: int, *args: str, timeout: int = 240) -> subprocess.CompletedProcess:
    cmd = ["torchrun", "--standalone", f"--nproc_per_node={nproc}", "trainer/main.py", *args]
    return subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=timeout)


def test_launch_default_trains_and_leaves_run_folder(tmp_path) -> None:
    """./launch.sh (2 CPU ranks) trains with falling loss and writes config, metrics and TB events."""
    dump = tmp_path / "run"
    env = _env() | {"NPROC": "2"}
    proc = subprocess.run(
        ["./launch.sh", "+experiment=debug", "training.steps=16", "metrics.log_freq=4", "training.eval_freq=8",
         "data.max_documents=300", f"job.dump_folder={dump}"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert (dump / "config.yaml").is_file()
    assert (dump / "checkpoints" / "step-16" / "checkpoint.json").is_file(), (
        "the run must end with a checkpoint"
    )
    records = [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if "loss" in r]
    evals = [r for r in records if "eval_loss" in r]
    assert [r["step"] for r in train] == [1, 4, 8, 12, 16]
    assert len(evals) == 2
    for key in ("loss", "grad_norm", "lr", "tokens_per_sec", "tflops", "mfu", "memory_gib"):
        assert key in train[0]
    assert train[-1]["loss"] < train[0]["loss"] - 1.0, [r["loss"] for r in train]

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(dump / "tb"))
    acc.Reload()
    tb_loss = [(e.step, e.value) for e in acc.Scalars("loss")]
    assert [s for s, _ in tb_loss] == [r["step"] for r in train]
    assert all(abs(v - r["loss"]) < 1e-4 * max(1.0, abs(v)) for (_, v), r in zip(tb_loss, train))
    assert "eval_loss" in acc.Tags()["scalars"]


BAD_CONFIGS = [
    (("parallelism.tp=3",), "parallelism", "3"),
    (("training.global_batch_size=10",), "global_batch_size=10", "multiple of"),
    (("data=text", "data.path=/nonexistent/corpus"), "/nonexistent/corpus", ""),
    (("parallelism.dp_replicate=4", "parallelism.dp_shard=1"), "world size is 2", ""),
]


@pytest.mark.parametrize("overrides,needle,fix", BAD_CONFIGS)
def test_bad_config_fails_on_every_rank_before_collectives(tmp_path, overrides, needle, fix) -> None:
    dump = tmp_path / "run"
    proc = _torchrun(2, "+experiment=debug", f"job.dump_folder={dump}", *overrides)
    assert proc.returncode != 0
    for rank in (0, 1):
        lines = [ln for ln in proc.stderr.splitlines() if ln.startswith(f"[rank{rank}] config error:")]
        assert lines, proc.stderr[-3000:]
        assert needle in lines[0] and fix in lines[0], lines[0]
    assert not dump.exists(), "a failed config must leave no output behind"


def test_unknown_preset_and_key_fail_with_hydra_message(tmp_path) -> None:
    proc = _torchrun(1, "+experiment=debug", "model=no_such_model", f"job.dump_folder={tmp_path / 'x'}")
    assert proc.returncode != 0
    assert "no_such_model" in proc.stderr and "Available options" in proc.stderr
    proc = _torchrun(1, "+experiment=debug", "training.no_such_key=1", f"job.dump_folder={tmp_path / 'y'}")
    assert proc.returncode != 0 and "no_such_key" in proc.stderr


def test_launch_two_nodes_without_slurm_matches_one_node(tmp_path) -> None:
    """NNODES=2 NODE_RANK=0|1 RDZV_ENDPOINT=localhost:PORT in two processes, as on two machines,
    gives the losses of one node with the same number of ranks."""
    from tests.configs import TINY
    from tests.dist import free_port

    run = (*TINY, "training.deterministic=true")
    endpoint = f"localhost:{free_port()}"
    nodes = [
        subprocess.Popen(
            ["./launch.sh", *run, f"job.dump_folder={tmp_path / 'two_nodes'}"], cwd=REPO,
            env=_env() | {"NNODES": "2", "NODE_RANK": str(r), "NPROC": "1", "RDZV_ENDPOINT": endpoint,
                          "RDZV_ID": f"test-{os.getpid()}"},
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        for r in (0, 1)
    ]  # fmt: skip
    single = _torchrun(2, *run, f"job.dump_folder={tmp_path / 'one_node'}")
    assert single.returncode == 0, single.stderr[-3000:]
    for node in nodes:
        out, _ = node.communicate(timeout=300)
        assert node.returncode == 0, out[-3000:]

    def losses(name: str) -> list[tuple[int, float]]:
        lines = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
        return [(r["step"], r["loss"]) for r in map(json.loads, lines) if "loss" in r]

    assert [s for s, _ in losses("one_node")] == list(range(1, 9))
    assert losses("two_nodes") == losses("one_node")
