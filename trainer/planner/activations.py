"""What one block and the head save for backward, per local token: the planner's activation model.

It is read off what our code saves, term by term, and checked against the memory ledger
(``metrics.memory_ledger=true``, ``trainer/observe/memory_ledger.py``) by
``tests/trainer/test_plan_measured.py``. Units: bytes per *local token* of one microbatch (after CP,
before SP: sequence-parallel terms are divided here), per block; ``trainer/planner/memory.py`` scales
them by the tokens and microbatches each stage holds. Also here: the seed article's per-layer rule
(``activation_bytes_per_token_layer``), kept for its worked figures.

Dtype policy (``DtypePolicy``): the residual stream (``stream``) is fp32 unless FSDP gathers
bf16 parameters (FSDP then casts every unit's inputs, the embedding's output is bf16); matmul
outputs (``compute``) are bf16 under autocast or bf16 parameters; with bf16 autocast over an
fp32 stream each matmul casts its fp32 input anew (``cast_each``) and keeps a bf16 copy of its
weight (``weight_copies``) -- but the float8 / MXFP8 linears, which save both as given
(``trainer/planner/low_precision.py``: ``as_given``, ``converted_weight_copies``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

from models.spec import BlockLayout, ModelArgs, ModelSpec
from trainer.planner.context import PlanContext, planner_terms_of
from trainer.planner.low_precision import (
    attention_inputs_as_given,
    autocast_casts_each,
    converted_weight_copies,
    expert_groups,
)


@dataclass(frozen=True)
class DtypePolicy:
    stream: int  # bytes of the residual stream between blocks
    compute: int  # bytes of matmul / attention outputs
    cast_each: bool  # autocast casts each matmul's fp32 input: one saved bf16 copy per consumer
    weight_copies: bool  # autocast saves a bf16 copy of every weight matrix per forward
    fsdp_bf16: bool  # FSDP gathers bf16 parameters (and casts the units' inputs)
    # the blocks' linears are all converted to float8 and save their fp32 inputs as given, uncast
    # (``trainer/planner/low_precision.py``): cast_each holds for the head only
    as_given: bool = False

    @property
    def block_cast_each(self) -> bool:
        return self.cast_each and not self.as_given


def dtype_policy(c: PlanContext) -> DtypePolicy:
    fsdp_bf16 = c.dims.fsdp_enabled and c.param_gather_bytes == 2
    autocast = c.cfg.training.mixed_precision == "bf16"
    stream = 2 if fsdp_bf16 else 4
    compute = 2 if (autocast or fsdp_bf16) else 4
    cast_each = autocast and stream == 4
    as_given = cast_each and not autocast_casts_each(c)  # converted linears: low_precision.py
    return DtypePolicy(stream, compute, cast_each, autocast and not fsdp_bf16, fsdp_bf16, as_given)


def activation_bytes_per_token_layer(
    dim: int,
    n_heads: int,
    n_kv_heads: int,
    *,
    tp: int = 1,
    sequence_parallel: bool = False,
    act_bytes: int = 2,
    head_dim: Optional[int] = None,
    qk_norm: bool = False,
) -> float:
    """Activation bytes one layer saves for backward per token (no checkpointing, SDPA), by the
    seed article's GPT rule -- kept for the article's worked figures (tests/trainer/test_plan.py);
    the plan itself uses :func:`block_terms`, read off what our code saves and checked against the
    memory ledger (our measured Llama exceeds this rule by 1.4x in fp32 to 1.8x under bf16 autocast).

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


def layer_activation_bytes(
    spec: ModelSpec, args: ModelArgs, *, tp: int, sequence_parallel: bool, act_bytes: int
) -> float:
    """``activation_bytes_per_token_layer`` (the article's rule, not the plan's model: that is
    :func:`block_terms`) for the family: Llama's rule at the family's ``AttentionShape`` (head size
    and q/k norm included), with the attention's projections replaced by the family's own saved
    tensors when it declares them (``AttentionComm.saved``, MLA): Llama's q, k, v and output-projection
    input (4 H at full heads, split by tp) out, the per-head tensors (split by tp) and the latents
    (never split: replicated modules compute them on the whole sequence) in."""
    terms = planner_terms_of(spec, args)
    shape = terms.shape
    base = activation_bytes_per_token_layer(
        args.dim,
        shape.n_heads,
        shape.kv_heads,
        tp=tp,
        sequence_parallel=sequence_parallel,
        act_bytes=act_bytes,
        head_dim=shape.head_dim,
        qk_norm=shape.qk_norm,
    )
    if terms.comm.saved is None:  # Llama's attention: its projections' true widths and q/k norms
        return base
    per_head, latents = terms.comm.saved
    return base + (per_head / tp + latents - 4 * args.dim / tp) * act_bytes


# -- what one block saves, per local token ----------------------------------------------------


def _norm_terms(c: PlanContext, pol: DtypePolicy, name: str, consumers: int) -> dict[str, float]:
    """RMSNorm (``models/common.py``) feeding ``consumers`` matmuls: its fp32 input ``x.float()``
    (x itself when the stream is fp32), the rsqrt statistic, the normalised ``x`` saved by the gain
    multiply, and what the matmuls save of its output. The first three run on S/tp tokens under
    SP; the output is whole under TP (replicated) and SP (all-gathered before the matmuls). The
    normalised ``x`` is fp32 when the family's norms say so (``PlannerTerms.norm_normed_fp32``)."""
    H = c.cfg.model.dim
    sp = c.dims.tp if c.tp_sp[1] else 1
    linear_in = consumers * pol.compute * H if pol.block_cast_each else pol.stream * H  # one tensor, shared
    return {
        f"{name}_input": 4 * H / sp,
        f"{name}_rsqrt": 4 / sp,
        f"{name}_normed": (4 if c.terms.norm_normed_fp32 else pol.stream) * H / sp,
        f"{name}_out": linear_in,
    }


def block_layout(c: PlanContext, pol: DtypePolicy, keys: Optional[int] = None) -> BlockLayout:
    """What the family's saved-activation arithmetic (``PlannerTerms``) needs of the layout; ``keys``:
    the sequence length attention sees when it is not the training's."""
    return BlockLayout(
        tp=c.dims.tp,
        cp=c.dims.cp,
        compute=pol.compute,
        cast_each=pol.block_cast_each,
        keys=c.cfg.training.seq_len if keys is None else keys,  # key positions per query (CP: all)
        fused_attention=c.cluster.backend != "gloo",  # CPU: SDPA's math path for unlike head sizes
        grouped_kv=c.cluster.backend != "gloo" and masked_attention(c),
        experts=expert_groups(c, pol.stream),  # low-precision experts: padded rows, bf16 outputs
        autocast=c.cfg.training.mixed_precision == "bf16",
    )


def masked_attention(c: PlanContext) -> bool:
    """Whether attention runs with a mask (``models/attention.py``: block-causal documents, or context
    parallel's all-gathered keys): on the GPU that is FlexAttention, which takes grouped K/V heads."""
    masked_cp = c.dims.cp > 1 and c.cfg.parallelism.cp_impl == "allgather"
    return masked_cp or c.spec.attention_mask(c.cfg.model) == "block_causal"


def attention_terms(
    c: PlanContext, pol: DtypePolicy, keys: Optional[int] = None, block: int = -1
) -> dict[str, float]:
    """Attention: its input norm (feeding the family's ``attention_norm_consumers`` matmuls), what the
    family's attention saves (``PlannerTerms.attention_saved``: Llama's q, K/V, log-sum-exp and output;
    MLA's latents and per-head tensors), and the rotary rows gathered per token when positions are
    passed (CP, packed documents). A hybrid family's recurrent block (``PlannerTerms.recurrent_blocks``)
    saves its mixer's terms instead (``RecurrentMixerTerms``: no rotary rows)."""
    t = c.terms
    if pol.block_cast_each and block >= 0 and attention_inputs_as_given(c, block):
        pol = dataclasses.replace(pol, as_given=True)  # an MoE block's converted attention
    if t.recurrent is not None and block in t.recurrent_blocks:
        terms = _norm_terms(c, pol, "attention_norm", t.recurrent.norm_consumers)
        terms.update(t.recurrent.saved(block_layout(c, pol, keys)))
        return terms
    terms = _norm_terms(c, pol, "attention_norm", t.attention_norm_consumers)
    terms.update(t.attention_saved(block_layout(c, pol, keys)))
    if c.dims.cp > 1 or c.spec.attention_mask(c.cfg.model) == "block_causal":
        terms["rope_rows"] = (2 if pol.fsdp_bf16 else 4) * t.rope_dim
    return terms


def mlp_terms(c: PlanContext, pol: DtypePolicy, block: int) -> dict[str, float]:
    """The feed-forward: its input norm (feeding the family's ``ffn_norm_consumers`` matmuls: a
    SwiGLU's two; an MoE layer's router and shared experts), then what the family's feed-forward
    saves (``PlannerTerms.ffn_saved``: SwiGLU; an MoE block -- one of the parameter table's
    ``moe_layers`` -- its router, routed copies and shared experts)."""
    moe = block in c.table.moe_layers
    terms = _norm_terms(c, pol, "ffn_norm", c.terms.ffn_norm_consumers(moe))
    terms.update(c.terms.ffn_saved(block_layout(c, pol), moe))
    return terms


def block_terms(c: PlanContext, block: int = 0, keys: Optional[int] = None) -> dict[str, float]:
    """Bytes block ``block`` saves for backward per local token, by term (no checkpointing);
    ``keys``: the sequence length attention sees when it is not the training's (MTP)."""
    pol = dtype_policy(c)
    if block < 0:  # an MTP module's block (``mtp_bytes``): outside the blocks, never converted
        pol = dataclasses.replace(pol, as_given=False)
    return {**attention_terms(c, pol, keys, block), **mlp_terms(c, pol, block)}


def block_bytes_per_token(c: PlanContext, block: int = 0, keys: Optional[int] = None) -> float:
    return sum(block_terms(c, block, keys).values())


def block_constant(c: PlanContext, block: Optional[int] = None) -> float:
    """Per block and microbatch, independent of tokens: FSDP's bf16 cast of the block's inputs
    includes the whole rotary table (max_seq_len x the family's ``rope_dim``), which RoPE then saves
    (a recurrent block, ``block`` given, never reads it; a checkpointed block keeps it as an input)."""
    if block is not None and block in c.terms.recurrent_blocks:
        return 0.0
    return 2.0 * c.cfg.model.max_seq_len * c.terms.rope_dim if dtype_policy(c).fsdp_bf16 else 0.0


def weight_copy_bytes(c: PlanContext, block: int) -> float:
    """bf16 autocast's copy of every matrix of ``block`` (norm gains stay fp32) but the converted
    linears' (``converted_weight_copies``), per forward."""
    if not dtype_policy(c).weight_copies:
        return 0.0
    g = c.table.blocks[block]
    matrices = g.tp_sharded / c.dims.tp + g.experts / c.dims.ep + g.replicated - sum(g.norms)
    return 2.0 * (matrices - converted_weight_copies(c)[block])


def head_terms(c: PlanContext) -> dict[str, float]:
    """Final RMSNorm + output projection, per local token; the loss: ``log_softmax`` of fp32 logits
    (vocab-sharded under loss parallel). With ``training.loss_chunk_size`` the head and the loss run
    chunk by chunk under torch's checkpoint (``trainer/step.py``): nothing of the logits is saved,
    only the checkpoint's input, the norm's output (this rank's sequence shard under SP), and the
    labels (counted with the loss's ids); one chunk's logits are transient (``loss_backward_bytes``)."""
    pol = dataclasses.replace(dtype_policy(c), as_given=False)  # the output head is never converted
    terms = {
        k.replace("attention_norm", "final_norm"): v
        for k, v in _norm_terms(c, pol, "attention_norm", 1).items()
    }
    tp = c.dims.tp
    vocab_split = tp if (tp > 1 and c.cfg.parallelism.loss_parallel) else 1
    terms["log_softmax"] = 4.0 * c.cfg.model.vocab_size / vocab_split
    if c.cfg.training.loss_chunk_size > 0:
        terms["final_norm_out"] = pol.stream * c.cfg.model.dim / (tp if c.tp_sp[1] else 1)
        terms["log_softmax"] = 0.0
    return terms


def ac_input_bytes(c: PlanContext) -> float:
    """A checkpointed block keeps its input (what FSDP hands it: bf16 when it casts) per token."""
    sp = c.dims.tp if c.tp_sp[1] else 1
    return dtype_policy(c).stream * c.cfg.model.dim / sp


def sac_cache_bytes(c: PlanContext, block: int) -> float:
    """Op-level selective checkpointing keeps the outputs of matmuls and SDPA per token (not seen by
    the ledger: torch caches them below autograd's hooks): q/k/v projections, wo, w1/w3/w2, SDPA, at the
    family's ``AttentionShape`` and dense FFN hidden size (Llama's modules; MLA and experts: estimated)."""
    s, tp, cb = c.terms.shape, c.dims.tp, dtype_policy(c).compute
    D, hidden, H = s.head_dim, c.terms.ffn_hidden_dim, c.cfg.model.dim
    return (
        cb * ((s.n_heads + 2 * s.kv_heads) * D / tp + 2 * H + 2 * hidden / tp + s.n_heads * D / tp)
        + 4 * s.n_heads / tp
    )
