"""kill -9 at every phase of a save: the next run resumes from the last complete checkpoint
and reproduces the uninterrupted run's losses bitwise; leftovers are cleaned up.

Real CLI processes (``python trainer/main.py``); the ``MESHWRIGHT_TEST_CRASH_AT`` hook in
trainer/checkpoint.py SIGKILLs the process at the named phase of the step-6 save. The runs
checkpoint every 2 steps and keep the latest 2, so the step-6 save also purges step-2.
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from tests.configs import REPO, TINY
from trainer.checkpoint import complete_steps

pytestmark = pytest.mark.slow

COMMON = (*TINY, "training.deterministic=true", "checkpoint.enable=true", "checkpoint.interval=2",
          "checkpoint.keep_latest=2")  # fmt: skip

# phase -> (extra overrides, complete checkpoints right after the kill)
CASES = {
    "before_write": ((), [2, 4]),
    "mid_write": ((), [2, 4]),
    "before_commit": ((), [2, 4]),
    "during_purge": ((), [4, 6]),
    "mid_write_async": (("checkpoint.async_mode=async",), [2, 4]),
}


def _start(dump: str, extra: tuple[str, ...] = (), crash: str | None = None) -> subprocess.Popen:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "MESHWRIGHT_TEST_CRASH_AT"):
        env.pop(key, None)
    if crash:
        env["MESHWRIGHT_TEST_CRASH_AT"] = crash
    cmd = ["python", "trainer/main.py", *COMMON, *extra, f"job.dump_folder={dump}"]
    return subprocess.Popen(
        cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def _finish(proc: subprocess.Popen) -> tuple[int, str]:
    out, _ = proc.communicate(timeout=240)
    return proc.returncode, out


def _losses(dump: str) -> list[tuple[int, float]]:
    with open(os.path.join(dump, "metrics.jsonl"), encoding="utf-8") as f:
        return [(r["step"], r["loss"]) for r in map(json.loads, f) if "loss" in r]


def test_kill_at_every_phase_of_a_save_loses_no_work(tmp_path) -> None:
    dumps = {phase: str(tmp_path / phase) for phase in CASES}
    straight = _start(str(tmp_path / "straight"))
    crashed = {p: _start(d, CASES[p][0], crash=f"{p.removesuffix('_async')}@6") for p, d in dumps.items()}
    rc, out = _finish(straight)
    assert rc == 0, out[-3000:]
    want = dict(_losses(str(tmp_path / "straight")))
    assert sorted(want) == list(range(1, 9))

    for phase, proc in crashed.items():
        rc, out = _finish(proc)
        assert rc == -9, (phase, rc, out[-3000:])  # SIGKILL, nothing ran after the hook
        folder = os.path.join(dumps[phase], "checkpoints")
        assert complete_steps(folder) == CASES[phase][1], (phase, os.listdir(folder))

    resumed = {p: _start(d, CASES[p][0]) for p, d in dumps.items()}
    for phase, proc in resumed.items():
        rc, out = _finish(proc)
        assert rc == 0, (phase, out[-3000:])
        start = CASES[phase][1][-1]
        assert f"loaded step {start}" in out, (phase, out[-2000:])
        assert "an interrupted save or purge" in out, (phase, out[-2000:])  # leftover removed
        records = _losses(dumps[phase])
        after = [(s, loss) for s, loss in records if s > start][-(8 - start) :]
        assert after == [(s, want[s]) for s in range(start + 1, 9)], phase
        folder = os.path.join(dumps[phase], "checkpoints")
        assert sorted(os.listdir(folder)) == ["step-6", "step-8"], (phase, os.listdir(folder))
        mode = os.stat(os.path.join(folder, "step-8")).st_mode & 0o777
        assert mode == 0o750 and os.stat(folder).st_mode & 0o777 == 0o750
