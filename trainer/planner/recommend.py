"""``python -m trainer.plan ... --recommend``: a layout for the config's model on the cluster, found by
walking the seed article's decision order and planning every step of it with ``build_plan``.

The order (cheapest communication first; each step is taken only when the previous ones fail):

1. DDP over every GPU (16 B per parameter replicated; one gradient all-reduce per step);
2. ZeRO-3 inside a node, replicated across nodes (HSDP: the heavy all-gathers stay on NVLink,
   only 1/gpus_per_node of the gradients crosses the network); on one node, plain FSDP;
3. FSDP over every GPU (the all-gathers now cross the network);
4. tensor parallel inside a node (2, 4, ... up to gpus_per_node; with sequence parallel), FSDP
   (or HSDP) over the rest -- when one layer's parameters or activations are too big;
5. pipeline parallel across nodes with TP = gpus_per_node, FSDP over what is left.

Each layout is tried without activation checkpointing, then with full checkpointing. The first one
that fits in memory and is not communication-bound (exposed communication <= 10% of the step, and
the communication it hides needs <= 75% of the compute it hides behind) is recommended; if none is
both, the fastest that fits. Every candidate is listed with its numbers and
the reason it was passed over.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

from models.errors import ConfigError

if TYPE_CHECKING:
    from trainer.config import TrainConfig
    from trainer.planner.cluster import ClusterConfig

__all__ = ["Candidate", "recommend", "render_recommendation"]

COMM_BOUND = 0.10  # exposed communication above this share of the step: try the next layout
# Overlap is never perfect (NCCL kernels take SMs and memory bandwidth from the matmuls they hide
# behind): a layout whose overlappable communication needs more than this share of the compute
# it hides behind counts as communication-bound too.
OVERLAP_HEADROOM = 0.75


@dataclass
class Candidate:
    label: str  # e.g. "HSDP 4x8"
    step: str  # the step of the decision order it comes from
    ac: str  # activation checkpointing
    plan: Optional[Any]  # the Plan, or None when the layout is not valid for this config
    reason: str  # why it was chosen or passed over


def _layouts(world: int, gpn: int) -> Iterator[tuple[str, str, dict[str, int]]]:
    nodes = max(1, world // gpn)
    yield "1 DDP", f"DDP {world}", {"dp_replicate": world, "dp_shard": 1}
    if nodes > 1:
        yield "2 HSDP", f"HSDP {nodes}x{gpn}", {"dp_replicate": nodes, "dp_shard": gpn}
    yield "3 FSDP", f"FSDP {world}", {"dp_replicate": 1, "dp_shard": world}
    tp = 2
    while tp <= gpn:
        rest = world // tp
        yield "4 TP", f"TP {tp} x FSDP {rest}", {"dp_replicate": 1, "dp_shard": rest, "tp": tp}
        if nodes > 1 and gpn // tp > 1:
            yield (
                "4 TP",
                f"TP {tp} x HSDP {nodes}x{gpn // tp}",
                {"dp_replicate": nodes, "dp_shard": gpn // tp, "tp": tp},
            )
        tp *= 2
    pp = 2
    while pp <= nodes:
        rest = world // (gpn * pp)
        yield (
            "5 PP",
            f"PP {pp} x TP {gpn} x FSDP {rest}",
            {"dp_replicate": 1, "dp_shard": rest, "tp": gpn, "pp": pp},
        )
        pp *= 2


def _variant(cfg: TrainConfig, layout: dict[str, int], ac: str) -> TrainConfig:
    out = copy.deepcopy(cfg)
    p = out.parallelism
    p.dp_replicate, p.dp_shard, p.tp, p.pp, p.cp = 1, 1, 1, 1, 1
    for key, value in layout.items():
        setattr(p, key, value)
    p.sequence_parallel = p.tp > 1
    p.loss_parallel = p.tp > 1
    p.fsdp.reshard_after_forward = None
    p.pp_microbatches = None
    p.pp_stages_per_rank = None
    p.pp_module_names = None
    p.pp_layers_per_stage = None
    if p.pp > 1 and p.pp_schedule.lower() not in ("1f1b", "interleaved1f1b"):
        p.pp_schedule = "1F1B"
    if p.ep > 1 and (p.dp_shard * p.cp) % p.ep != 0:
        p.ep = 1
    out.training.activation_checkpoint = ac
    return out


def _overlap_load(plan: Any) -> float:
    """Overlappable communication time / the compute time it hides behind (the slowest pp rank)."""
    compute = plan.compute["compute_s"]
    rows = plan.pp_rank_collectives or [plan.collectives]
    hidden = max(sum(x.time_s for x in r if x.window_s > 0) for r in rows)
    return hidden / compute if compute > 0 else math.inf


def _good(plan: Any) -> bool:
    v = plan.verdict
    return v["fits"] and v["comm_bound_fraction"] <= COMM_BOUND and _overlap_load(plan) <= OVERLAP_HEADROOM


def recommend(cfg: TrainConfig, cluster: ClusterConfig) -> tuple[Optional[Candidate], list[Candidate]]:
    """(the recommended candidate or None, every candidate tried, in order)."""
    from trainer.planner.context import world_size_of
    from trainer.planner.plan import build_plan

    world = world_size_of(cfg, cluster) if cluster.nodes is None else cluster.nodes * cluster.gpus_per_node
    tried: list[Candidate] = []
    for step, label, layout in _layouts(world, cluster.gpus_per_node):
        for ac in ("none", "full"):
            try:
                plan = build_plan(_variant(cfg, layout, ac), cluster, checkpoint=False)  # layouts only
            except ConfigError as e:
                tried.append(Candidate(label, step, ac, None, f"not valid here: {e}"))
                break
            v = plan.verdict
            load = _overlap_load(plan)
            if not v["fits"]:
                reason = v["memory"]
            elif v["comm_bound_fraction"] > COMM_BOUND:
                reason = f"fits, but {v['communication']}"
            elif load > OVERLAP_HEADROOM:
                reason = (
                    f"fits, but its hidden communication needs {load:.0%} of the compute it hides behind "
                    f"(more than {OVERLAP_HEADROOM:.0%}: no headroom for imperfect overlap)"
                )
            else:
                reason = (
                    f"fits ({v['memory']}); communication hides with {load:.0%} of the compute window used"
                )
            tried.append(Candidate(label, step, ac, plan, reason))
            if v["fits"]:
                break  # checkpointing only when needed
        last = tried[-1]
        if last.plan is not None and _good(last.plan):
            return last, tried
    fitting = [c for c in tried if c.plan is not None and c.plan.verdict["fits"]]
    best = max(fitting, key=lambda c: c.plan.verdict["tokens_per_s"]) if fitting else None
    return best, tried


def render_recommendation(chosen: Optional[Candidate], tried: list[Candidate]) -> str:
    from trainer.planner.cluster import GIB
    from trainer.planner.report import render

    lines = [
        "layouts tried, in the article's decision order (first that fits and hides its communication wins):",
        f"  {'step':<7} {'layout':<24} {'AC':<5} {'peak GiB':>9} {'exposed':>8} {'tokens/s':>11}  verdict",
    ]
    for c in tried:
        if c.plan is None:
            lines.append(
                f"  {c.step:<7} {c.label:<24} {c.ac:<5} {'-':>9} {'-':>8} {'-':>11}  {c.reason[:110]}"
            )
            continue
        v = c.plan.verdict
        lines.append(
            f"  {c.step:<7} {c.label:<24} {c.ac:<5} {v['peak_bytes'] / GIB:>9.1f} "
            f"{v['comm_bound_fraction']:>8.0%} {v['tokens_per_s']:>11,.0f}  {c.reason}"
        )
    if chosen is None:
        lines.append(
            "\nno layout fits: more GPUs (cluster.nodes), a shorter training.seq_len or a smaller "
            "training.micro_batch_size would be needed."
        )
        return "\n".join(lines)
    why = _why(chosen, tried)
    lines += ["", f"recommended: {chosen.label} (AC {chosen.ac}) -- {why}", "", render(chosen.plan)]
    return "\n".join(lines)


def _why(chosen: Candidate, tried: list[Candidate]) -> str:
    """One clause per layout passed over (its last try), then why the chosen one wins."""
    last: dict[str, Candidate] = {}
    for c in tried[: tried.index(chosen)]:
        if c.label != chosen.label:
            last[c.label] = c
    passed = "; ".join(f"{c.label} (AC {c.ac}): {c.reason}" for c in last.values())
    v = chosen.plan.verdict
    if _good(chosen.plan):
        head = (
            f"the first layout of the decision order that fits and hides its communication "
            f"({v['comm_bound_fraction']:.0%} exposed, {_overlap_load(chosen.plan):.0%} of the compute "
            "window used)"
        )
    else:
        head = (
            f"no layout both fits and hides its communication; this is the fastest that fits "
            f"({v['comm_bound_fraction']:.0%} of its step is exposed communication)"
        )
    tail = f". Passed over: {passed}" if passed else ""
    return f"{head}, {v['tokens_per_s']:,.0f} tokens/s predicted{tail}."
