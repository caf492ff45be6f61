"""kill -9 at every phase of a save: the next run resumes from the last complete checkpoint
and reproduces the uninterrupted run's losses bitwise; leftovers are cleaned up.

Real CLI processes (``python trainer/main.py``); the ``MESHWRIGHT_TEST_CRASH_AT`` hook in
trainer/checkpoint/storage.py SIGKILLs the process at the named phase of the step-6 save. The runs
checkpoint every 2 steps and keep the latest 2, so the step-6 save also purges step-2.

The two-rank test arms the hook in one rank only (the variable is read per process): one
rank dies inside a save while the other waits in a collective.
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from tests.configs import REPO, TINY, tiny_config
from tests.dist import DistributedError, run_distributed
from tests.parity import assert_parity, step_metrics
from trainer.checkpoint.checkpointer import complete_steps
from trainer.config import TrainConfig

pytestmark = pytest.mark.slow

CHECKPOINTING = (
    "training.deterministic=true",
    "checkpoint.enable=true",
    "checkpoint.interval=2",
    "checkpoint.keep_latest=2",
)
COMMON = (*TINY, *CHECKPOINTING)

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


# --------------------------------------------------------------------------------------------
# Two ranks, one of them killed inside a save
# --------------------------------------------------------------------------------------------

MULTI = (*CHECKPOINTING, "parallelism.dp_shard=2")  # FSDP x2: each rank writes its own shards
# case -> (rank to kill, phase, complete checkpoints right after the kill)
MULTI_CASES = {
    "mid_write": (1, "mid_write", [2, 4]),  # rank 1 wrote its shard of step 6, rank 0 is in DCP's gather
    "after_commit": (0, "after_commit", [2, 4, 6]),  # step 6 renamed into place, step 2 not yet purged
}


def _crash_worker(rank: int, world_size: int, cfg: TrainConfig, kill_rank: int, spec: str) -> None:
    """Train with the crash hook armed on ``kill_rank`` only (the env var is per process)."""
    from trainer.checkpoint.storage import CRASH_ENV
    from trainer.train import Trainer

    if rank == kill_rank:
        os.environ[CRASH_ENV] = spec
    trainer = Trainer(cfg)
    trainer.train()
    trainer.close()


def _resume_worker(rank: int, world_size: int, cfgs: dict[str, TrainConfig]) -> dict[str, dict]:
    """The uninterrupted run ("straight") and a resume of each crashed folder, in turn."""
    from trainer.train import Trainer

    out = {}
    for name, cfg in cfgs.items():
        trainer = Trainer(cfg)
        start = trainer.state.step
        history = trainer.train()
        trainer.close()
        out[name] = {"start": start, "history": history}
    return out


def test_one_rank_killed_inside_a_save_resumes_bitwise(tmp_path) -> None:
    """2 ranks (FSDP x2): rank 1 SIGKILLed while writing the step-6 checkpoint (``mid_write``), and
    rank 0 SIGKILLed right after committing it (``after_commit``). The harness names the killed
    rank; the next run resumes from the newest complete checkpoint (4, resp. 6) and logs exactly
    the uninterrupted run's losses and grad norms."""
    dumps = {name: str(tmp_path / name) for name in MULTI_CASES}
    for name, (kill_rank, phase, complete) in MULTI_CASES.items():
        with pytest.raises(DistributedError) as failure:
            run_distributed(
                _crash_worker, 2, tiny_config(dumps[name], *MULTI), kill_rank, f"{phase}@6", timeout=600
            )
        # e.g. "rank 1: killed by signal SIGKILL ...", "rank 0: raised ... Connection closed by peer"
        print(
            f"{name}: "
            + "; ".join(f"rank {r}: {o.strip().splitlines()[-1]}" for r, o in failure.value.outcomes.items())
        )
        assert failure.value.outcomes[kill_rank].startswith("killed by signal SIGKILL"), failure.value
        folder = os.path.join(dumps[name], "checkpoints")
        assert complete_steps(folder) == complete, (name, os.listdir(folder))
        leftovers = [n for n in os.listdir(folder) if ".tmp-" in n]
        assert bool(leftovers) == (phase == "mid_write"), (name, os.listdir(folder))

    cfgs = {
        name: tiny_config(dump, *MULTI)
        for name, dump in {"straight": str(tmp_path / "straight"), **dumps}.items()
    }
    results = run_distributed(_resume_worker, 2, cfgs, timeout=900)[0]
    straight = results["straight"]["history"]
    assert results["straight"]["start"] == 0 and sorted(step_metrics(straight)) == list(range(1, 9))
    for name, (_, _, complete) in MULTI_CASES.items():
        start = results[name]["start"]
        assert start == complete[-1], (name, start)
        want = [r for r in straight if r.get("step", 0) > start]
        # rtol=0: bitwise equal losses and grad norms.
        assert_parity(want, results[name]["history"], rtol=0.0, label=f"{name} resumed at step {start}")
        folder = os.path.join(dumps[name], "checkpoints")
        assert sorted(os.listdir(folder)) == ["step-6", "step-8"], (name, os.listdir(folder))
