"""The planner's communication per step, per pipeline rank: every collective a strategy issues, as
the code issues it (``tests/trainer/test_plan_measured.py`` holds these rows to the communication
ledger of real runs). Called by ``trainer.plan.build_plan`` with its shared context."""

from __future__ import annotations

import math

from parallelisms.parallel_dims import DP_REPLICATE_CP, FLAT_VIEWS, MESH_DIM_NAMES, OPTIONAL_VIEWS
from trainer.planner.activations import dtype_policy
from trainer.planner.context import Collective, PlanContext, link_kind, make_collective
from trainer.planner.low_precision import (
    AMAX_BYTES,
    float8_gathered,
    float8_tp_amax,
    float8_weights,
    gathered_bytes,
)

__all__ = ["rank_collectives", "semi_sync_bytes_per_sync"]


class _Rows:
    """Collects the collectives of one rank; rows over a group of one rank are dropped."""

    def __init__(self, c: PlanContext, comp: dict[str, float]) -> None:
        self.c, self.comp, self.rows = c, comp, []

    def add(
        self,
        name: str,
        op: str,
        axis: str,
        axes: tuple[str, ...],
        calls: float,
        size: float,
        overlap: str,
        window: str,
    ) -> None:
        n = (
            self.c.dims.axis_size(axis)
            if axis in ("ep", "dp_shard_mod_ep")
            else math.prod(getattr(self.c.dims, a) for a in axes)
        )
        if n <= 1 or calls <= 0 or size <= 0:
            return
        link = link_kind(self.c.dims, axes, self.c.cluster.gpus_per_node)
        window_s = self.comp.get(window, 0.0)
        self.rows.append(
            make_collective(
                self.c.cluster, name, op, axis, n, link, int(round(calls)), size, overlap, window_s
            )
        )


def _fsdp_units(c: PlanContext, pp_rank: int) -> tuple[list[float], list[float], float, float, list[float]]:
    """(dense params per block, expert params per block, head unit, root unit, float8-gathered
    elements per block) local counts of ``pp_rank``, in forward order: FSDP's units
    (``parallelisms/fsdp.py``; float8: ``trainer/planner/low_precision.py``)."""
    tp, ep, t = c.dims.tp, c.dims.ep, c.table
    dense, experts, head, root, f8 = [], [], 0.0, 0.0, []
    gathered_f8 = float8_gathered(c)
    for st in c.ranks[pp_rank]:
        for b in st.blocks:  # without ep the experts belong to their block's unit
            dense.append(t.blocks[b].dense_local(tp) if ep > 1 else t.blocks[b].local(tp))
            experts.append(t.blocks[b].experts / ep if ep > 1 else 0.0)
            f8.append(gathered_f8[b])
        if st.first:
            root += t.first.local(tp, ep)
        if st.last:
            if t.tied:
                root += t.last.local(tp, ep)
            else:
                head += t.last.local(tp, ep)
    return dense, experts, head, root, f8


def _fsdp_rows(rows: _Rows, c: PlanContext, pp_rank: int) -> None:
    """FSDP2 per unit: all-gather in forward, again in backward for the units resharded after
    forward (every block but the last, and the root), reduce-scatter (and HSDP all-reduce) of the
    gradients -- every microbatch (the trainer does not skip gradient sync while accumulating),
    except under PP, where the schedule syncs once after the last microbatch."""
    dims = c.dims
    dense, experts, head, root, f8 = _fsdp_units(c, pp_rank)
    g = c.param_gather_bytes
    # bytes of one gather of each unit: float8 weights (fsdp_float8_all_gather) travel as 1 byte
    dense_bytes = [gathered_bytes(c, n, f) for n, f in zip(dense, f8, strict=True)]
    per_step = dims.pp > 1 and not c.reshard_after_forward
    m = 1 if per_step else c.accum
    syncs = 1 if dims.pp > 1 else c.accum
    again = c.reshard_after_forward  # backward gathers every block but the last, and the root, again
    # MTP modules share the head's unit and call the head again: backward passes through the unit
    # twice, and FSDP reshards it after the first, so it is gathered again.
    # So does the chunked loss (training.loss_chunk_size): its chunks' recomputes run after the first
    # chunk's backward has resharded the unit (measured: once more per microbatch, with MTP twice more).
    regathers = (c.spec.mtp_depth(c.cfg.model) > 0) + (c.cfg.training.loss_chunk_size > 0)
    mtp = [head] * regathers
    units = [  # (label, axis, axes, fwd elements, bwd elements, fwd bytes, bwd bytes)
        (
            "",
            "dp_shard_cp",
            FLAT_VIEWS["dp_shard_cp"],
            [*dense, head, root],
            ([*dense[:-1], root] if again else []) + mtp,
            [*dense_bytes, head * g, root * g],
            ([*dense_bytes[:-1], root * g] if again else []) + [u * g for u in mtp],
        ),
        (
            " (experts)",
            "dp_shard_mod_ep",
            ("dp_shard_mod_ep",),
            experts,
            experts[:-1] if again else [],
            [u * g for u in experts],
            [u * g for u in experts[:-1]] if again else [],
        ),
    ]
    _fsdp_unit_rows(rows, c, units, m, syncs, "; float8 weights" if any(f8) else "")


_Unit = tuple[str, str, tuple[str, ...], list[float], list[float], list[float], list[float]]


def _fsdp_unit_rows(rows: _Rows, c: PlanContext, units: list[_Unit], m: int, syncs: int, float8: str) -> None:
    """The rows of each FSDP unit group: (label, axis, axes, fwd elements, bwd elements, fwd bytes,
    bwd bytes), gathered ``m`` times and gradient-synced ``syncs`` times per step."""
    dims = c.dims
    for label, axis, axes, fwd_all, bwd_all, fwd_b, bwd_b in units:
        fwd = [u for u in fwd_all if u > 0]
        gathered = [b for u, b in zip(fwd_all, fwd_b, strict=True) if u > 0]
        gathered += [b for u, b in zip(bwd_all, bwd_b, strict=True) if u > 0]
        if not fwd:
            continue
        calls = len(gathered)
        rows.add(
            f"FSDP all_gather{label} (params, fwd"
            + (" + bwd" if calls > len(fwd) else "")
            + (float8 if not label else "")
            + ")",
            "all_gather",
            axis,
            axes,
            m * calls,
            sum(gathered) / calls,
            "forward+backward",
            "compute_s",
        )
        rows.add(
            f"FSDP reduce_scatter{label} (grads)",
            "reduce_scatter",
            axis,
            axes,
            syncs * len(fwd),
            sum(fwd) / len(fwd) * c.sync_bytes,
            "backward",
            "backward_s",
        )
        if dims.hsdp_enabled:
            n = dims.axis_size(axis)
            rows.add(
                f"HSDP all_reduce{label} (grad shards)",
                "all_reduce",
                "dp_replicate",
                ("dp_replicate",),
                syncs * len(fwd),
                sum(fwd) / len(fwd) * c.sync_bytes / n,
                "backward",
                "backward_s",
            )


def _float8_rows(rows: _Rows, c: PlanContext, pp_rank: int) -> None:
    """``fsdp_float8_all_gather``: after each optimizer step the float8 weights' amaxes, one fp32 each,
    in one all-reduce per model part over the FSDP mesh (``Float8ScaleHook``); with TP also over tp."""
    owned = {b for st in c.ranks[pp_rank] for b in st.blocks}
    n = sum(1 for b, _ in float8_weights(c) if b in owned)
    parts = len(c.ranks[pp_rank])
    if n == 0:
        return
    for axis, axes in (("dp_shard_cp", FLAT_VIEWS["dp_shard_cp"]), ("tp", ("tp",))):
        rows.add(
            "float8 amax all_reduce (scales for the next all-gathers)",
            "all_reduce",
            axis,
            axes,
            parts,
            n / parts * AMAX_BYTES,
            "none: after the step",
            "",
        )


def _ddp_rows(rows: _Rows, c: PlanContext, pp_rank: int) -> None:
    """Bucketed DDP: one all-reduce of every gradient per step (no_sync while accumulating), over
    dp_replicate x cp; ZeRO-1 then re-replicates the parameters over dp_replicate: one broadcast per
    owner on gloo, one all-gather on NCCL (``parallelisms/sharded_optimizer.py``)."""
    p = c.cfg.parallelism
    local = c.group(pp_rank).local(c.dims.tp, c.dims.ep)
    size = local * c.sync_bytes
    buckets = max(1, math.ceil(size / (p.ddp.bucket_mb * 1e6)))
    axis = DP_REPLICATE_CP if c.dims.cp > 1 else "dp_replicate"
    rows.add(
        "DDP all_reduce (grads, bucketed)",
        "all_reduce",
        axis,
        OPTIONAL_VIEWS[DP_REPLICATE_CP],
        buckets,
        size / buckets,
        "backward",
        "backward_s",
    )
    if p.ddp.sharded_optimizer:
        from trainer.planner.owners import zero1_segments

        segments = zero1_segments(c, pp_rank)  # the owners' parameter elements
        if c.cluster.backend == "gloo":
            owners = sum(1 for s in segments if s)
            rows.add(
                "ZeRO-1 broadcast (fp32 params, one per owner)",
                "broadcast",
                "dp_replicate",
                ("dp_replicate",),
                owners,
                sum(segments) * 4 / owners,
                "none: after the step",
                "",
            )
        else:  # every owner's segment padded to the largest
            rows.add(
                "ZeRO-1 all_gather (fp32 params after step, segments padded to the largest)",
                "all_gather",
                "dp_replicate",
                ("dp_replicate",),
                1,
                len(segments) * max(segments) * 4,
                "none: after the step",
                "",
            )


# What an activation-sized TP collective carries, and so its dtype (``dtype_policy``): "stream", the
# residual stream's dtype -- the norms' outputs entering a TP region (an RMSNorm's output is promoted
# to its weight's dtype: fp32 under autocast over fp32 weights, as the stream), the embedding's output
# leaving one, and their gradients; "compute", a matmul's output (bf16 under autocast or bf16
# parameters): the row-wise exits and their gradients
_CARRIES = {"stream": "norms, embedding", "compute": "row-wise outputs"}


def _tp_counts(c: PlanContext, pp_rank: int) -> dict[tuple[str, str], float]:
    """Activation-sized TP collectives per microbatch of ``pp_rank``, by (op, what they carry:
    ``_CARRIES``), from the TP-plan kinds of its modules (``parallelisms/tensor_parallel.py``): a
    region entry (``gather_input``, the head's input: a norm's output) is all-gather fwd /
    reduce-scatter bwd under SP, all-reduce bwd without; a region exit reduce-scatter fwd / all-gather
    bwd, or all-reduce fwd: a row-wise projection's output (``rowwise``), the embedding's
    (``embedding``: the stream); the MoE's ``moe_io`` gathers on entry and slices on exit (SP only;
    its output is in its input's dtype). Recomputed blocks repeat forwards, but for a dense block's
    exit projection."""
    sp = c.tp_sp[1]
    counts: dict[tuple[str, str], float] = {}
    fwd_repeat = 2 if c.recompute else 1

    def add(op: str, carries: str, calls: float) -> None:
        counts[(op, carries)] = counts.get((op, carries), 0.0) + calls

    # a region entry's gradient (bwd) and a region exit's output (fwd) are completed by one op
    scatter = "reduce_scatter" if sp else "all_reduce"

    def count(kinds: list[str], repeat: int) -> None:
        for kind in kinds:
            if kind in ("gather_input", "head"):
                add("all_gather", "stream", repeat if sp else 0)
                add(scatter, "stream", 1)
            elif kind in ("rowwise", "embedding"):
                carries = "compute" if kind == "rowwise" else "stream"
                add(scatter, carries, repeat)
                add("all_gather", carries, 1 if sp else 0)
            elif kind == "moe_io" and sp:  # gather fwd, gather the output's gradient bwd; the
                add("all_gather", "stream", repeat + 1)  # input's gradient is complete: a slice

    attn = c.terms.comm
    mtp = c.spec.mtp_depth(c.cfg.model)
    for st in c.ranks[pp_rank]:
        for b in st.blocks:
            kinds = c.table.block_kinds[b]
            count(kinds, fwd_repeat)
            if c.recompute and "rowwise" in kinds and "moe_io" not in kinds:
                # torch's checkpoint stops recomputing once the tensors backward reads are back
                # (early stop): the dense block's last forward collective, on the feed-forward's
                # row-wise output, is not issued again (measured by the rehearsal at 70B shapes)
                add(scatter, "compute", -1)
            if not attn.tp_entry_partial:  # the attention's gather_input gets its gradient back complete
                add(scatter, "stream", -1)
        count(c.table.first_kinds if st.first else [], 1)
        count(c.table.last_kinds if st.last else [], 1)  # MTP modules (their blocks) included
        # the chunked loss (training.loss_chunk_size) recomputes the heads' forwards in backward: their
        # input's all-gather again, chunk by chunk (the main head and the D MTP head calls)
        recomputed_heads = (1 + mtp) if st.last and c.cfg.training.loss_chunk_size > 0 else 0
        add("all_gather", "stream", recomputed_heads if sp else 0)
        if st.last and mtp:  # MTP: the embedding looks up D shifted windows too, the head runs D more times
            count(["embedding", "head"] * mtp, 1)
            if not attn.tp_entry_partial:  # the MTP blocks' attention entries, as the blocks'
                add(scatter, "stream", -mtp)
    return counts


def _tp_rows(rows: _Rows, c: PlanContext, pp_rank: int) -> None:
    """TP's activation-sized collectives, (b, S/cp, H) each (the full sequence of the region), in the
    dtype of what they carry (``_tp_counts``): under bf16 autocast over fp32 weights the norms' outputs
    and the embedding's (and their gradients) travel in fp32, the row-wise outputs in bf16; with FSDP's
    bf16 parameters all in bf16, in fp32 training all in fp32. Then the logits (a matmul's output),
    MLA's latents and RoPE key, the loss-parallel scalars and float8 scales."""
    p, args = c.cfg.parallelism, c.cfg.model
    policy = dtype_policy(c)
    width = {
        "stream": policy.stream,
        "compute": policy.compute,
        "norm": policy.stream,
        "matmul": policy.compute,
    }
    overlap = ("matmuls (async TP)", "compute_s") if p.async_tp else ("none: critical path", "")
    mixed = policy.stream != policy.compute  # else one row per op, as every tensor is in one dtype
    merged: dict[tuple[str, str], float] = {}
    for (op, carries), calls in _tp_counts(c, pp_rank).items():
        merged[(op, carries if mixed else "")] = merged.get((op, carries if mixed else ""), 0.0) + calls
    for (op, carries), calls in sorted(merged.items()):
        nbytes = width[carries] if carries else policy.compute
        rows.add(
            f"TP {op} ({_CARRIES[carries]}: {'fp32' if nbytes == 4 else 'bf16'})"
            if carries
            else f"TP {op} (block activations)",
            op,
            "tp",
            ("tp",),
            calls * c.accum,
            c.micro_tokens * args.dim * nbytes,
            *overlap,
        )
    last = any(st.last for st in c.ranks[pp_rank])
    mtp = c.spec.mtp_depth(args) if last else 0  # MTP modules: D more blocks and head calls (last stage)
    blocks = sum(len(st.blocks) for st in c.ranks[pp_rank]) + mtp
    # MLA: latents into the column-wise up-projections (their norms' outputs), the shared RoPE key
    for numbers, what in c.terms.comm.tp_backward_all_reduces if blocks else ():
        rows.add(
            f"TP all_reduce (attention {'latent' if what == 'norm' else 'RoPE key'}, bwd)",
            "all_reduce",
            "tp",
            ("tp",),
            blocks * c.accum,
            c.micro_tokens * numbers * width[what],
            "none: critical path",
            "",
        )
    if last and not p.loss_parallel:  # replicated logits: the head's output is gathered over the vocab
        rows.add(
            "TP all_gather (logits)",
            "all_gather",
            "tp",
            ("tp",),
            (1 + mtp) * c.accum,
            c.micro_tokens * args.vocab_size * policy.compute,
            "none: critical path",
            "",
        )
    if last and p.loss_parallel:  # max, sum of exp, target logit over the vocab shards
        rows.add(
            "TP all_reduce (loss parallel)",
            "all_reduce",
            "tp",
            ("tp",),
            3 * (1 + mtp) * c.accum,
            c.micro_tokens * 4,
            "none: critical path",
            "",
        )
    for size, calls in sorted(float8_tp_amax(c, pp_rank).items()):  # float8 scales of sharded operands
        rows.add("TP all_reduce (float8 amax)", "all_reduce", "tp", ("tp",), calls * c.accum, size, *overlap)
    _tp_norm_rows(rows, c, pp_rank, mtp)


def _partial_grad_reduce(c: PlanContext) -> tuple[int, int]:
    """(calls per step of each replicated weight, bytes per number) of the all-reduce that completes
    a tp-partial gradient (SP norms, q/k norms, MTP's projection). Under FSDP it is FSDP2's, when it
    reduces the unit's gradients (it redistributes them to the parameter's tp placement first): every
    microbatch in the parameters' dtype without PP; once per step under PP, where the schedule
    accumulates the gradients in ``reduce_dtype`` and reduces after the last microbatch. Without FSDP,
    once per step in fp32: our DDP on its copy into the bucket (the last microbatch), else the
    trainer after the last backward (``parallelisms.utils.complete_partial_grads``)."""
    if not c.dims.fsdp_enabled:
        return 1, 4
    if c.dims.pp > 1:
        return 1, c.sync_bytes
    return c.accum, c.param_gather_bytes


def _tp_norm_rows(rows: _Rows, c: PlanContext, pp_rank: int, mtp: int) -> None:
    """TP all-reduces of replicated weights' partial gradients: SP norms, MTP's projection, q/k norms,
    as FSDP reduces them (``_partial_grad_reduce``): per microbatch in the dtype the weights compute in
    without PP, once per step in ``reduce_dtype`` under PP; fp32 once per step without FSDP."""
    args = c.cfg.model
    syncs, nbytes = _partial_grad_reduce(c)
    if c.tp_sp[1]:  # SP norms: their weight gradients are partial sums over the sequence shards
        norms = [n for st in c.ranks[pp_rank] for b in st.blocks for n in c.table.blocks[b].norms]
        norms += [n for st in c.ranks[pp_rank] if st.last for n in c.table.last.norms]
        rows.add(
            "TP all_reduce (SP norm weight grads)",
            "all_reduce",
            "tp",
            ("tp",),
            len(norms) * syncs,
            nbytes * sum(norms) / max(len(norms), 1),
            "backward",
            "backward_s",
        )
        if mtp:  # MTP's replicated projection (2H -> H) runs on the sequence shard: partial weight grads
            rows.add(
                "TP all_reduce (SP MTP proj weight grads)",
                "all_reduce",
                "tp",
                ("tp",),
                mtp * syncs,
                nbytes * 2 * args.dim * args.dim,
                "backward",
                "backward_s",
            )
    if c.dims.tp > 1 and not c.dims.fsdp_enabled:
        # the clip (parallelisms.utils.clip_grad_norm_): torch's per-tensor norms of the tp DTensor
        # gradients are stacked and reduced in one all-reduce per step (fp32, one number a tensor);
        # under FSDP the same stack is reduced over its mesh (a scalar's worth: not planned)
        stages = c.ranks[pp_rank]
        tensors = sum(c.table.blocks[b].dense_tensors for st in stages for b in st.blocks)
        tensors += sum(c.table.first.dense_tensors for st in stages if st.first)
        tensors += sum(c.table.last.dense_tensors for st in stages if st.last)
        rows.add(
            "TP all_reduce (clip: per-tensor grad norms)",
            "all_reduce",
            "tp",
            ("tp",),
            1,
            4 * tensors,
            "none: after the step",
            "",
        )
    head_norms = [n for st in c.ranks[pp_rank] for b in st.blocks for n in c.table.blocks[b].head_norms]
    # q/k norms (Qwen3): each rank's heads give a partial sum of the replicated gain's gradient
    if head_norms:
        rows.add(
            "TP all_reduce (q/k norm weight grads)",
            "all_reduce",
            "tp",
            ("tp",),
            len(head_norms) * syncs,
            nbytes * sum(head_norms) / len(head_norms),
            "backward",
            "backward_s",
        )


def _cp_ep_rows(rows: _Rows, c: PlanContext, pp_rank: int) -> None:
    """CP (all-gather of K and V per attention layer, reduce-scatter of dK, dV) and EP (per MoE layer
    token dispatch + combine all-to-alls, forward and backward, and the token-count exchange)."""
    dims, p, args = c.dims, c.cfg.parallelism, c.cfg.model
    blocks = [b for st in c.ranks[pp_rank] for b in st.blocks]
    fwd_repeat = 2 if c.recompute else 1
    recurrent = [b for b in blocks if b in c.terms.recurrent_blocks]
    if dims.cp > 1 and recurrent and c.terms.recurrent is not None:
        # hybrid families: each recurrent layer hands its state and conv tails on (RecurrentMixerTerms):
        # one all-gather per piece in forward (again when recomputed), reduce-scattered in backward
        for what, per_seq in c.terms.recurrent.cp_handoff(c.act_bytes):
            for op, calls in (("all_gather", fwd_repeat), ("reduce_scatter", 1)):
                rows.add(
                    f"CP {op} (hand-off: {what})",
                    op,
                    "cp",
                    ("cp",),
                    calls * len(recurrent) * c.accum,
                    c.micro_batch * dims.cp * per_seq,
                    "none: critical path",
                    "",
                )
        blocks = [b for b in blocks if b not in c.terms.recurrent_blocks]
    if dims.cp > 1:
        # (b, S, 2 kv_dim) of K and V; MLA: (b, S, C + R) of latents
        kv = c.micro_tokens * dims.cp * c.terms.comm.cp_gather_dim * c.act_bytes
        ring = p.cp_impl == "ring"
        overlap = ("attention (ring)", "compute_s") if ring else ("none: critical path", "")
        # MTP modules' blocks (last stage; never recomputed) gather their latents too
        mtp = c.spec.mtp_depth(args) if any(st.last for st in c.ranks[pp_rank]) else 0
        rows.add(
            "CP all_gather (K, V or latents)",
            "all_gather",
            "cp",
            ("cp",),
            (fwd_repeat * len(blocks) + mtp) * c.accum,
            kv,
            *overlap,
        )
        rows.add(
            "CP reduce_scatter (dK, dV or d latents)",
            "reduce_scatter",
            "cp",
            ("cp",),
            (len(blocks) + mtp) * c.accum,
            kv,
            *overlap,
        )
    moe = [b for st in c.ranks[pp_rank] for b in st.blocks if b in c.table.moe_layers]
    if dims.ep > 1 and moe:
        # this rank's token copies (mean): dispatched as the MoE's input (a norm's output: the stream's
        # dtype), combined as the experts' output (the compute dtype); each gradient as its tensor
        routed = c.micro_tokens * c.terms.experts_per_token * args.dim
        calls = len(moe) * c.accum
        policy = dtype_policy(c)
        for what, width in (("dispatch", policy.stream), ("combine", policy.compute)):
            rows.add(
                f"EP all_to_all ({what}, fwd + bwd, {width} B)",
                "all_to_all",
                "ep",
                ("ep",),
                (fwd_repeat + 1) * calls,
                routed * width,
                "none: critical path",
                "",
            )
        rows.add(
            "EP all_to_all (tokens per expert)",
            "all_to_all",
            "ep",
            ("ep",),
            fwd_repeat * calls,
            c.spec.num_experts(args) * 8,
            "none: critical path",
            "",
        )


def _pp_rows(rows: _Rows, c: PlanContext, pp_rank: int) -> None:
    """Stage boundaries: per microbatch, activations forward and their gradients backward, to and
    from each neighbouring stage held by another rank. They are the residual stream, in its dtype:
    FSDP's param_dtype, else fp32 also under bf16 autocast (``pipeline_parallel.StageShapes``)."""
    dims = c.dims
    size = c.micro_tokens * c.cfg.model.dim * dtype_policy(c).stream / (dims.tp if c.tp_sp[1] else 1)
    n_stages = dims.pp * c.stages_per_rank
    mine = {st.index for st in c.ranks[pp_rank]}
    links = sum((s > 0 and s - 1 not in mine) + (s < n_stages - 1 and s + 1 not in mine) for s in mine)
    for op in ("send", "recv"):
        rows.add(
            f"PP {op} (boundary activations + grads)",
            op,
            "pp",
            ("pp",),
            links * c.accum,
            size,
            "forward+backward (async p2p)",
            "compute_s",
        )


def _muon_rows(rows: _Rows, c: PlanContext, pp_rank: int) -> None:
    """optimizer=muon (``trainer/optim/muon.py``), after the first step: one all_to_all over the world
    group of the primaries' fp32 update pieces to their owners (each piece once: 1/replicas of what a
    rank holds, on average), one of the owners' orthogonalised pieces back to every holder (what a
    rank holds). Per rank the bytes follow the owners (balanced by Newton-Schulz FLOPs): the plan
    is the mean; for ``c.rank``, its own (``trainer/planner/owners.py``). ZeRO-1 runs Muon inside each
    owner: no exchange (its broadcast re-replicates)."""
    from trainer.planner.memory import muon_held, planned_rank
    from trainer.planner.owners import muon_rank

    if c.dims.ddp_enabled and c.cfg.parallelism.ddp.sharded_optimizer:
        return
    held, replicas = muon_held(c, pp_rank)
    to_owners, to_holders = held / replicas, held
    rank = planned_rank(c, pp_rank)
    if rank is not None:
        figures = muon_rank(c, rank)
        to_owners, to_holders = figures.to_owners, figures.to_holders
    world = MESH_DIM_NAMES
    rows.add(
        "Muon all_to_all (update pieces -> owners)",
        "all_to_all",
        "world",
        world,
        1,
        4 * to_owners,
        "none: in the optimizer step",
        "",
    )
    rows.add(
        "Muon all_to_all (orthogonalised -> holders)",
        "all_to_all",
        "world",
        world,
        1,
        4 * to_holders,
        "none: in the optimizer step",
        "",
    )


def semi_sync_bytes_per_sync(c: PlanContext, pp_rank: int) -> float:
    """``parallelism.fault_tolerance.semi_sync`` (DiLoCo): the bytes a rank all-reduces with the other
    replica groups at one sync: its local share of one fragment's pseudo-gradient (the parameters' dtype:
    fp32) and the sync's 4-value float64 status (trainer/resilience/semi_sync.py)."""
    ss = c.cfg.parallelism.fault_tolerance.semi_sync
    local = c.group(pp_rank).local(c.dims.tp, c.dims.ep)
    return local * 4 / ss.fragments + 4 * 8


def _semi_sync_rows(rows: _Rows, c: PlanContext, pp_rank: int) -> None:
    """DiLoCo across replica groups: no per-step exchange; every sync_every / fragments steps one
    all-reduce of a fragment's pseudo-gradient (here per step: its bytes over the steps between syncs)."""
    ss = c.cfg.parallelism.fault_tolerance.semi_sync
    period = ss.sync_every // ss.fragments
    rows.rows = [r for r in rows.rows if r.axis not in ("dp_replicate", DP_REPLICATE_CP)]
    rows.add(
        f"DiLoCo all_reduce (a fragment's pseudo-gradient every {period} steps, per step)",
        "all_reduce",
        "dp_replicate",
        ("dp_replicate",),
        1,
        semi_sync_bytes_per_sync(c, pp_rank) / period,
        "none: at the sync",
        "",
    )


def rank_collectives(c: PlanContext, pp_rank: int, comp: dict[str, float]) -> list[Collective]:
    rows = _Rows(c, comp)
    if c.cfg.optimizer.name == "muon":
        _muon_rows(rows, c, pp_rank)
    if c.dims.ddp_enabled:
        _ddp_rows(rows, c, pp_rank)
    if c.dims.fsdp_enabled:
        _fsdp_rows(rows, c, pp_rank)
        _float8_rows(rows, c, pp_rank)
    if c.dims.tp > 1:
        _tp_rows(rows, c, pp_rank)
    _cp_ep_rows(rows, c, pp_rank)
    if c.dims.pp > 1:
        _pp_rows(rows, c, pp_rank)
    ft = c.cfg.parallelism.fault_tolerance
    if ft.enable and ft.semi_sync.method != "none":
        _semi_sync_rows(rows, c, pp_rank)
    return rows.rows
