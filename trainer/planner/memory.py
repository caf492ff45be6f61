"""Per-rank memory: what each rank keeps for backward, its model states and its buffers.

What one block and the head save per local token, and the dtype policy behind it, is
``trainer/planner/activations.py``; here it is taken per virtual stage and microbatch
(``stage_saved``), times the microbatches in flight per schedule (``saved_plan``; under PP the
schedule walked in torch's order, ``trainer/planner/pipeline_memory.py``), beside the parameters,
gradients, optimizer state and buffers, into each rank's peak (``stage_memory_of``: without PP
under FSDP, the most live at the instants of the backward). Checked against the memory ledger
(``metrics.memory_ledger=true``, ``trainer/observe/memory_ledger.py``) by
``tests/trainer/test_plan_measured.py``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from trainer.planner.activations import (
    ac_input_bytes,
    block_bytes_per_token,
    block_constant,
    block_terms,
    dtype_policy,
    head_terms,
    mlp_terms,
    sac_cache_bytes,
    weight_copy_bytes,
)
from trainer.planner.cluster import ADAM_BYTES, DTYPE_BYTES
from trainer.planner.context import PlanContext, PlannedStage, StageMemory
from trainer.planner.low_precision import converted_backward_transient, float8_gathered, gathered_bytes
from trainer.planner.pipeline_memory import ScheduleWalk, StageBytes, schedule_actions, walk_schedule

INT64 = 8


# -- one virtual stage, one microbatch ---------------------------------------------------------


def _checkpointed(c: PlanContext, local_index: int) -> str:
    """How activation checkpointing treats the stage's ``local_index``-th block
    (``parallelisms/activation_checkpoint.py`` counts blocks per model part)."""
    t = c.cfg.training
    if t.activation_checkpoint == "full":
        return "full"
    if t.activation_checkpoint == "selective":
        if t.ac_selective == "op":
            return "op"
        return "full" if local_index % t.ac_layer_interval == 0 else "none"
    return "none"


def stage_saved(c: PlanContext, stage: PlannedStage, *, receives: bool) -> dict[str, float]:
    """What one microbatch leaves saved in ``stage`` (the ledger's per-scope bytes), by term."""
    T = c.micro_tokens
    pol = dtype_policy(c)
    out = {"blocks": 0.0, "ac_inputs": 0.0, "weight_copies": 0.0, "embedding": 0.0, "head": 0.0, "loss": 0.0}
    for i, b in enumerate(stage.blocks):
        mode = _checkpointed(c, i)
        first_received = i == 0 and receives  # its input is the receive buffer (counted there): the
        if mode in ("full", "op"):  # boundary travels in the stream dtype, so FSDP's cast keeps it
            if not first_received:
                out["ac_inputs"] += T * ac_input_bytes(c)
            out["ac_inputs"] += block_constant(c)
            continue
        per_tok = block_bytes_per_token(c, b)
        if first_received and pol.stream == 4:
            per_tok -= block_terms(c, b)["attention_norm_input"]  # x.float() is the received x
        out["blocks"] += T * per_tok + block_constant(c, b)
        out["weight_copies"] += weight_copy_bytes(c, b)
    if stage.last:
        h = head_terms(c)
        out["loss"] = T * h.pop("log_softmax")
        if c.spec.mtp_depth(c.cfg.model) and pol.stream == 4:  # the final norm's fp32 input is the
            h.pop("final_norm_input")  # last block's output, saved first by MTP's hnorm (the mtp term)
        out["head"] = T * sum(h.values())
        if pol.weight_copies:
            out["weight_copies"] += 2.0 * c.table.last.tp_sharded / c.dims.tp
        out["mtp"] = mtp_bytes(c)
    return out


def mtp_bytes(c: PlanContext) -> float:
    """Multi-token prediction (DeepSeek-V3's ``mtp_depth`` modules, on the last stage), the ledger's
    ``mtp`` scope, per microbatch. Every module runs on all of the rank's positions (the trainer
    passes each depth's shifted ids and targets, sharded like the batch under CP), so per local
    token and depth: the inputs of hnorm and enorm (the stream's own storages when it is fp32 -- the
    whole last-block output for k = 1, the previous module's output, saved already by its head,
    after; the embedding output's rows, saved with it -- else fresh fp32 copies), the norms' rsqrt
    and normalised outputs, ``proj``'s input [h; e] (2 H; these four on the stream, so split by tp
    under sequence parallelism), one dense block (MLA + SwiGLU of ``hidden_dim``, its own TP/SP
    terms), then the shared head (its norm's fp32 input, the rest as the main head's), the fp32
    log-softmax over the (vocab-sharded) vocabulary and a contiguous copy of the int64 targets."""
    depth = c.spec.mtp_depth(c.cfg.model)
    if not depth:
        return 0.0
    pol = dtype_policy(c)
    H = c.cfg.model.dim
    sp = c.dims.tp if c.tp_sp[1] else 1
    head = head_terms(c)
    head_rest = sum(head.values()) - head["final_norm_input"]  # rsqrt, normed, output's input, log-softmax
    proj_in = 2 * H * (pol.compute if pol.cast_each else pol.stream)
    per_token = 0.0
    for k in range(1, depth + 1):
        inputs = (4 * H if k == 1 else 0.0) if pol.stream == 4 else 2 * 4 * H
        norms = 2 * (4 + pol.stream * H)
        stream = (inputs + norms + proj_in + 4 * H) / sp  # + the head norm's fp32 input
        per_token += stream + block_bytes_per_token(c, -1) + head_rest + INT64  # -1: never an MoE layer
    return c.micro_tokens * per_token


def ids_bytes(c: PlanContext) -> float:
    """The int64 token ids (embedding) or labels (loss) a microbatch saves: a view of the rank's
    whole local batch, so the storage counted is the local batch's (B_local x S / cp)."""
    return float(c.local_batch * c.cfg.training.seq_len // c.dims.cp * INT64)


def in_flight(c: PlanContext, pp_rank: int) -> list[int]:
    """Microbatches each of ``pp_rank``'s virtual stages holds when its saved bytes peak: one
    without PP; for GPipe, LoopedBFS, 1F1B and interleaved 1F1B the instant found by walking torch's
    order of the rank's forwards and backwards (``pipeline_memory.walk_schedule``: 1F1B holds
    min(M, pp - rank); interleaved 1F1B a mix of its local stages that the walk weighs by their
    bytes); zero-bubble schedules all M per stage, an upper bound (their split backward keeps each
    microbatch's graph from F until its weight-gradient pass W; measured on ZBV: 0.5-0.65 of it)."""
    if c.dims.pp == 1:
        return [1]
    walk = schedule_walk(c, pp_rank)
    return walk.flight if walk is not None else [c.accum] * c.stages_per_rank


def _boundary_bytes(c: PlanContext) -> float:
    """One microbatch's activation between stages (the stream, sequence-sharded under SP)."""
    sp = c.dims.tp if c.tp_sp[1] else 1
    return c.micro_tokens * c.cfg.model.dim * dtype_policy(c).stream / sp


def _stage_output_bytes(c: PlanContext, st: PlannedStage) -> float:
    """What a stage's forward returns per microbatch (kept in torch's ``fwd_cache`` until its
    backward): the boundary, or the last stage's logits (its final hidden state under the chunked loss)."""
    if not st.last or c.cfg.training.loss_chunk_size > 0:
        return _boundary_bytes(c)
    tp = c.dims.tp
    split = tp if c.cfg.parallelism.loss_parallel and tp > 1 else 1
    return c.micro_tokens * c.cfg.model.vocab_size / split * dtype_policy(c).compute


def _stage_units(c: PlanContext, st: PlannedStage) -> list[tuple[float, float]]:
    """(local parameters, local elements of its unsharded gradient) of each FSDP unit of ``st``: its
    blocks, then the root and the head units. The vocab-sharded embedding's gradient comes back
    replicated over tp (torch's embedding backward)."""
    tp, ep = c.dims.tp, c.dims.ep
    units = [(c.table.blocks[b].local(tp, ep),) * 2 for b in st.blocks]
    if st.first:
        first = c.table.first
        whole = first.tp_sharded if "embedding" in c.table.first_kinds else first.tp_sharded / tp
        root = (first.local(tp, ep), whole + first.replicated + first.experts / ep)
        if c.table.tied and st.last:
            last = c.table.last.local(tp, ep)
            root = (root[0] + last, root[1] + last)
        units.append(root)
    if st.last and not c.table.tied:
        units.append((c.table.last.local(tp, ep),) * 2)
    return units


def _gathered_blocks(c: PlanContext, blocks: list[int]) -> list[float]:
    """Each of ``blocks``' (``c.table.blocks``' indices) bytes while FSDP holds it gathered: its
    float8 weights (``fsdp_float8_all_gather``) one byte an element (``low_precision.gathered_bytes``)."""
    f8, tp, ep = float8_gathered(c), c.dims.tp, c.dims.ep
    return [gathered_bytes(c, c.table.blocks[b].local(tp, ep), f8[b]) for b in blocks]


def _casts_transient(c: PlanContext, block: int, experts_grad: float = 0.0) -> float:
    """Block ``block``'s float8 linears' cast temporaries in its backward, at the blocks' instant
    (``low_precision.converted_backward_transient``); its feed-forward's saved bytes are freed before
    an MoE block's attention runs its backward, and its experts' gradients (``experts_grad`` bytes,
    where the instant holds them) are made after its shared experts ran theirs."""
    ffn = sum(mlp_terms(c, dtype_policy(c), block).values()) * c.micro_tokens
    return converted_backward_transient(c, block, ffn, experts_grad)


def _plain_backward_transient(c: PlanContext, block: int, casts: float) -> float:
    """Without FSDP, what block ``block``'s backward holds beyond its saved bytes and the held
    gradients at its worst instant, in its dense SwiGLU feed-forward (the rehearsed peak of a pipeline
    stage without FSDP; ``debug`` pp=2 rank 0: 1.109 of the plan without it): the output projection's
    backward makes its input's gradient (tokens x hidden/tp, compute dtype) and its weight's (fp32,
    then accumulated), beside the float8 casts (``casts``: ``_casts_transient``); the gate product's backward
    then makes both factors' gradients while the product's is live and the product itself (w2's saved
    input) is freed: two (tokens x hidden/tp) tensors. An MoE block's: its casts only."""
    if block in c.table.moe_layers:
        return casts
    hidden = c.terms.ffn_hidden_dim / c.dims.tp
    act = c.micro_tokens * hidden * dtype_policy(c).compute
    return max(2 * act, act + 4.0 * hidden * c.cfg.model.dim + casts)


def _stage_bytes(c: PlanContext, pp_rank: int, st: PlannedStage) -> StageBytes:
    dims = c.dims
    units = _stage_units(c, st)
    local = sum(n for n, _ in units)
    rank_local = c.group(pp_rank).local(dims.tp, dims.ep)  # the stage's share of the rank's gradients
    grads_b = 4 * _held_params(c, pp_rank) * local / rank_local if rank_local else 0.0
    fsdp = dims.fsdp_enabled
    saved = stage_saved(c, st, receives=st.index > 0)
    output = _stage_output_bytes(c, st)
    casts = _casts_transient(c, st.blocks[-1]) if st.blocks else 0.0
    others = sum(n for n, _ in units[len(st.blocks) :])  # the root and head units
    gathered = sum(_gathered_blocks(c, st.blocks)) + others * c.param_gather_bytes
    return StageBytes(
        micro=sum(saved.values()) - saved["weight_copies"] + output,
        once=saved["weight_copies"],
        # the stage's output (the logits) is not: torch's stage holds it until the backward returns
        head=saved["head"] + saved["loss"] + saved.get("mtp", 0.0) if st.last else 0.0,
        loss_transient=loss_backward_bytes(c, pp_rank) if st.last else 0.0,
        unsharded_grads=sum(g for _, g in units) * c.sync_bytes if fsdp else 0.0,
        grad_transient=max((g for _, g in units[: len(st.blocks)]), default=0.0) * c.param_gather_bytes,
        root_transient=max((g for _, g in units[len(st.blocks) :]), default=0.0) * c.param_gather_bytes,
        sharded_grads=grads_b,
        gathered=gathered if fsdp and not c.reshard_after_forward else 0.0,
        matmul_transient=casts,
        # on the last stage the blocks' output gradient is the head's backward's, not a receive buffer
        plain_transient=_plain_backward_transient(c, st.blocks[-1], casts)
        + (_boundary_bytes(c) if st.last else 0.0)
        if st.blocks
        else 0.0,
    )


def schedule_walk(c: PlanContext, pp_rank: int) -> Optional[ScheduleWalk]:
    """The rank's schedule walked (``pipeline_memory``); None without PP or for a schedule not walked."""
    if c.dims.pp == 1:
        return None
    actions = schedule_actions(c, pp_rank)
    if not actions:
        return None
    stages = [_stage_bytes(c, pp_rank, st) for st in c.ranks[pp_rank]]
    return walk_schedule(actions, stages, _recompute_bytes(c, pp_rank), c.dims.fsdp_enabled)


@dataclass
class SavedPlan:
    """The saved-for-backward side of one pp rank: per step (summed over microbatches) by term,
    and the peak of live saved bytes."""

    per_step: dict[str, float]
    peak: float
    recompute: float  # full AC: one block's activations while it is recomputed (not in the peak)
    sac_cache: float  # op-level AC: the matmul outputs torch caches (not in the peak)


def saved_plan(c: PlanContext, pp_rank: int) -> SavedPlan:
    stages = c.ranks[pp_rank]
    flights = in_flight(c, pp_rank)
    per_step: dict[str, float] = {}
    peak = 0.0
    for st, flight in zip(stages, flights):
        micro = stage_saved(c, st, receives=st.index > 0)
        for k, v in micro.items():
            per_step[k] = per_step.get(k, 0.0) + c.accum * v
        # bf16 autocast's weight copies are cached for the whole step: held once, not per microbatch
        copies = micro["weight_copies"]
        peak += flight * (sum(micro.values()) - copies) + (copies if flight else 0.0)
        depth = c.spec.mtp_depth(c.cfg.model)
        for key, present in (("embedding", st.first), ("loss", st.last)):
            if key == "embedding" and present and depth:  # MTP: one embedding call on a fresh concatenation
                ids = (1 + depth) * c.micro_tokens * INT64  # of the window's ids and the D shifted ids
                per_step[key] += c.accum * ids
                peak += ids
            elif present:  # ids / labels: one storage, counted again only when it was released
                times = 1 if (c.dims.pp > 1 and flight > 1) else c.accum
                per_step[key] += times * ids_bytes(c)
                peak += ids_bytes(c)
    blocks = [b for st in stages for b in st.blocks]
    recompute, sac = _recompute_bytes(c, pp_rank), 0.0
    if blocks and c.cfg.training.activation_checkpoint == "selective" and c.cfg.training.ac_selective == "op":
        sac = sum(flights) * c.micro_tokens * sum(sac_cache_bytes(c, b) for b in blocks) / len(stages)
    return SavedPlan(per_step=per_step, peak=peak, recompute=recompute, sac_cache=sac)


def _recompute_bytes(c: PlanContext, pp_rank: int) -> float:
    """Full AC: one block's activations while its backward recomputes it (the rank's largest)."""
    blocks = [b for st in c.ranks[pp_rank] for b in st.blocks]
    if blocks and any(_checkpointed(c, i) == "full" for i in range(len(blocks))):
        return c.micro_tokens * max(block_bytes_per_token(c, b) for b in blocks)
    return 0.0


# -- buffers -----------------------------------------------------------------------------------


def _unit_params(c: PlanContext, pp_rank: int) -> tuple[float, float]:
    """Local parameter counts (after TP/EP) of the rank's root FSDP unit (first modules, or the tied
    head) and head unit (the last modules unless tied), unsharded; the blocks' are
    :func:`_gathered_blocks`'."""
    tp, ep = c.dims.tp, c.dims.ep
    root, head = 0.0, 0.0
    for st in c.ranks[pp_rank]:
        if st.first:
            root += c.table.first.local(tp, ep)
        if st.last:
            if c.table.tied:
                root += c.table.last.local(tp, ep)
            else:
                head += c.table.last.local(tp, ep)
    return root, head


def _largest_unit(c: PlanContext, pp_rank: int) -> float:
    """The largest FSDP unit's local parameter count: the root, the head, a block's dense part or
    its experts (the reduce-scatter input is one unit's unsharded gradients)."""
    tp, ep = c.dims.tp, c.dims.ep
    root, head = _unit_params(c, pp_rank)
    parts = [root, head]
    for st in c.ranks[pp_rank]:
        for b in st.blocks:
            g = c.table.blocks[b]
            parts += [g.dense_local(tp), g.experts / ep] if ep > 1 else [g.local(tp, ep)]
    return max(parts)


def buffer_bytes(c: PlanContext, pp_rank: int) -> dict[str, float]:
    dims, p = c.dims, c.cfg.parallelism
    out: dict[str, float] = {}
    pol = dtype_policy(c)
    if dims.ddp_enabled and p.ddp.grad_dtype and DTYPE_BYTES[p.ddp.grad_dtype] != 4:
        local = c.group(pp_rank).local(dims.tp, dims.ep)
        out["ddp_wire_cast"] = min(local, p.ddp.bucket_mb * 1e6 / 4) * DTYPE_BYTES[p.ddp.grad_dtype]
    if dims.fsdp_enabled:
        root, head = _unit_params(c, pp_rank)
        g = c.param_gather_bytes
        blocks = _gathered_blocks(c, [b for st in c.ranks[pp_rank] for b in st.blocks])
        if not c.reshard_after_forward:  # nothing is freed before backward: every unit stays gathered
            gathered = (root + head) * g + sum(blocks)
        else:  # the root, the head and the last block at the end of forward (measured on gloo); on CUDA
            # FSDP2 also prefetches the next block's all-gather on a side stream during backward
            top = sorted(blocks, reverse=True) + [0.0, 0.0]
            gathered = (root + head) * g + top[0] + (top[1] if c.cluster.backend == "nccl" else 0.0)
        out["fsdp_unsharded_params"] = gathered  # (+ 4 bytes of fp32 scale per float8 weight: not planned)
        out["fsdp_grad_reduce"] = _largest_unit(c, pp_rank) * c.sync_bytes
    if dims.pp > 1:
        sp = dims.tp if c.tp_sp[1] else 1
        boundary = c.micro_tokens * c.cfg.model.dim * pol.stream / sp
        stages = c.ranks[pp_rank]
        # torch's PipelineStage allocates one receive buffer per microbatch, for activations (every
        # stage but the first) and for gradients (every stage but the last), once
        out["pp_act_recv"] = c.accum * boundary * sum(1 for st in stages if st.index > 0)
        out["pp_grad_recv"] = c.accum * boundary * sum(1 for st in stages if not st.last)
        # each in-flight microbatch's stage output (fwd_cache): the boundary, or the last stage's logits
        tp = dims.tp
        logits = (
            c.micro_tokens * c.cfg.model.vocab_size / (tp if p.loss_parallel and tp > 1 else 1) * pol.compute
            if c.cfg.training.loss_chunk_size == 0
            else boundary  # the chunked loss: the last stage outputs its final hidden state
        )
        out["pp_stage_outputs"] = sum(
            f * (logits if st.last else boundary) for st, f in zip(stages, in_flight(c, pp_rank))
        )
    return out


def muon_held(c: PlanContext, pp_rank: int) -> tuple[float, float]:
    """(Muon elements this rank holds a piece of, replicas of each piece) under optimizer=muon:
    FSDP shards them over dp_shard x cp (experts: over what is left of it after ep), TP and EP split
    them; the pieces are identical across dp_replicate (and cp without FSDP)."""
    dims = c.dims
    group = c.group(pp_rank)
    held = group.muon_local(dims.tp, dims.ep)
    if dims.fsdp_enabled:
        experts = group.muon_experts / dims.ep
        held = (held - experts) / (dims.dp_shard * dims.cp) + experts / (dims.dp_shard * dims.cp // dims.ep)
    replicas = dims.dp_replicate * (1 if dims.fsdp_enabled else dims.cp)
    return held, replicas


def planned_rank(c: PlanContext, pp_rank: int) -> Optional[int]:
    """The global rank the plan gives the owner-assigned terms of (``c.rank``) when it is on
    ``pp_rank``'s stage; None: those terms are the mean over the stage's ranks."""
    if c.rank is None or c.rank // (c.dims.world_size // c.dims.pp) != pp_rank:
        return None
    return c.rank


def _sgd_bytes(momentum: float) -> int:
    """torch.optim.SGD's state per parameter element: an fp32 momentum buffer when momentum > 0."""
    return 4 if momentum > 0 else 0


def _muon_optimizer_bytes(c: PlanContext, pp_rank: int, local: float, held: float) -> float:
    """Muon's momentum (fp32, 4 B) only on the primary of each piece (``trainer/optim/muon.py``), on
    average 1/replicas of the held pieces; AdamW's two moments (8 B) for the rest, sharded like the
    parameters (ZeRO-1: everything on its owner, 1/dp_replicate on average). For ``c.rank``: its
    own primaries and owned parameters (``trainer/planner/owners.py``)."""
    from trainer.planner.owners import muon_rank, replica_of, zero1_optimizer_bytes

    dims = c.dims
    muon, replicas = muon_held(c, pp_rank)
    rank = planned_rank(c, pp_rank)
    if dims.ddp_enabled and c.cfg.parallelism.ddp.sharded_optimizer:
        if rank is not None:
            return zero1_optimizer_bytes(c, pp_rank, replica_of(c, rank))
        muon_all = c.group(pp_rank).muon_local(dims.tp, dims.ep)
        return (4 * muon_all + ADAM_BYTES * (local - muon_all)) / dims.dp_replicate
    momentum = muon / replicas if rank is None else muon_rank(c, rank).momentum
    return 4 * momentum + ADAM_BYTES * (held - muon)


def loss_backward_bytes(c: PlanContext, pp_rank: int) -> float:
    """The loss's backward on the rank holding the last stage, per microbatch: the gradient of the
    fp32 log-softmax (from the NLL) and of its input (the log-softmax's backward), both (tokens x
    vocab / the loss-parallel split) in fp32, live together while the rest of the forward's saved
    tensors still are. The rehearsal found the peak there, not in the blocks' backward: at 128K
    context (``llama3_8b_128k_cp``) it was 1.43x the plan without this term."""
    if not any(st.last for st in c.ranks[pp_rank]):
        return 0.0
    tp, t = c.dims.tp, c.cfg.training
    vocab_split = tp if (tp > 1 and c.cfg.parallelism.loss_parallel) else 1
    log_softmax = 4.0 * c.cfg.model.vocab_size / vocab_split  # per token, fp32
    if t.loss_chunk_size > 0:  # one chunk at a time: its recomputed logits and log-softmax and their
        seq = t.seq_len // c.dims.cp  # gradients, on the chunk's positions of every row
        return 4.0 * c.micro_tokens * min(t.loss_chunk_size, seq) / seq * log_softmax
    # loss parallel's vocab-sharded log-softmax backward (torch.distributed.tensor.parallel.loss_parallel)
    # holds a third fp32 (tokens x vocab / tp) tensor beside them (measured: 405b_4d's last stage)
    return (3.0 if vocab_split > 1 else 2.0) * c.micro_tokens * log_softmax


def _held_params(c: PlanContext, pp_rank: int) -> float:
    """Parameters this rank stores: FSDP shards the dense ones over dp_shard x cp and the experts'
    ep share over what is left of it (dp_shard x cp / ep)."""
    dims = c.dims
    group = c.group(pp_rank)
    local = group.local(dims.tp, dims.ep)
    if not dims.fsdp_enabled:
        return local
    experts = group.experts / dims.ep
    return (local - experts) / (dims.dp_shard * dims.cp) + experts / (dims.dp_shard * dims.cp // dims.ep)


def _walked_total(
    c: PlanContext, pp_rank: int, walk: ScheduleWalk, states: float, buffers: dict[str, float]
) -> float:
    """A pipeline rank's peak from its schedule walk: the parameters and optimizer state (``states``),
    the receive buffers (allocated once for every microbatch) and the token ids, plus the walk's
    peak (saved activations and outputs in flight, gradients, gathered parameters, transients);
    gathered parameters resharded after each forward stay a static term."""
    static = sum(v for k, v in buffers.items() if k in ("pp_act_recv", "pp_grad_recv", "ddp_wire_cast"))
    if c.reshard_after_forward:
        static += buffers.get("fsdp_unsharded_params", 0.0)
    ids = ids_bytes(c) * sum(int(st.first) + int(st.last) for st in c.ranks[pp_rank])
    return states + static + ids + walk.peak


def _fsdp_backward_peak(
    c: PlanContext, pp_rank: int, states: float, grads_b: float, saved: SavedPlan, buffers: dict[str, float]
) -> float:
    """Without PP, under FSDP: the most live at one of the instants of the last microbatch's
    backward, on top of the parameters and optimizer state (``states``) and the non-FSDP buffers.
    The loss's: everything saved, the loss's gradients, the units still gathered after the forward
    (the head and the last block: ``parallelisms/fsdp.py`` reshards neither; the root is). The
    blocks' (at the last block's): the blocks' saved bytes (the head's and the loss's are freed), one
    block recomputed (full AC) or torch's cache (op-level), that block and, on CUDA, the next one
    prefetched gathered (their float8 weights at one byte: ``_gathered_blocks``), the block's unsharded
    gradient in the parameter dtype and its reduce-scatter input, and its float8 linears' casts
    (``_casts_transient``: an MoE layer's shared experts' before its experts' gradients); then the
    first block's (its own saved bytes, every later unit's sharded gradient). The
    root's (the embedding's, last): every sharded gradient, the root gathered, the
    embedding's unsharded gradient -- the whole table's under tp: torch's embedding backward returns
    it replicated -- and its tp shard's copy, beside the first block's reduce-scatter input (FSDP2
    frees one when the next is issued). Without resharding after forward every unit stays gathered.
    Gradients of earlier microbatches are held at each of them when there are several."""
    (st,) = c.ranks[pp_rank]
    grads_then = grads_b if c.accum > 1 else 0.0
    base = states + sum(v for k, v in buffers.items() if not k.startswith("fsdp_"))
    micro = stage_saved(c, st, receives=False)
    head = micro["head"] + micro["loss"] + micro.get("mtp", 0.0)
    units = _stage_units(c, st)
    blocks, (root, *head_unit) = units[: len(st.blocks)], units[len(st.blocks) :]
    pb, sb = c.param_gather_bytes, c.sync_bytes
    sizes = sorted(_gathered_blocks(c, st.blocks), reverse=True) + [0.0, 0.0]
    prefetch = sizes[1] if c.cluster.backend == "nccl" else 0.0
    gathered = {  # per instant: loss, blocks, root
        "loss": sum(n * pb for n, _ in head_unit) + sizes[0],
        "block": sizes[0] + prefetch,
        "root": root[0] * pb,
    }
    if not c.reshard_after_forward:  # every unit stays gathered but the root, gathered for its backward
        kept = buffers.get("fsdp_unsharded_params", 0.0) - root[0] * pb
        gathered = {"loss": kept, "block": kept, "root": kept + root[0] * pb}
    tp, ep = c.dims.tp, c.dims.ep  # a block's experts are an FSDP unit of their own under ep
    parts = [
        x for b in st.blocks for x in ((c.table.blocks[b].dense_local(tp), c.table.blocks[b].experts / ep))
    ]
    largest = max(parts if ep > 1 else [n for n, _ in blocks], default=0.0)
    # its unsharded gradient, beside the last reduce-scatter's input (the head's, or a block unit's)
    block_grad = largest * pb + max([largest, *(n for n, _ in head_unit)]) * sb
    loss = gathered["loss"] + grads_then + saved.peak + loss_backward_bytes(c, pp_rank)
    blocks_saved = saved.peak - head
    # the blocks' backward runs from the last block (all their saved bytes) to the first (every later
    # unit's gradient made): its two ends
    first = blocks_saved / max(1, len(blocks)) + grads_b
    block = gathered["block"] + max(grads_then + blocks_saved, first) + saved.recompute + saved.sac_cache
    block += block_grad
    # the last block's float8 casts; its experts' gradients (in block_grad) come after its shared experts'
    if st.blocks:
        last = st.blocks[-1]
        block += _casts_transient(c, last, min(c.table.blocks[last].experts / ep, largest) * pb)
    # the embedding's gradient, its tp shard's copy (Replicate -> Shard), the first block's reduce input
    root_grad = root[1] * pb + (root[0] * pb if tp > 1 else 0.0) + (blocks[0][0] * sb if blocks else 0.0)
    return base + max(loss, block, gathered["root"] + grads_b + root_grad)


def stage_memory_of(c: PlanContext, pp_rank: int) -> StageMemory:
    """Model states, saved activations and buffers of ``pp_rank``: parameters after TP (1/tp of the
    sharded kinds) and EP (1/ep of the experts); FSDP divides all by dp_shard x cp (experts: their
    ep share by dp_shard x cp / ep); DDP's gradients live in its flat buckets (param dtype)."""
    dims, p = c.dims, c.cfg.parallelism
    local = c.group(pp_rank).local(dims.tp, dims.ep)
    held = _held_params(c, pp_rank)
    params_b, grads_b, opt_b = 4 * held, 4 * held, ADAM_BYTES * held
    if dims.ddp_enabled and p.ddp.sharded_optimizer:
        from trainer.planner.owners import replica_of, zero1_optimizer_bytes

        rank = planned_rank(c, pp_rank)
        opt_b = (
            ADAM_BYTES * local / dims.dp_replicate
            if rank is None
            else zero1_optimizer_bytes(c, pp_rank, replica_of(c, rank))
        )
    if c.cfg.optimizer.name == "muon":
        opt_b = _muon_optimizer_bytes(c, pp_rank, local, held)
    elif c.cfg.optimizer.name == "sgd":
        opt_b = _sgd_bytes(c.cfg.optimizer.momentum) * held
    ss = p.fault_tolerance.semi_sync
    if p.fault_tolerance.enable and ss.method != "none":  # DiLoCo's outer optimizer, on the device (the
        o = ss.outer_optimizer  # weights of the last sync are kept in host memory: not counted here)
        opt_b += (_sgd_bytes(o.momentum) if o.name == "sgd" else ADAM_BYTES) * held
    saved = saved_plan(c, pp_rank)
    buffers = buffer_bytes(c, pp_rank)
    acts = saved.peak + saved.recompute + saved.sac_cache
    blocks = sum(len(st.blocks) for st in c.ranks[pp_rank])
    casts = max((_casts_transient(c, st.blocks[-1]) for st in c.ranks[pp_rank] if st.blocks), default=0.0)
    total = params_b + grads_b + opt_b + acts + sum(buffers.values()) + casts
    loss_backward = loss_backward_bytes(c, pp_rank)
    walk = schedule_walk(c, pp_rank)
    if walk is not None:  # the schedule's own instants (pipeline_memory.py)
        total = _walked_total(c, pp_rank, walk, params_b + opt_b, buffers)
    elif dims.fsdp_enabled and dims.pp == 1:  # the backward's own instants
        total = _fsdp_backward_peak(c, pp_rank, params_b + opt_b, grads_b, saved, buffers)
    elif loss_backward:  # the other candidate instant for the peak: the loss's backward (README)
        grads_then = grads_b if c.accum > 1 else 0.0  # earlier microbatches' gradients
        gathered = buffers.get("fsdp_unsharded_params", 0.0)
        total = max(total, params_b + opt_b + grads_then + gathered + saved.peak + loss_backward)
    return StageMemory(
        pp_rank=pp_rank,
        layers=blocks,
        params_local=local,
        params_bytes=params_b,
        grads_bytes=grads_b,
        optimizer_bytes=opt_b,
        activations_bytes=acts,
        buffers=buffers,
        total_bytes=total,
        saved_per_step=saved.per_step,
        peak_saved=saved.peak,
        recompute_bytes=saved.recompute,
        sac_cache_bytes=saved.sac_cache,
        loss_backward_bytes=loss_backward,
        peak_instant=walk is not None or dims.pp == 1,
    )
