"""The planner's walk of a pipeline rank's schedule (``trainer/planner/pipeline_memory.py``): torch's
order of forwards and backwards, and what the walk holds at each. (Its figures against the rehearsal's
MemTracker: ``test_rehearse_pp.py`` and ``test_rehearse_presets.py``, where the PP peak is checked.)"""

from __future__ import annotations

from types import SimpleNamespace
from typing import cast

import pytest

from trainer.planner.context import PlanContext
from trainer.planner.pipeline_memory import StageBytes, schedule_actions, walk_schedule


def _context(schedule: str, pp: int, microbatches: int, stages_per_rank: int = 1) -> PlanContext:
    return cast(
        PlanContext,
        SimpleNamespace(
            schedule=schedule,
            accum=microbatches,
            stages_per_rank=stages_per_rank,
            dims=SimpleNamespace(pp=pp),
        ),
    )


def test_1f1b_order_is_torchs_warmup_then_one_backward_one_forward() -> None:
    # Schedule1F1B: min(M, pp - rank) warm-up forwards, then B/F pairs, then the remaining backwards
    assert (
        schedule_actions(_context("1F1B", 4, 6), 1)
        == [("F", 0)] * 3 + [("B", 0), ("F", 0)] * 3 + [("B", 0)] * 3
    )
    assert schedule_actions(_context("GPipe", 4, 3), 2) == [("F", 0)] * 3 + [("B", 0)] * 3


def test_interleaved_order_comes_from_torchs_schedule() -> None:
    from torch.distributed.pipelining.schedules import _get_warmup_ops

    actions = schedule_actions(_context("Interleaved1F1B", 4, 8, 2), 0)
    assert len(actions) == 2 * 2 * 8 and sorted(set(actions)) == [("B", 0), ("B", 1), ("F", 0), ("F", 1)]
    warmup = _get_warmup_ops(0, 2, 4, 4, 8)  # torch's own count of rank 0's warm-up forwards
    # the warm-up, then the steady state's first forward, then its first backward
    assert [kind for kind, _ in actions[: warmup + 2]] == ["F"] * (warmup + 1) + ["B"]
    assert schedule_actions(_context("ZBVZeroBubble", 4, 8, 2), 0) == []  # bounded, not walked


def test_the_walk_holds_unsharded_gradients_from_a_stages_first_backward_to_its_last() -> None:
    stage = StageBytes(
        micro=10.0,
        unsharded_grads=100.0,
        grad_transient=1.0,
        sharded_grads=5.0,
        gathered=0.0,
        plain_transient=3.0,
    )
    actions = schedule_actions(_context("1F1B", 4, 6), 0)  # 4 in flight on the first stage
    walk = walk_schedule(actions, [stage], recompute=2.0, fsdp=True)
    assert walk.flight == [4] and walk.saved_peak == 40.0
    # a steady-state backward: 4 microbatches saved, the accumulated unsharded gradients, one block
    # recomputed with its unit's gradient
    assert walk.peak == pytest.approx(40.0 + 100.0 + 1.0 + 2.0)
    # without FSDP the stage's own gradients are held from its first backward instead, and the blocks'
    # backward holds its own temporaries (the feed-forward's activation gradients) beyond them
    assert walk_schedule(actions, [stage], recompute=2.0, fsdp=False).peak == pytest.approx(
        40.0 + 5.0 + 3.0 + 2.0
    )
