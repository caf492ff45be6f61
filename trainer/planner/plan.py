"""The plan of one layout: ``build_plan`` puts the memory, compute and communication sections
together and gives the verdict (fits? communication hidden?)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Optional

from trainer.planner.activations import ac_input_bytes, block_bytes_per_token
from trainer.planner.cluster import GIB, ClusterConfig, pp_bubble
from trainer.planner.comm import rank_collectives
from trainer.planner.context import Collective, Plan, PlanContext, build_context, strategy_of
from trainer.planner.low_precision import expert_padding_flops
from trainer.planner.memory import stage_memory_of

if TYPE_CHECKING:
    from parallelisms.parallel_dims import ParallelDims
    from trainer.config import TrainConfig


def compute_seconds(c: PlanContext) -> dict[str, float]:
    """FLOPs and time of one step on one rank; full checkpointing recomputes the forward (+1/3).
    ``flops_per_rank`` is the useful work (the MFU convention); the time also counts the work every
    tp rank repeats (:func:`tp_replicated_flops_per_token`: an MoE layer and MLA's down-projections
    run replicated in the tp group), without which an MoE run at tp=2 was predicted ~1.5x too fast."""
    t, dims = c.cfg.training, c.dims
    tokens = t.global_batch_size * t.seq_len
    flops = c.spec.flops_per_token(c.cfg.model, t.seq_len) * tokens / dims.world_size
    recompute = 4 / 3 if c.recompute else 1.0
    repeated = tp_replicated_flops_per_token(c) * tokens / dims.world_size
    seconds = (flops * recompute + repeated) / (c.cluster.peak_tflops * 1e12 * c.cluster.mfu)
    bubble = pp_bubble(c.schedule, dims.pp, c.accum, c.stages_per_rank)
    out = {
        "tokens_per_step": float(tokens),
        "flops_per_rank": flops * recompute,
        "compute_s": seconds,
        "forward_s": seconds * (1 / 3 if recompute == 1 else 1 / 2),
        "backward_s": seconds * (2 / 3 if recompute == 1 else 1 / 2),
        "pp_bubble": bubble,
        "compute_with_bubble_s": seconds / (1 - bubble),
    }
    out["executed_flops_per_rank"] = executed_flops(c)
    if c.cfg.optimizer.name == "muon":
        from trainer.planner.owners import muon_ns_flops

        out["ns_flops_per_rank"] = _muon_ns_flops(c)
        out["optimizer_s"] = out["ns_flops_per_rank"] / (c.cluster.peak_tflops * 1e12 * c.cluster.mfu)
        # the optimizer step's matmuls are executed too: c.rank's own owners' share, else the mean
        out["executed_flops_per_rank"] += (
            out["ns_flops_per_rank"] if c.rank is None else muon_ns_flops(c, c.rank)
        )
    return out


def executed_flops(c: PlanContext) -> float:
    """Matmul and attention FLOPs one rank executes per step (the rehearsal's FlopCounter measure),
    where ``flops_per_rank`` follows the MFU convention (6N + 12 L H D S per token, x 4/3 with full
    AC). The differences: a fused attention's backward recomputes the scores (5 matmuls, not 4:
    10/8 of the convention's backward), and torch's checkpoint stops recomputing once the tensors
    backward reads are back (early stop), so a dense block's feed-forward output projection is not
    run again; the head is never recomputed, but by the chunked loss (``training.loss_chunk_size``:
    its forward again in backward, the MTP heads' too). The attention share is the sequence-dependent part
    of the family's ``flops_per_token``, so every family's attention counts as its own. Low-precision
    experts add their padding rows' matmuls (``trainer/planner/low_precision.py``)."""
    t, args = c.cfg.training, c.cfg.model
    tokens = t.global_batch_size * t.seq_len / c.dims.world_size
    matmul = float(c.spec.flops_per_token(args, 0))  # 6 N (forward 2 N, backward 4 N)
    attention = c.spec.flops_per_token(args, t.seq_len) - matmul  # forward 1/3, backward 2/3
    out = matmul + attention * (4 + 10) / 12
    if c.recompute:  # the checkpointed blocks' forward again: not the MTP modules (never wrapped)
        head = args.vocab_size * args.dim
        dense = [b for b in range(len(c.table.blocks)) if b not in c.table.moe_layers]
        skipped = 2.0 * len(dense) * args.dim * c.terms.ffn_hidden_dim  # early stop: the FFN output
        mtp_matmul = float(c.spec.mtp_flops_per_token(args, 0))
        mtp_attention = c.spec.mtp_flops_per_token(args, t.seq_len) - mtp_matmul
        out += (matmul - mtp_matmul) / 3 - 2.0 * head - skipped + (attention - mtp_attention) / 3
    if t.loss_chunk_size > 0:
        out += 2.0 * args.vocab_size * args.dim * (1 + c.spec.mtp_depth(args))
    out += tp_replicated_flops_per_token(c)
    return out * tokens + expert_padding_flops(c)


def tp_replicated_flops_per_token(c: PlanContext) -> float:
    """The matmul FLOPs per token (of ``flops_per_token``'s 6 N share, divided over all ranks) that the
    other tp ranks run again: every tp rank runs its blocks' replicated matrices (an MoE layer's
    router and shared experts, MLA's latent down-projections: the parameter table's
    ``replicated_matrices`` of the blocks) and the routed experts (top_k / num_experts of ``experts``
    active per token; expert-parallel over the data axes only) on all the tokens of its tp group --
    the MoE layer runs replicated inside the tp group (``models/moe/model.py``'s ``TP_PLAN``).
    Forward, backward (x 2) and full checkpointing's forward again. Measured (rehearsal, tp=2):
    moe_debug 1.507, qwen3_5_moe_debug 1.553, deepseek_v3_debug 1.352 of the plan's executed FLOPs
    without this term. Not counted: the MTP modules' replicated matrices (their block's MLA
    down-projections run on all tokens, ``proj`` on the sequence-parallel share; deepseek_v3_debug
    with mtp_depth=1: 1.013)."""
    tp = c.dims.tp
    if tp == 1:
        return 0.0
    n_experts = c.spec.num_experts(c.cfg.model)
    active = c.terms.experts_per_token / n_experts if n_experts else 0.0
    per_token = sum(g.replicated_matrices + g.experts * active for g in c.table.blocks)
    passes = 3 + (1 if c.recompute else 0)
    return 2.0 * passes * (tp - 1) * per_token


def _muon_ns_flops(c: PlanContext) -> float:
    """Newton-Schulz FLOPs per rank and step under optimizer=muon: every matrix (each expert) of a
    pipeline rank's stages once, spread over that stage's ranks by the owner balance (the mean;
    the slowest pipeline rank counts). Not overlapped: it runs in the optimizer step."""
    from trainer.optim.muon import ns_step_flops

    steps = c.cfg.optimizer.muon.ns_steps
    ranks_per_stage = c.dims.world_size // c.dims.pp
    per_pp_rank = [
        steps * sum(stack * ns_step_flops(rows, cols) for stack, rows, cols in c.group(r).muon_shapes)
        for r in range(c.dims.pp)
    ]
    return max(per_pp_rank) / ranks_per_stage


def _verdict(plan: Plan) -> dict[str, Any]:
    cl, comp = plan.cluster, plan.compute
    peak = max(s.total_bytes for s in plan.stages) + cl.workspace_gib * GIB
    free = cl.memory_gib * GIB - peak

    def exposed_of(rows: list[Collective]) -> tuple[float, float]:
        overlappable = sum(x.time_s for x in rows if x.window_s > 0)
        critical = sum(x.time_s for x in rows if x.window_s == 0)
        return critical + max(0.0, overlappable - comp["compute_s"]), overlappable

    # the slowest pipeline rank sets the pace
    exposed, overlappable = max(exposed_of(rows) for rows in (plan.pp_rank_collectives or [plan.collectives]))
    step = comp["compute_with_bubble_s"] + exposed + comp.get("optimizer_s", 0.0)  # Muon's Newton-Schulz
    comm_share = exposed / step if step > 0 else 0.0
    memory = (
        f"fits with {free / GIB:.1f} GiB free" if free >= 0 else f"does not fit by {-free / GIB:.1f} GiB"
    ) + (f" (peak {peak / GIB:.1f} of {cl.memory_gib:.1f} GiB, incl. {cl.workspace_gib:g} GiB workspace)")
    if comm_share > 0.05:
        comm = (
            f"communication-bound by {100 * comm_share:.0f}% "
            f"(exposed {exposed * 1e3:.0f} ms of a {step * 1e3:.0f} ms step)"
        )
    else:
        comm = (
            f"compute-bound: {overlappable * 1e3:.0f} ms of overlappable communication hides behind "
            f"{comp['compute_s'] * 1e3:.0f} ms of compute; {exposed * 1e3:.0f} ms exposed"
        )
    return {
        "fits": free >= 0,
        "peak_bytes": peak,
        "free_bytes": free,
        "memory": memory,
        "exposed_comm_s": exposed,
        "step_s": step,
        "comm_bound_fraction": comm_share,
        "communication": comm,
        "tokens_per_s": comp["tokens_per_step"] / step if step > 0 else 0.0,
    }


def build_plan(
    cfg: TrainConfig,
    cluster: ClusterConfig,
    experiment: str = "",
    dims: Optional[ParallelDims] = None,
    rank: Optional[int] = None,
    *,
    checkpoint: bool = True,
) -> Plan:
    """The plan of ``cfg`` (a validated ``TrainConfig``) on ``cluster``; builds the model only on the
    meta device (shapes, no storage) to classify its parameters. ``dims``: the layout, when the caller
    has validated it already (``build_context``). ``rank``: the terms that follow an optimizer's
    owners (ZeRO-1, Muon) are this global rank's, on its stage (default: the mean over its ranks).
    ``checkpoint``: plan one checkpoint save too."""
    return plan_of(build_context(cfg, cluster, dims, rank), experiment, checkpoint=checkpoint)


def plan_of(c: PlanContext, experiment: str = "", *, checkpoint: bool = True) -> Plan:
    """The plan of a built context: memory per pp rank, compute, collectives, verdict, and one checkpoint
    save per rank (``checkpoint``; ~0.1-0.5 s more: the launch check leaves it out)."""
    cfg, cluster = c.cfg, c.cluster
    stages = [stage_memory_of(c, r) for r in range(c.dims.pp)]
    comp = compute_seconds(c)
    by_rank = [rank_collectives(c, r, comp) for r in range(c.dims.pp)]
    args = cfg.model
    per_tok = {"no_ac": block_bytes_per_token(c), "full_ac": ac_input_bytes(c)}  # block 0, per local token
    d = c.dims
    layout = {
        "world_size": d.world_size,
        "nodes": math.ceil(d.world_size / cluster.gpus_per_node),
        "pp": d.pp,
        "dp_replicate": d.dp_replicate,
        "dp_shard": d.dp_shard,
        "cp": d.cp,
        "tp": d.tp,
        "microbatches": c.accum,
        "micro_tokens": c.micro_tokens,
        "pp_schedule": c.schedule if d.pp > 1 else None,
        "pp_stages_per_rank": c.stages_per_rank,
        "activation_checkpoint": cfg.training.activation_checkpoint,
        "mixed_precision": cfg.training.mixed_precision,
        "fsdp_reshard_after_forward": c.reshard_after_forward,
    }
    plan = Plan(
        experiment=experiment,
        model=args.name,
        cluster=cluster,
        layout=layout,
        strategy=strategy_of(d, cfg),
        params_total=c.spec.param_counts(args).total,
        activation_per_token_layer=per_tok,
        stages=stages,
        collectives=by_rank[0],
        compute=comp,
        pp_rank_collectives=by_rank,
    )
    plan.verdict = _verdict(plan)
    if checkpoint:
        from trainer.planner.checkpoint import checkpoint_plan

        plan.checkpoint = checkpoint_plan(c)
    return plan


# -- report ------------------------------------------------------------------------------------
