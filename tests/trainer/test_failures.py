"""Failures that must stop every rank, saying where: a collective one rank never enters (hang),
and a NaN on one rank. Real 2-rank torchrun jobs on gloo, with the test-only hooks
``MESHWRIGHT_TEST_SKIP_COLLECTIVE_AT`` (trainer/resilience/preemption.py) and ``MESHWRIGHT_TEST_NAN_AT``
(trainer/resilience/guards.py)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import threading
import time

import pytest

from tests.configs import REPO, TINY
from trainer.checkpoint.checkpointer import complete_steps, read_marker, verify_files

pytestmark = pytest.mark.slow

TRAIN_TIMEOUT_S = 10


def _start(dump: str, *extra: str, env_extra: dict[str, str]) -> subprocess.Popen:
    env = dict(os.environ, OMP_NUM_THREADS="1", **env_extra)
    for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    cmd = [
        "torchrun",
        "--standalone",
        "--nproc_per_node=2",
        "trainer/main.py",
        *TINY,
        f"job.dump_folder={dump}",
        *extra,
    ]
    return subprocess.Popen(
        cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def test_rank_skipping_a_collective_stops_every_rank_naming_step_and_collective(tmp_path) -> None:
    """Rank 1 leaves out the stop-flag all-reduce of step 3: rank 0 waits in it, rank 1 waits in the
    first collective of step 4. Both time out after comm.train_timeout_s and exit 4, each naming
    its step and collective; torchrun is done within train_timeout_s + 30 s of the skip."""
    proc = _start(
        str(tmp_path / "run"),
        f"comm.train_timeout_s={TRAIN_TIMEOUT_S}",
        env_extra={"MESHWRIGHT_TEST_SKIP_COLLECTIVE_AT": "1@3"},
    )
    lines: list[str] = []
    skipped_at: list[float] = []

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if "leaves out the stop-flag all-reduce of step 3" in line:
                skipped_at.append(time.monotonic())

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    proc.wait(timeout=400)
    done = time.monotonic()
    reader.join(timeout=10)
    out = "".join(lines)
    assert skipped_at, out[-3000:]
    elapsed = done - skipped_at[0]
    print(f"hang: every rank exited {elapsed:.1f}s after the skipped collective (timeout {TRAIN_TIMEOUT_S}s)")
    assert proc.returncode != 0
    assert elapsed <= TRAIN_TIMEOUT_S + 30, out[-3000:]
    reports = {}
    for rank in (0, 1):
        m = re.search(
            rf"\[rank{rank}\] collective failed at step (\d+) \(collective timeout {TRAIN_TIMEOUT_S}s\): "
            r"(gloo:\w+) on process group (\S+) .* did not complete",
            out,
        )
        assert m, out[-4000:]
        reports[rank] = (int(m.group(1)), m.group(2), m.group(3))
    assert reports[0][:2] == (3, "gloo:all_reduce"), reports  # the stop-flag agreement rank 1 left out
    assert reports[1][0] == 4, reports  # rank 1 went on into step 4 and waited there
    for rank in (0, 1):
        trace = json.load(open(tmp_path / "run" / "comm_traces" / f"rank_{rank}.json"))
        assert trace["step"] == reports[rank][0] and trace["entries"]


def test_nan_on_one_rank_stops_every_rank_before_the_step(tmp_path) -> None:
    """Rank 1's forward returns NaN at step 5: both ranks stop before the optimizer step, naming
    rank 1 and step 5; the checkpoints of steps 2 and 4 stay complete and nothing of step 5 is
    written."""
    dump = str(tmp_path / "run")
    proc = _start(
        dump, "checkpoint.enable=true", "checkpoint.interval=2", env_extra={"MESHWRIGHT_TEST_NAN_AT": "1@5"}
    )
    out, _ = proc.communicate(timeout=400)
    assert proc.returncode != 0
    for rank in (0, 1):
        assert re.search(
            rf"\[rank{rank}\] training stopped: non-finite loss on rank 1 at step 5 \(global gradient "
            r"norm nan\); every rank stopped before the optimizer step",
            out,
        ), out[-4000:]
    folder = os.path.join(dump, "checkpoints")
    assert complete_steps(folder) == [2, 4]
    assert sorted(os.listdir(folder)) == ["step-2", "step-4"]  # no leftover of a step-5 save
    path = os.path.join(folder, "step-4")
    verify_files(path, read_marker(path))
    steps = [json.loads(line)["step"] for line in open(os.path.join(dump, "metrics.jsonl"))]
    assert steps == [1, 2, 3, 4]
