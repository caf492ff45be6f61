"""Per-rank memory: activations per layer and token, and the model states, activations and
buffers each pipeline rank holds."""

from __future__ import annotations

from typing import Any, Optional

from trainer.planner.cluster import ADAM_BYTES, DTYPE_BYTES, pp_in_flight
from trainer.planner.context import PlanContext, StageMemory


def activation_bytes_per_token_layer(
    dim: int, n_heads: int, n_kv_heads: int, *, tp: int = 1, sequence_parallel: bool = False, act_bytes: int = 2,
    head_dim: Optional[int] = None, qk_norm: bool = False,
) -> float:
    """Activation bytes one layer saves for backward per token (no checkpointing, SDPA).

    The article's ``34 H`` (bf16): 10 H outside the TP regions, 24 H inside; with GQA the K and
    V parts (2 H each) scale by ``n_kv_heads / n_heads``; TP divides the inside part, SP the
    outside part as well. ``act_bytes=4`` (fp32 training) doubles everything.

    An explicit ``head_dim`` (Qwen3: n_heads x head_dim != dim) scales the attention's share of
    the inside part (Q and the attention output 2 H each, K and V) by the projections' true
    widths. ``qk_norm`` adds what the per-head RMSNorms save: their input in fp32 (the norm's
    statistics are fp32) and their output (for the gain's gradient), over q and k, inside TP.
    """
    hd = head_dim if head_dim is not None else dim // n_heads
    q, kv = n_heads * hd / dim, n_kv_heads * hd / dim  # widths of Q and of K (or V), in units of H
    inside = 16 + 4 * q + 4 * kv  # MLP 16 H; Q and attention output 2 H each; K and V 2 H x kv each
    if qk_norm:
        inside += (q + kv) * (max(act_bytes, 4) + act_bytes) * 2 / act_bytes
    outside = 10.0
    coeff = (outside + inside) / tp if (tp > 1 and sequence_parallel) else outside + inside / tp
    return coeff * dim * act_bytes / 2


def layer_activation_bytes(spec: Any, args: Any, *, tp: int, sequence_parallel: bool, act_bytes: int) -> float:
    """``activation_bytes_per_token_layer`` for the family: Llama's rule (head size and q/k norm
    included), with the attention's projections replaced by the family's own saved tensors when it declares them
    (``AttentionComm.saved``, MLA): Llama's q, k, v and output-projection input (4 H at full heads,
    split by tp) out, the per-head tensors (split by tp) and the latents (never split: replicated
    modules compute them on the whole sequence) in."""
    saved = spec.attention_comm(args).saved
    if saved is None:  # Llama's attention: its projections' true widths (explicit head_dim) and q/k norms
        return activation_bytes_per_token_layer(
            args.dim, args.n_heads, args.kv_heads, tp=tp, sequence_parallel=sequence_parallel, act_bytes=act_bytes,
            head_dim=args.head_dim, qk_norm=bool(getattr(args, "qk_norm", False)),
        )  # fmt: skip
    base = activation_bytes_per_token_layer(
        args.dim, args.n_heads, args.kv_heads, tp=tp, sequence_parallel=sequence_parallel, act_bytes=act_bytes
    )
    per_head, latents = saved
    return base + (per_head / tp + latents - 4 * args.dim / tp) * act_bytes


def activation_memory(c: PlanContext, layers: int, has_head: bool, pp_rank: int) -> float:
    """Activation bytes of ``layers`` blocks on one rank at its peak (in-flight microbatches)."""
    args, t = c.cfg.model, c.cfg.training
    tp, sp = c.tp_sp
    per_tok = layer_activation_bytes(c.spec, args, tp=tp, sequence_parallel=sp, act_bytes=c.act_bytes)
    block_input = 2 * args.dim * c.act_bytes / 2 / (tp if sp else 1)
    in_flight = pp_in_flight(c.schedule, c.dims.pp, c.accum, c.stages_per_rank, pp_rank)
    tokens = c.micro_tokens
    if t.activation_checkpoint == "full":
        stored = layers * in_flight * tokens * block_input + tokens * per_tok  # + one layer recomputed
    elif t.activation_checkpoint == "selective" and t.ac_selective == "layer":
        k = t.ac_layer_interval
        ckpt = layers // k
        stored = in_flight * tokens * (ckpt * block_input + (layers - ckpt) * per_tok) + tokens * per_tok
    else:  # none, or selective op (SDPA already keeps no S^2 scores: about the same as none)
        stored = layers * in_flight * tokens * per_tok
    if has_head:  # fp32 logits for the loss, vocab-sharded under loss parallel
        vocab_split = tp if (tp > 1 and c.cfg.parallelism.loss_parallel) else 1
        stored += tokens * args.vocab_size / vocab_split * 4
    return stored


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


def _muon_optimizer_bytes(c: PlanContext, pp_rank: int, local: float, held: float) -> float:
    """Muon's momentum (fp32, 4 B) only on the primary of each piece (``parallelisms/muon.py``), on
    average 1/replicas of the held pieces; AdamW's two moments (8 B) for the rest, sharded like the
    parameters (ZeRO-1: everything on its owner, 1/dp_replicate on average)."""
    dims = c.dims
    muon, replicas = muon_held(c, pp_rank)
    if dims.ddp_enabled and c.cfg.parallelism.ddp.sharded_optimizer:
        muon_all = c.group(pp_rank).muon_local(dims.tp, dims.ep)
        return (4 * muon_all + ADAM_BYTES * (local - muon_all)) / dims.dp_replicate
    return 4 * muon / replicas + ADAM_BYTES * (held - muon)


def stage_memory_of(c: PlanContext, pp_rank: int) -> StageMemory:
    """Model states, activations and buffers of ``pp_rank``: parameters after TP (1/tp of the
    sharded kinds) and EP (1/ep of the experts); FSDP divides all by dp_shard x cp (experts: their
    ep share by dp_shard x cp / ep); DDP's gradients live in its flat buckets (param dtype)."""
    dims, p = c.dims, c.cfg.parallelism
    tp = dims.tp
    stages = c.ranks[pp_rank]
    group = c.group(pp_rank)
    local = group.local(tp, dims.ep)
    held = local  # parameters this rank stores: FSDP shards the dense ones over dp_shard x cp and the
    if dims.fsdp_enabled:  # experts' ep share over what is left of it (dp_shard x cp / ep)
        experts = group.experts / dims.ep
        held = (local - experts) / (dims.dp_shard * dims.cp) + experts / (dims.dp_shard * dims.cp // dims.ep)
    params_b, grads_b, opt_b = 4 * held, 4 * held, ADAM_BYTES * held
    buffers: dict[str, float] = {}
    if dims.ddp_enabled and p.ddp.sharded_optimizer:
        opt_b = ADAM_BYTES * local / dims.dp_replicate
    if c.cfg.optimizer.name == "muon":
        opt_b = _muon_optimizer_bytes(c, pp_rank, local, held)
    if dims.ddp_enabled and p.ddp.grad_dtype and DTYPE_BYTES[p.ddp.grad_dtype] != 4:
        buffers["ddp_wire_cast"] = min(local, p.ddp.bucket_mb * 1e6 / 4) * DTYPE_BYTES[p.ddp.grad_dtype]
    blocks = [b for st in stages for b in st.blocks]
    if dims.fsdp_enabled and blocks:
        block_local = max(c.table.blocks[b].local(tp, dims.ep) for b in blocks)
        gathered = (len(blocks) if not c.reshard_after_forward else min(2, len(blocks))) * block_local
        buffers["fsdp_unsharded_params"] = gathered * c.param_gather_bytes
        buffers["fsdp_grad_reduce"] = block_local * c.sync_bytes
    acts = activation_memory(c, len(blocks), any(st.last for st in stages), pp_rank)
    if dims.pp > 1:
        boundary = c.micro_tokens * c.cfg.model.dim * c.act_bytes / (tp if c.tp_sp[1] else 1)
        buffers["pp_p2p"] = 2 * boundary * c.stages_per_rank  # send + recv buffers per virtual stage
    total = params_b + grads_b + opt_b + acts + sum(buffers.values())
    return StageMemory(
        pp_rank=pp_rank, layers=len(blocks), params_local=local, params_bytes=params_b, grads_bytes=grads_b,
        optimizer_bytes=opt_b, activations_bytes=acts, buffers=buffers, total_bytes=total,
    )  # fmt: skip


# -- communication and compute ---------------------------------------------------------------
