"""Fault-tolerant data parallelism on torchft, launched as a user does: ``FT_GROUPS=2 NPROC=1 ./launch.sh``
(a lighthouse and two replica groups, each its own torchrun, under trainer/resilience/supervisor.py).

* no faults: losses, gradient norms and final weights equal plain DDP x2 (the same config with
  ``parallelism.dp_replicate=2``) on the same batches within 1e-6, and both groups hold bitwise
  equal weights and optimizer state at every step;
* failures in one job: a group SIGKILLed inside a step (the survivor, inside the gradient
  all-reduce, discards that step and keeps committing steps alone; the group restarts and heals
  bitwise), SIGSTOP of a group (the hang watchdog kills it, it restarts and
  heals), then SIGKILL of every group (all restart and resume from the DCP checkpoint exactly), with
  the data accounting: every committed step advances the data position by exactly the samples of
  its participants.
"""

from __future__ import annotations

import os
import signal

import pytest

from tests.configs import TINY, tiny_config
from tests.ft_harness import FT_FAST, FTJob, compare_with_ddp, stalls, weight_error
from trainer.checkpoint.checkpointer import complete_steps, read_marker
from trainer.config import ConfigError, compose_config
from trainer.resilience.fault_tolerance import KILL_ENV, check_environment

pytest.importorskip("torchft")

FT = "parallelism.fault_tolerance"


def test_config_errors() -> None:
    """Bad fault-tolerance settings fail at validation, naming the key and the fix."""
    base = ("+experiment=debug", "parallelism.dp_replicate=2", f"{FT}.enable=true")
    cases = {
        f"{FT}.replica_group_id=2": "replica_group_id=2 must lie in [0, parallelism.dp_replicate=2)",
        f"{FT}.min_replicas=3": "min_replicas=3 must lie in [1, parallelism.dp_replicate=2]",
        f"{FT}.startup_wait_s=-1": "startup_wait_s=-1.0 must be >= 0",
        "parallelism.ddp.impl=torch": "Set parallelism.ddp.impl=custom",
        "parallelism.ddp.sharded_optimizer=true": "parallelism.ddp.sharded_optimizer=false",
        "training.global_batch_size=15": "multiple of parallelism.dp_replicate=2",
        "optimizer.qk_clip_tau=50": "optimizer.qk_clip_tau=0",
        "model=moe_debug": "not supported for MoE models (model.num_experts=8)",
    }
    for override, message in cases.items():
        with pytest.raises(ConfigError, match=None) as err:
            compose_config(*base, override)
        assert message in str(err.value), (override, str(err.value))
    # No lighthouse address anywhere: refused before any process group (trainer/main.py exits 2 on it).
    cfg = compose_config(*base)
    os.environ.pop("TORCHFT_LIGHTHOUSE", None)
    with pytest.raises(ConfigError) as err:
        check_environment(cfg)
    assert "TORCHFT_LIGHTHOUSE" in str(err.value) and f"{FT}.lighthouse" in str(err.value)


OWN = ("training.steps=8", "checkpoint.enable=true", "checkpoint.interval=100", *FT_FAST)
RUN = (*TINY, *OWN)


@pytest.mark.slow
def test_two_groups_match_ddp(tmp_path) -> None:
    """No faults: two replica groups of one rank train exactly what plain DDP x2 trains (the
    reference: the same config with parallelism.dp_replicate=2 on 2 ranks of the test harness, while
    the FT job runs; the same Trainer as under ./launch.sh, without its 3 interpreters)."""
    from tests.parity import Case, gather_cases

    job = FTJob(str(tmp_path / "ft"), (*RUN, f"{FT}.min_replicas=2"))
    ref_dump = str(tmp_path / "ddp")
    try:
        ddp = tiny_config(ref_dump, *OWN, "parallelism.dp_replicate=2")
        gather_cases({"ddp": Case(2, ddp, params=False)}, world=2)
    except BaseException:
        job.stop()
        raise
    try:
        assert job.wait(timeout=600) == 0, job.log()
    finally:
        job.stop()
    import json

    with open(os.path.join(ref_dump, "metrics.jsonl"), encoding="utf-8") as f:
        expected = [r for r in map(json.loads, f) if "loss" in r]
    groups = [job.records(0), job.records(1)]
    assert [r["step"] for r in groups[0]] == [r["step"] for r in expected] == list(range(1, 9))
    worst = compare_with_ddp(groups, expected)
    weight_err = weight_error(
        os.path.join(job.dump, "checkpoints", "step-8"), os.path.join(ref_dump, "checkpoints", "step-8")
    )
    print(
        f"FT 2 groups vs DDP x2: max relative loss/grad-norm error {worst:.2e}, max weight error "
        f"{weight_err:.2e}"
    )
    assert worst <= 1e-6 and weight_err <= 1e-6


@pytest.mark.slow
def test_failures_heal_and_resume(tmp_path) -> None:
    """SIGKILL inside a step, SIGSTOP, then every group killed, in one job of 2 groups (min_replicas=1). The
    job is
    long (steps=100000); the test stops it once every scenario has been seen."""
    job = FTJob(
        str(tmp_path / "ft"),
        (
            *TINY,
            "training.steps=100000",
            "checkpoint.enable=true",
            "checkpoint.interval=10",
            "checkpoint.keep_latest=0",
            *FT_FAST,
            f"{FT}.min_replicas=1",
            f"{FT}.quorum_timeout_s=12",
            f"{FT}.hang_timeout_s=14",
            f"{FT}.startup_wait_s=10",
        ),
        step_delay_s=0.1,
        env={KILL_ENV: "1@6"},
    )

    heal_times: list[float] = []

    def healed_after(step: int) -> bool:  # group 1 healed past ``step`` and trained a step with group 0 since
        records = job.records(1)
        heals = [r for r in records if r.get("ft/heal_s") and r["step"] > step]
        if not heals or records[-1]["ft/participants"] != 2 or records[-1]["step"] <= heals[0]["step"]:
            return False
        heal_times.append(heals[0]["ft/heal_s"])
        return True

    try:
        # 1. Group 1 SIGKILLs itself after the forward of its first step >= 6 (test hook): group 0 is inside
        # that step's
        # gradient all-reduce when its peer disappears; it discards the step and keeps committing steps
        # alone; group 1 restarts and heals.
        job.wait_for(
            lambda: any(r.get("ft/discarded_steps") for r in job.records(0)), 300, "a discarded step"
        )
        died = next(r for r in job.records(0) if r["ft/discarded_steps"])  # the step group 1 died in
        killed_at = died["step"] - 1
        job.wait_for(
            lambda: any(r["step"] > killed_at and r["ft/participants"] == 1 for r in job.records(0)),
            60,
            "the survivor to commit a step alone",
        )
        job.wait_for(lambda: healed_after(killed_at), 300, "group 1 to heal after SIGKILL")
        # 2. SIGSTOP group 1: the supervisor's hang watchdog kills it; it restarts and heals again.
        stopped_at = job.last_step(0)
        job.signal_group(1, signal.SIGSTOP)
        job.wait_for(lambda: healed_after(stopped_at), 300, "group 1 to heal after SIGSTOP")
        # 3. every group dies: the supervisor restarts both, and they resume from the DCP checkpoint.
        # Killed a few steps past a checkpoint written after group 1 rejoined, so that the steps
        # since that checkpoint all had both groups (and can be replayed with the same batches).
        rejoined = job.records(1)[-1]["step"]
        ckpt = -(-rejoined // 10) * 10
        job.wait_for(lambda: job.last_step(0) >= ckpt + 3 and job.last_step(0) % 10 >= 3, 120, "a checkpoint")
        for group in (0, 1):
            job.signal_group(group, signal.SIGKILL)
        exits = lambda: sum("exited" in line for line in job.supervisor_lines())  # noqa: E731
        job.wait_for(lambda: exits() >= 4, 60, "both groups to be restarted")  # 1 kill + 1 hang + these 2
        first_run = job.records(0)  # on resume the metrics log drops the steps after the checkpoint
        lost_at = first_run[-1]["step"]
        job.wait_for(lambda: job.last_step(0) >= lost_at + 2, 300, "the resumed run past the lost step")
    finally:
        job.stop()
    log = "".join(job.supervisor_lines())
    assert "hang watchdog" in log, log
    g0, g1 = job.records(0), job.records(1)
    resumed_from = lost_at - lost_at % 10
    replay = g0[resumed_from:]
    assert [r["step"] for r in first_run] == list(range(1, lost_at + 1))
    # The survivor never stopped: it committed steps alone while group 1 was down.
    alone = [r["step"] for r in first_run if r["ft/participants"] == 1]
    # the step group 1 died in: discarded once by group 0, retried and committed alone
    assert died["ft/participants"] == 1 and died["ft/discarded_steps"] == 1, died
    assert first_run[killed_at - 1]["ft/participants"] == 2, first_run[killed_at - 1]
    assert any(killed_at < s < stopped_at for s in alone) and any(s > stopped_at for s in alone), alone
    median = sorted(r["step_time_s"] for r in first_run)[len(first_run) // 2]
    print(
        f"survivor: median step {median:.2f}s; quorum changes (step, kind, s, discarded):",
        [(x["step"], x["kind"], round(x["stall_s"], 2), x["discarded"]) for x in stalls(first_run)],
        f"steps alone: {len(alone)}",
    )
    print("group 1 heal times (s):", [round(t, 2) for t in heal_times])
    # Bitwise equal replicas: the same weights + optimizer digest wherever both groups logged a step.
    by_step: dict[int, set[str]] = {}
    for r in g0 + g1:
        by_step.setdefault(r["step"], set()).add(r["ft/state_sha"])
    shared = {r["step"] for r in g1} & {r["step"] for r in first_run}
    assert len(shared) >= 5 and all(len(by_step[step]) == 1 for step in shared), "replica groups differ"
    # Every group lost: the steps after the checkpoint are trained again, exactly as the first time
    # where the participants agree (the same batches).
    assert lost_at % 10 and replay[0]["step"] == resumed_from + 1, (lost_at, replay[:1])
    before = {r["step"]: r for r in first_run}
    same = []  # the replayed steps whose history since the checkpoint had the same participants
    for r in replay:
        if r["step"] > lost_at or r["ft/participants"] != before[r["step"]]["ft/participants"]:
            break
        same.append(r["step"])
    assert same, "the first replayed step had other participants than the first time"
    for step in same:
        again = next(r for r in replay if r["step"] == step)
        assert again["loss"] == before[step]["loss"] and again["ft/state_sha"] == before[step]["ft/state_sha"]
    print(
        f"all groups lost after step {lost_at}: resumed from step-{resumed_from}, steps {same} replayed "
        "bitwise"
    )
    # Data accounting: step s trains samples [position, position + participants * b), the participant of
    # quorum rank r the r-th b of them; each committed step starts where the previous one ended (through
    # the kills, the heals and the resume), so no sample is trained twice or skipped, and the position
    # saved in the newest checkpoint (tokens_seen) is the sum over the history that led to it.
    # The committed history is group 0's, and group 1's for the steps group 0 has no record of: quorum
    # rank 0's group writes the checkpoints, and after the restart that can be group 1, which, when the
    # job is stopped, may commit and checkpoint a last step that group 0 (signalled inside it) never logs.
    final = {r["step"]: r for r in first_run[:resumed_from] + replay}
    for r in g1:
        if r["step"] > resumed_from:
            final.setdefault(r["step"], r)
    newest = max(complete_steps(os.path.join(job.dump, "checkpoints")))
    missing = [s for s in range(1, max(max(final), newest) + 1) if s not in final]
    assert not missing, (
        missing,
        [r["step"] for r in replay],
        [r["step"] for r in g1 if r["step"] > resumed_from],
    )
    batch = 8 // 2  # global_batch_size / dp_replicate
    position = 0
    for step in range(1, max(final) + 1):
        assert final[step]["ft/data_position"] == position, (step, final[step], position)
        position += final[step]["ft/participants"] * batch
    saved = sum(final[step]["ft/participants"] * batch for step in range(1, newest + 1))
    assert read_marker(os.path.join(job.dump, "checkpoints", f"step-{newest}"))["tokens_seen"] == saved * 32
    print(f"data: {position} samples in {max(final)} committed steps, each once; step-{newest} holds {saved}")
