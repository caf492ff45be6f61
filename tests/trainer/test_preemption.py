"""SIGUSR1 (Slurm's warning) or SIGTERM to a running 2-rank torchrun job: every rank agrees at the
step boundary, writes a checkpoint and exits with status 75; the same command then resumes and
reproduces the uninterrupted run bitwise, with each step once in metrics.jsonl.

SIGUSR1 goes to ``./launch.sh``'s torchrun (which forwards it because launch.sh lists it in
``PET_SIGNALS_TO_HANDLE``); SIGTERM to a plain ``torchrun``, which forwards it by default.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time

import pytest

from tests.configs import REPO, TINY, tiny_config
from tests.parity import Case, gather_cases
from trainer.checkpoint.checkpointer import complete_steps, read_marker, verify_files

pytestmark = pytest.mark.slow

# 16 steps: the signal is sent once step 3 is logged and handled at the next step boundary (a
# TINY step takes ~0.1-0.3 s on 2 loaded cores), so the run is still far from its end.
STEPS = 16
OWN = (
    f"training.steps={STEPS}",
    "training.deterministic=true",
    "checkpoint.enable=true",
    "checkpoint.interval=100",
)
RUN = (*TINY, *OWN)


def _env() -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", NPROC="2")
    for key in (
        "RANK",
        "WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
        "PET_SIGNALS_TO_HANDLE",
        "TORCHELASTIC_SIGNALS_TO_HANDLE",
    ):
        env.pop(key, None)
    return env


def _start(how: str, dump: str) -> subprocess.Popen:
    if how == "launch":
        cmd = ["./launch.sh", *RUN, f"job.dump_folder={dump}"]
    else:
        cmd = [
            "torchrun",
            "--standalone",
            "--nproc_per_node=2",
            "trainer/main.py",
            *RUN,
            f"job.dump_folder={dump}",
        ]
    return subprocess.Popen(
        cmd, cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def _losses(dump: str) -> list[tuple[int, float]]:
    with open(os.path.join(dump, "metrics.jsonl"), encoding="utf-8") as f:
        return [(r["step"], r["loss"]) for r in map(json.loads, f) if "loss" in r]


def _wait_for_step(proc: subprocess.Popen, dump: str, step: int) -> None:
    end = time.monotonic() + 300
    path = os.path.join(dump, "metrics.jsonl")
    while not (os.path.exists(path) and len(_losses(dump)) >= step):
        assert proc.poll() is None and time.monotonic() < end, proc.communicate()[0][-3000:]
        time.sleep(0.2)


def test_signal_checkpoints_exits_75_and_resumes_bitwise(tmp_path) -> None:
    cases = {"SIGUSR1": ("launch", signal.SIGUSR1), "SIGTERM": ("torchrun", signal.SIGTERM)}
    dumps = {name: str(tmp_path / name) for name in cases}
    procs = {name: _start(how, dumps[name]) for name, (how, _) in cases.items()}
    for name, (_, sig) in cases.items():
        _wait_for_step(procs[name], dumps[name], 3)
        procs[name].send_signal(sig)  # the torchrun process (launch.sh execs it)
    # The uninterrupted run meanwhile, on 2 ranks of the test harness: the same Trainer and config as
    # under torchrun (bitwise the same losses), without starting 3 more interpreters.
    straight_dump = str(tmp_path / "straight")
    gather_cases({"straight": Case(2, tiny_config(straight_dump, *OWN), params=False)}, world=2)

    stopped_at = {}
    for name, proc in procs.items():
        out, _ = proc.communicate(timeout=300)
        assert proc.returncode != 0, out[-3000:]  # torchrun reports its workers' status 75 as a failure
        steps = set()
        for rank in (0, 1):
            m = re.search(
                rf"\[rank{rank}\] preempted by {name} after step (\d+): checkpoint of step \1 written; "
                r"run the same command again to resume \(exit status 75\)",
                out,
            )
            assert m, (name, out[-4000:])
            steps.add(int(m.group(1)))
        assert len(steps) == 1, steps  # all ranks agreed on the step
        step = steps.pop()
        assert 3 <= step < STEPS
        folder = os.path.join(dumps[name], "checkpoints")
        assert complete_steps(folder) == [step]
        path = os.path.join(folder, f"step-{step}")
        verify_files(path, read_marker(path))
        stopped_at[name] = step

    want = _losses(straight_dump)
    assert [s for s, _ in want] == list(range(1, STEPS + 1))

    resumed = {name: _start("torchrun", dumps[name]) for name in cases}
    for name, proc in resumed.items():
        out, _ = proc.communicate(timeout=300)
        assert proc.returncode == 0, out[-3000:]
        assert f"loaded step {stopped_at[name]}" in out, out[-3000:]
        assert _losses(dumps[name]) == want, name  # bitwise, each step once
