"""After a resume every tracker holds each step once; W&B (offline) gets the scalars and the
resolved config; profiling writes a trace and a top-ops table for the chosen step."""

from __future__ import annotations

import glob
import importlib.util
import json
import os
import subprocess

import pytest

from tests.configs import REPO, TINY

pytestmark = pytest.mark.slow

# Checkpoint at 4 only: the first run logs steps 5-6 after it, the second resumes at 4.
RUN = (
    *TINY,
    "training.steps=6",
    "training.deterministic=true",
    "checkpoint.enable=true",
    "checkpoint.interval=4",
    "checkpoint.save_final=false",
    "metrics.tensorboard=true",
    "profiling.enable=true",
    "profiling.steps=[2]",
)
# W&B is an optional extra (part of '.[dev]'); without it the rest of the test still runs.
HAS_WANDB = importlib.util.find_spec("wandb") is not None
WANDB = ("metrics.wandb=true", "metrics.wandb_mode=offline") if HAS_WANDB else ()


def _run(dump: str) -> str:
    env = dict(os.environ, OMP_NUM_THREADS="1", WANDB_SILENT="true")
    for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    proc = subprocess.run(
        ["python", "trainer/main.py", *RUN, *WANDB, f"job.dump_folder={dump}"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout + proc.stderr


def test_resume_keeps_each_step_once_in_every_tracker(tmp_path) -> None:
    dump = str(tmp_path / "run")
    _run(dump)
    first = [json.loads(line)["step"] for line in open(os.path.join(dump, "metrics.jsonl"))]
    assert first == [1, 2, 3, 4, 5, 6]
    out = _run(dump)
    assert "loaded step 4" in out and "dropped 2 records after step 4" in out, out[-3000:]

    records = [json.loads(line) for line in open(os.path.join(dump, "metrics.jsonl"))]
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(os.path.join(dump, "tb"))
    acc.Reload()
    assert [e.step for e in acc.Scalars("loss")] == [1, 2, 3, 4, 5, 6]
    tb = {e.step: e.value for e in acc.Scalars("loss")}
    assert all(abs(tb[r["step"]] - r["loss"]) < 1e-6 for r in records)

    if HAS_WANDB:
        _check_wandb(dump, records)

    profile = os.path.join(dump, "profile", "step-2")
    assert sorted(os.listdir(profile)) == ["rank0.top_ops.txt", "rank0.trace.json"]
    trace = json.load(open(os.path.join(profile, "rank0.trace.json")))
    assert any(e.get("name", "").startswith("aten::") for e in trace["traceEvents"])
    assert "aten::" in open(os.path.join(profile, "rank0.top_ops.txt")).read()


def _check_wandb(dump: str, records: list[dict]) -> None:
    """One W&B run over both attempts, each step once with the metrics.jsonl values, and the config."""
    from tests.wandb_records import history

    runs = sorted(glob.glob(os.path.join(dump, "wandb", "offline-run-*", "run-*.wandb")))
    assert len(runs) == 2 and len({os.path.basename(r) for r in runs}) == 1, runs  # one W&B run, two attempts
    rows = [row for path in runs for row in history(path)[0]]
    assert sorted(row["_step"] for row in rows) == [1, 2, 3, 4, 5, 6]
    for row in rows:
        want = records[row["_step"] - 1]
        assert set(want) - {"step", "mfu"} <= set(row), (row, want)
        assert row["loss"] == want["loss"]
    config = history(runs[0])[1]
    assert config["training"]["steps"] == 6 and config["job"]["dump_folder"] == dump
