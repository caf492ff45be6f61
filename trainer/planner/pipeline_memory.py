"""A pipeline rank's memory over its schedule, action by action (``trainer/planner/memory.py``).

The rank's torch schedule is walked in torch's own order -- 1F1B's warm-up forwards, one backward
and one forward, the cool-down backwards; GPipe's forwards then backwards; interleaved 1F1B's order
from ``ScheduleInterleaved1F1B._calculate_single_rank_operations`` -- and at every action the bytes
then live are summed, so the peak is an instant of the schedule, not a sum of each term's maximum:

- each in-flight microbatch of a local stage holds what the stage saves for backward and its output
  (``fwd_cache``), from its forward to its backward;
- under FSDP the schedule runs every backward with gradient sync off (torch's
  ``backward_maybe_with_nosync``): from a stage's first backward to its ``REDUCE_GRAD`` (after its
  last) each of its FSDP units holds its *unsharded* gradient, accumulated in the reduce dtype; the
  vocab-sharded embedding's comes back replicated over tp (torch's embedding backward), so its
  accumulated gradient is the whole table's. Each backward also makes one unit's gradient in the
  parameter dtype before it is accumulated (the largest unit's is counted);
- without FSDP a stage's gradients are held from its first backward on, and the last block's backward
  holds its feed-forward's activation gradients beyond its saved bytes (the gate product's backward:
  two tokens x hidden tensors; the output projection's: its input's and weight's gradients and the
  float8 casts), and on the last stage the blocks' output gradient, made by the head's backward;
- a backward under full activation checkpointing recomputes one block; on the last stage it starts
  with the loss's backward (two fp32 tokens x vocab gradients) while everything saved is still live;
  the stage's output (the logits) is held until the backward returns (torch's stage keeps it).

Measured against the rehearsal's ``MemTracker`` (``python -m trainer.rehearse``): 405b_4d (32 blocks,
16 microbatches) rank 0 peaked in its first stage's backward at 19.7 GB, 8.4 GB of it the
embedding's accumulated fp32 gradient (the plan without this walk: 11.9 GB). Without FSDP (``debug``,
2 blocks, pp=2) rank 0 peaked in its block's gate-product backward, 1.109 of the plan without the
activation gradients, 1.004 with them.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

from trainer.planner.context import PlanContext

__all__ = ["ScheduleWalk", "schedule_actions", "walk_schedule"]


def schedule_actions(c: PlanContext, pp_rank: int) -> list[tuple[str, int]]:
    """The rank's forwards ("F") and backwards ("B") of one step, in torch's order, by local stage
    index; empty for the schedules not walked (zero-bubble: their split backward is bounded instead)."""
    M, v, pp = c.accum, c.stages_per_rank, c.dims.pp
    name = c.schedule.lower()
    if name == "gpipe":
        return [("F", 0)] * M + [("B", 0)] * M
    if name == "loopedbfs":
        return [("F", s) for s in range(v) for _ in range(M)] + [
            ("B", s) for s in reversed(range(v)) for _ in range(M)
        ]
    if name == "1f1b":
        warmup = min(M, pp - pp_rank)
        steady = [a for _ in range(M - warmup) for a in (("B", 0), ("F", 0))]
        return [("F", 0)] * warmup + steady + [("B", 0)] * warmup
    if name == "interleaved1f1b":
        from torch.distributed.pipelining.schedules import ScheduleInterleaved1F1B, _ComputationType

        rounds = max(1, M // pp)
        shape = SimpleNamespace(
            n_local_stages=v, pp_group_size=pp, microbatches_per_round=M // rounds, _n_microbatches=M
        )
        ops = ScheduleInterleaved1F1B._calculate_single_rank_operations(shape, pp_rank)  # type: ignore[arg-type]
        kinds = {_ComputationType.FORWARD: "F", _ComputationType.FULL_BACKWARD: "B"}
        return [(kinds[a.computation_type], a.stage_index // pp) for a in ops if a is not None]
    return []


@dataclass(frozen=True)
class StageBytes:
    """One local stage's terms for the walk."""

    micro: float  # saved for backward + its output, per in-flight microbatch
    unsharded_grads: float  # FSDP: accumulated unsharded gradients, first backward to REDUCE_GRAD
    grad_transient: float  # FSDP: a block unit's gradient in the parameter dtype during its backward
    sharded_grads: float  # the gradients the stage holds after its REDUCE_GRAD (FSDP) or first backward
    gathered: float  # FSDP without resharding after forward: its units' gathered parameters, first
    # forward to REDUCE_GRAD (which reshards them)
    once: float = 0.0  # held once from the stage's first forward to its last backward, whatever the
    # microbatches in flight (bf16 autocast's weight copies: its cache lives for the whole step)
    head: float = 0.0  # the last stage: what the head and the loss keep per microbatch (logits, log-
    # softmax), freed by the loss's and the head's backward before the blocks' backward
    loss_transient: float = 0.0  # the last stage: the loss's backward (two fp32 tokens x vocab gradients)
    root_transient: float = 0.0  # FSDP: the embedding's or the head's gradient in the parameter dtype,
    # made outside the blocks' backward (no block is recomputed then)
    matmul_transient: float = 0.0  # a float8 linear's casts in its backward (planner/low_precision.py)
    # without FSDP: the last block's backward beyond its saved bytes (its feed-forward's activation
    # gradients, a weight's gradient before it is accumulated, the casts: memory.py)
    plain_transient: float = 0.0


@dataclass(frozen=True)
class ScheduleWalk:
    """What the walk found: microbatches per local stage at the instant saved bytes peak (a forward
    returning), and the most bytes live at any action beyond the rank's static ones."""

    flight: list[int]  # in-flight microbatches per local stage when the saved bytes peak
    saved_peak: float  # live saved + outputs then
    peak: float  # the most dynamic bytes (saved, outputs, gradients, transients) at any action


def walk_schedule(
    actions: list[tuple[str, int]], stages: list[StageBytes], recompute: float, fsdp: bool
) -> ScheduleWalk:
    """Walk ``actions`` (``schedule_actions``) over the local ``stages``' bytes."""
    v = len(stages)
    flight, backwards = [0] * v, [0] * v
    total_backwards = [sum(1 for kind, s in actions if kind == "B" and s == i) for i in range(v)]
    best_flight, saved_peak, peak = [0] * v, 0.0, 0.0
    forwards = [0] * v
    grads = 0.0  # unsharded (FSDP, until REDUCE_GRAD) or the stage's own gradients held, + gathered
    for kind, s in actions:
        saved = sum(n * st.micro for n, st in zip(flight, stages))
        if kind == "F":
            if forwards[s] == 0:
                grads += stages[s].gathered + stages[s].once
            forwards[s] += 1
            flight[s] += 1
            saved += stages[s].micro
            if saved > saved_peak:
                saved_peak, best_flight = saved, list(flight)
            peak = max(peak, saved + grads)
            continue
        if backwards[s] == 0:
            grads += stages[s].unsharded_grads if fsdp else stages[s].sharded_grads
        st = stages[s]
        transient = st.grad_transient + st.matmul_transient if fsdp else st.plain_transient
        # two instants of a backward: the loss's (everything saved still live), then the blocks' (the
        # head's and the loss's bytes freed; one block recomputed; under FSDP one unit's gradient made,
        # without it the feed-forward's activation gradients)
        peak = max(
            peak,
            saved + grads + max(st.loss_transient, st.root_transient if fsdp else 0.0),
            saved - st.head + grads + transient + recompute,
        )
        flight[s] -= 1
        backwards[s] += 1
        if backwards[s] == total_backwards[s]:
            grads -= st.once
        if fsdp and backwards[s] == total_backwards[s]:  # REDUCE_GRAD: unsharded -> sharded
            grads += stages[s].sharded_grads - stages[s].unsharded_grads - stages[s].gathered
    return ScheduleWalk(best_flight, saved_peak, peak)
