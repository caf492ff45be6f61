"""Qwen3.5 hybrid decoder (Qwen3.5 dense and Qwen3.5-MoE text models), free of any parallelism.

Every ``full_attention_interval``-th block (i + 1 divisible by it; every 4th) has gated softmax
attention; the others mix tokens with a Gated DeltaNet (a linear, recurrent attention with a (dk, dv)
state per value head, ``models/qwen3_5/delta_rule.py``). Module tree::

    tok_embeddings.weight
    layers.{i}.{attention_norm,ffn_norm}.weight          zero-centred RMSNorm gains (1 + w)
    layers.{i}.attention.wq.weight     (nh * 2 D, H)    full layers: per head [query D | output gate D]
    layers.{i}.attention.{wk,wv}.weight (nkv * D, H), attention.wo.weight (H, nh * D)
    layers.{i}.attention.{q_norm,k_norm}.weight (D,)    zero-centred, before the partial RoPE
    layers.{i}.delta_net.{wq,wk}.weight (nk * dk, H)    linear layers: queries / keys (nk key heads)
    layers.{i}.delta_net.{wv,wz}.weight (nv * dv, H)    values / output gate (nv value heads)
    layers.{i}.delta_net.{wb,wa}.weight (nv, H)         write strength beta = sigmoid(b), decay input a
    layers.{i}.delta_net.{q_conv,k_conv,v_conv}.weight (C, 1, K)   short causal depthwise convolutions
    layers.{i}.delta_net.decay.{A_log,dt_bias} (nv,)    decay g = -exp(A_log) softplus(a + dt_bias)
    layers.{i}.delta_net.norm.weight (dv,)               RMSNorm of each head's output, times silu(z)
    layers.{i}.delta_net.wo.weight (H, nv * dv)
    layers.{i}.feed_forward.{w1,w2,w3}.weight           dense family (Qwen3.5): SwiGLU
    layers.{i}.moe.*                                     MoE family: ``models/moe``'s router and stacked
    layers.{i}.moe.shared_experts.{w1,w2,w3,gate}.weight experts, a shared SwiGLU scaled by sigmoid(gate x)
    norm.weight, output.weight

The full attention is Llama's ``Attention`` (``models/llama/model.py``) with its swappable core
(``models/attention.py``: masks, context parallel's all-gather core, the generation KV cache) and
three changes: a sigmoid output gate per head and channel (from the second half of each head's
``wq`` rows, so that a column shard of ``wq`` keeps whole heads), zero-centred q/k norms, and RoPE on
the first ``partial_rotary_factor`` of each head (rotate_half layout) only.

The Gated DeltaNet keeps its token mixing in a swappable core too (``DeltaRuleCore``): the short
convolutions and the chunked delta rule, with documents restarting at each packed document's start
under ``attention_mask=block_causal`` (positions restart at 0 there, ``models/attention.py``). The
generation cache (``RecurrentCacheCore``) keeps the convolutions' last K-1 inputs and the recurrent
state instead of keys and values; ``generation_cores`` hands both kinds of cache to
``models/generation.py`` through the spec.

Norms are zero-centred like transformers' ``Qwen3_5RMSNorm`` (gain ``1 + w``, ``w`` initialised to
0), so the Hugging Face tensors map one to one; the DeltaNet's gated norm has a plain gain (ones).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Optional, Union

import torch
from torch import Tensor, nn

from models.attention import attention_cache_cores
from models.common import ParamInit, RMSNorm, apply_rotary_emb, precompute_rope_cache
from models.llama.model import TP_PLAN as LLAMA_TP_PLAN
from models.llama.model import Attention, FeedForward, Transformer, rope_rows
from models.llama.model import attention_saved as llama_attention_saved
from models.llama.model import planner_terms as llama_planner_terms
from models.moe.model import MoE
from models.moe.model import ffn_saved as moe_ffn_saved_routed
from models.moe.model import planner_terms as moe_planner_terms
from models.qwen3_5.args import Qwen3_5Args, Qwen3_5MoeArgs
from models.qwen3_5.delta_net import Decay, DeltaRuleCore, GatedDeltaNet, RecurrentCacheCore
from models.qwen3_5.kernels import check_linear_kernel
from models.spec import BlockLayout, ModelArgs, ParamCounts, PlannerTerms, RecurrentMixerTerms

__all__ = [
    "TP_PLAN",
    "DeltaRuleCore",
    "GatedAttention",
    "GatedDeltaNet",
    "GatedFeedForward",
    "Decay",
    "OffsetRMSNorm",
    "Qwen3_5Args",
    "Qwen3_5Block",
    "Qwen3_5MoeArgs",
    "Qwen3_5Transformer",
    "RecurrentCacheCore",
    "flops_per_token",
    "generation_cores",
    "param_counts",
    "planner_terms",
]


# --------------------------------------------------------------------------------------------
# Norms
# --------------------------------------------------------------------------------------------


class OffsetRMSNorm(RMSNorm):
    """Zero-centred RMSNorm: ``normalise(x) * (1 + weight)`` in fp32, ``weight`` initialised to 0
    (transformers' ``Qwen3_5RMSNorm``)."""

    def init_weights(self, init: ParamInit, prefix: str) -> None:
        init.zeros(f"{prefix}.weight", self.weight)

    def forward(self, x: Tensor) -> Tensor:
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * (1.0 + self.weight.float())).type_as(x)


# --------------------------------------------------------------------------------------------
# Full attention
# --------------------------------------------------------------------------------------------


class GatedAttention(Attention):
    """Llama's attention with a per-head sigmoid output gate (``wq``'s rows hold, per head, the query
    then the gate), zero-centred q/k norms and partial RoPE; the core is the shared one."""

    def __init__(self, args: Qwen3_5Args, core: Optional[nn.Module] = None) -> None:
        super().__init__(args, core)
        self.wq = nn.Linear(args.dim, args.n_heads * 2 * self.head_dim, bias=False)
        self.q_norm = OffsetRMSNorm(self.head_dim, eps=args.norm_eps)
        self.k_norm = OffsetRMSNorm(self.head_dim, eps=args.norm_eps)

    def forward(self, x: Tensor, *, rope_cache: Tensor, positions: Optional[Tensor] = None) -> Tensor:
        """``x`` (B, S, H); ``rope_cache`` (max_seq_len, R) for the R rotated channels; positions as
        in ``Attention``."""
        B, S, _ = x.shape
        D = self.head_dim
        rope = rope_rows(rope_cache, S, positions)  # (S, R) or (B, S, R)
        q, gate = self.wq(x).view(B, S, -1, 2 * D).chunk(2, dim=-1)  # (B, S, nh, D) each
        k = self.wk(x).view(B, S, -1, D)  # (B, S, nkv, D)
        v = self.wv(x).view(B, S, -1, D)
        q, k = self.norm_qk(q, k)
        R = rope.shape[-1]
        q_rot, k_rot = apply_rotary_emb(q[..., :R], k[..., :R], rope)
        q, k = torch.cat([q_rot, q[..., R:]], dim=-1), torch.cat([k_rot, k[..., R:]], dim=-1)
        out = self.core(q, k, v, positions=positions)  # (B, S, nh, D)
        out = out * torch.sigmoid(gate)
        return self.wo(out.reshape(B, S, -1))


# --------------------------------------------------------------------------------------------
# Feed-forward
# --------------------------------------------------------------------------------------------


class GatedFeedForward(FeedForward):
    """Qwen3.5-MoE's shared expert: a SwiGLU scaled per token by ``sigmoid(gate x)`` (``gate``: H -> 1)."""

    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__(dim, hidden_dim)
        self.gate = nn.Linear(dim, 1, bias=False)

    def init_weights(self, init: ParamInit, prefix: str, std: float, out_std: float) -> None:
        super().init_weights(init, prefix, std, out_std)
        init.trunc_normal(f"{prefix}.gate.weight", self.gate.weight, std, 2.0)

    def forward(self, x: Tensor) -> Tensor:
        return torch.sigmoid(self.gate(x)) * super().forward(x)


class Qwen3_5MoE(MoE):
    """``models/moe``'s routed experts with Qwen3.5's gated shared expert."""

    def __init__(self, args: Qwen3_5MoeArgs) -> None:
        super().__init__(args)
        self.shared_experts = (
            GatedFeedForward(args.dim, args.shared_expert_hidden_dim)
            if args.shared_expert_hidden_dim
            else None
        )


# --------------------------------------------------------------------------------------------
# Blocks and model
# --------------------------------------------------------------------------------------------


class Qwen3_5Block(nn.Module):
    """Pre-norm block: ``h = x + mix(norm(x)); out = h + ffn(norm(h))``; ``mix`` is the gated attention
    (``attention``) on full-attention layers, the Gated DeltaNet (``delta_net``) on the others; the
    feed-forward a SwiGLU (dense family) or the MoE (MoE family)."""

    def __init__(self, layer_id: int, args: Qwen3_5Args) -> None:
        super().__init__()
        self.layer_id = layer_id
        full = args.is_full_attention(layer_id)
        self.attention: Optional[GatedAttention] = GatedAttention(args) if full else None
        self.delta_net: Optional[GatedDeltaNet] = None if full else GatedDeltaNet(args)
        self.attention_norm = OffsetRMSNorm(args.dim, eps=args.norm_eps)
        self.ffn_norm = OffsetRMSNorm(args.dim, eps=args.norm_eps)
        self.moe: Optional[MoE] = Qwen3_5MoE(args) if isinstance(args, Qwen3_5MoeArgs) else None
        self.feed_forward: Optional[FeedForward] = (
            None if self.moe is not None else FeedForward(args.dim, args.hidden_dim)
        )

    @property
    def mixer(self) -> Union[GatedAttention, GatedDeltaNet]:
        mixer = self.attention if self.attention is not None else self.delta_net
        assert mixer is not None  # a block has one of the two
        return mixer

    def init_weights(self, init: ParamInit, prefix: str, init_std: float) -> None:
        """Llama's scheme (output projections depth-scaled), the DeltaNet's own, norms zero-centred."""
        out_std = init_std / math.sqrt(2 * (self.layer_id + 1))
        name = "attention" if self.attention is not None else "delta_net"
        self.mixer.init_weights(init, f"{prefix}.{name}", init_std, out_std)
        if self.moe is not None:
            self.moe.init_weights(init, f"{prefix}.moe", init_std, out_std)
        elif self.feed_forward is not None:
            self.feed_forward.init_weights(init, f"{prefix}.feed_forward", init_std, out_std)
        self.attention_norm.init_weights(init, f"{prefix}.attention_norm")
        self.ffn_norm.init_weights(init, f"{prefix}.ffn_norm")

    def forward(self, x: Tensor, *, rope_cache: Tensor, positions: Optional[Tensor] = None) -> Tensor:
        h = x + self.mixer(self.attention_norm(x), rope_cache=rope_cache, positions=positions)
        ffn = self.moe if self.moe is not None else self.feed_forward
        assert ffn is not None
        return h + ffn(self.ffn_norm(h))


class Qwen3_5Transformer(Transformer):
    """Llama's decoder frame (embedding, blocks, final norm, head; pipeline-stage friendly) with
    Qwen3.5 blocks, a zero-centred final norm and the rotary cache of the rotated channels only."""

    def __init__(self, args: Qwen3_5Args) -> None:
        super().__init__(args)
        self.norm = OffsetRMSNorm(args.dim, eps=args.norm_eps)
        self.share_delta_rule_core()

    def build_block(self, layer_id: int, args: object) -> nn.Module:
        assert isinstance(args, Qwen3_5Args)  # the model's own args
        return Qwen3_5Block(layer_id, args)

    def share_delta_rule_core(self) -> None:
        """One ``DeltaRuleCore`` for every DeltaNet layer (as ``share_attention_core``)."""
        nets = [m for m in self.modules() if isinstance(m, GatedDeltaNet)]
        for net in nets[1:]:
            net.core = nets[0].core

    def reset_rope_cache(self, device: Optional[Union[torch.device, str]] = None) -> None:
        """The (max_seq_len, rotary_dim) cache: RoPE turns only the first rotary_dim channels."""
        device = torch.device(device) if device is not None else self.rope_cache.device
        a = self.args
        assert isinstance(a, Qwen3_5Args)  # built from them
        if device.type == "meta":
            cache = torch.empty((a.max_seq_len, a.rotary_dim), device=device)
        else:
            cache = precompute_rope_cache(a.rotary_dim, a.max_seq_len, a.rope_theta, a.rope_scaling).to(
                device
            )
        self.rope_cache = cache


def generation_cores(model: nn.Module, max_len: int) -> list[tuple[nn.Module, nn.Module]]:
    """(module, its generation core) for every core of ``model``: the full-attention layers' KV
    caches and, for each Gated DeltaNet, a ``RecurrentCacheCore`` (``ModelSpec.generation_cores``)."""
    pairs = attention_cache_cores(model, max_len)
    for m in model.modules():
        if isinstance(m, GatedDeltaNet):
            core = m.core
            chunk, kernel = (
                (core.chunk_size, core.kernel) if isinstance(core, DeltaRuleCore) else (64, "auto")
            )
            pairs.append((m, RecurrentCacheCore(max_len, chunk, kernel)))
    return pairs


# --------------------------------------------------------------------------------------------
# Counting
# --------------------------------------------------------------------------------------------


def _delta_net_params(a: Qwen3_5Args) -> int:
    key_dim = a.linear_num_key_heads * a.linear_key_head_dim
    value_dim = a.linear_num_value_heads * a.linear_value_head_dim
    nv = a.linear_num_value_heads
    projections = a.dim * (2 * key_dim + 2 * value_dim + 2 * nv) + value_dim * a.dim
    return projections + (2 * key_dim + value_dim) * a.linear_conv_kernel + 2 * nv + a.linear_value_head_dim


def _gated_attention_params(a: Qwen3_5Args) -> int:
    D = a.head_dim
    return a.dim * (2 * a.n_heads * D + 2 * a.kv_heads * D) + a.n_heads * D * a.dim + 2 * D


def param_counts(args: Qwen3_5Args) -> ParamCounts:
    """Parameters of ``Qwen3_5Transformer(args)``; ``active``: the top-k routed experts only (MoE)."""
    H = args.dim
    n_full = sum(args.is_full_attention(i) for i in range(args.n_layers))
    mixing = n_full * _gated_attention_params(args) + (args.n_layers - n_full) * _delta_net_params(args)
    if isinstance(args, Qwen3_5MoeArgs):
        shared = 3 * H * args.shared_expert_hidden_dim + (H if args.shared_expert_hidden_dim else 0)
        common_ffn = H * args.num_experts + shared
        expert = 3 * H * args.moe_hidden_dim
        ffn_total = args.n_layers * (common_ffn + args.num_experts * expert)
        ffn_active = args.n_layers * (common_ffn + args.top_k * expert)
    else:
        ffn_total = ffn_active = args.n_layers * 3 * H * args.hidden_dim
    embedding = args.vocab_size * H
    head = 0 if args.tie_embeddings else embedding
    common = embedding + head + H + mixing + args.n_layers * 2 * H
    return ParamCounts(total=common + ffn_total, active=common + ffn_active, embedding=embedding)


def flops_per_token(args: Qwen3_5Args, seq_len: int) -> int:
    """Training FLOPs per token: 6 x the active matmul parameters (the head once, also when tied), the
    full-attention layers' scores and values (12 nh D S each, as Llama's), and per DeltaNet layer the
    chunked rule's matmuls per token and value head (forward, times 3 with backward): with chunk C,
    the intra-chunk products Q K^T, K_beta K^T (2 C dk each), the triangular solve for the values
    and the decayed keys (C (dv + dk)), the outputs of the chunk attention (2 C dv) and the state
    reads and writes (6 dk dv)."""
    counts = param_counts(args)
    tied_head = args.vocab_size * args.dim if args.tie_embeddings else 0
    n_matmul = counts.active - counts.embedding + tied_head
    n_full = sum(args.is_full_attention(i) for i in range(args.n_layers))
    attention = 12 * n_full * args.n_heads * args.head_dim * seq_len
    C, dk, dv = min(args.linear_chunk_size, seq_len), args.linear_key_head_dim, args.linear_value_head_dim
    per_head = 4 * C * dk + C * (dv + dk) + 2 * C * dv + 6 * dk * dv
    delta = 3 * (args.n_layers - n_full) * args.linear_num_value_heads * per_head
    return 6 * n_matmul + attention + delta


def gated_attention_saved(args: Qwen3_5Args, layout: BlockLayout) -> dict[str, float]:
    """What ``GatedAttention`` saves per local token, after the input norm: Llama's attention (q, K/V,
    log-sum-exp, output, the q/k head norms; ``models/llama/model.py``) plus the gate's sigmoid and
    the gated output (the input of ``wo``), per local head in the compute dtype; in fp32 the q norm's
    input is a view of ``wq``'s output, whose storage (queries and gates) stays alive: + the gates. The
    zero-centred q/k norms keep their normalised heads in fp32 (Llama's: in the compute dtype)."""
    nh_d = args.n_heads / layout.tp * args.head_dim
    terms = llama_attention_saved(args, layout)
    heads = (args.n_heads + args.kv_heads) / layout.tp
    terms["qk_norm"] += heads * (4 - layout.compute) * args.head_dim
    terms["attention_gate"] = 2 * layout.compute * nh_d + (4 * nh_d if layout.compute == 4 else 0)
    return terms


def delta_net_saved(args: Qwen3_5Args, layout: BlockLayout) -> dict[str, float]:
    """What a ``GatedDeltaNet`` saves for backward per local token, after the block's input norm, read
    off the code (``DeltaRuleCore`` without a hand-off, ``delta_rule.chunk_terms`` / ``scan_chunks``):

    - projections and convolutions (compute dtype ``cb``): each convolution's input with the K-1 tokens
      before it (the ``cat``), its output (SiLU's input); beta (sigmoid's output), the decay's fp32
      softplus input and output; the L2 norms' fp32 q, k (their input) and rsqrt per key head;
    - the rule, fp32, on the sequence padded to whole chunks (``r`` = padded / local tokens): v and beta
      (their fp32 copies, or the tensors themselves when already fp32 and unpadded), q and k repeated
      to the value heads, k * beta; the chunk matrices (C x C per token and value head: the two decay
      masks' ``exp``, K_beta K^T, I + A, Q K^T and the masked scores); the read / write decays; the
      triangular solve's result (dv + dk); per chunk the state entering it (dk x dv), the written
      values U (C x dv). Without padding q, k and their products are strided views of the token-major
      projections, so each batched matmul saves a contiguous copy of its strided operands: q and k^T
      (twice), k * beta, the chunks' q * read decay (not the first: its state is a constant zero) and
      k * write decay; padded (``F.pad`` makes them contiguous), the chunk slices are views and two
      copies remain (measured: one per intra-chunk product);
    - under bf16 autocast (``layout.autocast``, over an fp32 stream or bf16 FSDP parameters alike) the
      rule's batched matmuls run in bf16 and save a bf16 cast of each operand whose partner needs a
      gradient, padded or not, instead of the fp32 copies: k * beta, k^T, q, k^T (intra-chunk), and per
      chunk q * read decay and W (not the first chunk's: its state is a constant zero), k * write decay^T,
      U twice (the output and the state update cast it anew), the masked scores (C x C) and the state
      twice (dk x dv); K_beta K^T and Q K^T come out in bf16; the fp32 state itself is still saved (the
      decay's product), while the fp32 U and masked scores are not; the elementwise terms and the solve
      stay fp32;
    - the gated head norm and output: the rule's output in fp32 (its storage itself when fp32), the
      rsqrt per value head, the normalised heads (compute dtype), the norm's output and z in fp32,
      silu(z), and the output projection's input (compute dtype).

    Heads split by tp (column-parallel projections). Under CP (``layout.cp``: each rank a contiguous
    slice of S / cp tokens) the two-pass form adds ``delta_cp_handoff`` (``_delta_cp_handoff``).
    Document restarts (``block_causal``) add per-chunk masks not counted. Measured (rehearsal, saved
    activations): under autocast over bf16 FSDP parameters 0.912 of the plan with the fp32 matmul
    terms, before ``BlockLayout.autocast`` told the two apart."""
    cb, tp = layout.compute, layout.tp
    nk, nv = args.linear_num_key_heads / tp, args.linear_num_value_heads / tp
    dk, dv, C, K = (
        args.linear_key_head_dim,
        args.linear_value_head_dim,
        args.linear_chunk_size,
        args.linear_conv_kernel,
    )
    kd, vd = nk * dk, nv * dv
    S = max(layout.keys // layout.cp, 1)  # local tokens of a sequence
    n = -(-S // C)  # chunks
    r = n * C / S
    padded = n * C != S
    fp32_views = cb == 4 and not padded  # the rule's v / beta are the projections' own tensors
    terms = {
        "delta_conv_inputs": cb * (2 * kd + vd) * (S + K - 1) / S,
        "delta_conv_outputs": cb * (2 * kd + vd),
        "delta_gates": cb * nv + 2 * 4 * nv + (0 if fp32_views else 4 * nv * r),
        "delta_qk_l2norm": 4 * 2 * kd + 4 * 2 * nk,
        "delta_values": 4 * vd * r,
        "delta_qk_heads": 3 * 4 * nv * dk * r,
        **_delta_rule_matmuls(nv, dk, dv, C, n, S, layout.autocast),
        "delta_decays": 2 * 4 * nv * r + 4 * nv * r / C,
        "delta_solved": 4 * nv * (dk + dv) * r,
        "delta_out": 4 * vd * (r if cb == 4 else 1) + 4 * nv + cb * vd + 3 * 4 * vd + cb * vd,
    }
    if layout.cp > 1:
        terms["delta_cp_handoff"] = _delta_cp_handoff(nv, dk, dv, C, n, S, layout.cp, layout.autocast)
    return terms


def _delta_rule_matmuls(nv: float, dk: int, dv: int, C: int, n: int, S: int, lp: bool) -> dict[str, float]:
    """``delta_net_saved``'s terms of the rule's batched matmuls per local token (``nv`` local value
    heads, ``n`` chunks of ``C`` over ``S`` tokens; ``lp``: under bf16 autocast, ``layout.autocast``)."""
    r, padded = n * C / S, n * C != S
    later = (n - 1) / n  # the chunks after the first (whose incoming state is a constant zero)
    if lp:  # bf16 casts (per token: 2 nv d r for a C x d operand): 4 intra-chunk, q * read decay and W
        # after the first chunk, k * write decay
        copies = 2 * nv * dk * r * (4 + 2 * later + 1)
    else:  # fp32 contiguous copies of strided operands, and the scan's q * read decay, k * write decay
        copies = 4 * nv * dk * r * 2 if padded else 4 * nv * dk * (4 + later + 1)
    # per chunk the fp32 state entering it (dk x dv) and U (C x dv); under autocast U's two bf16 casts
    # and the state's two bf16 casts instead of the fp32 U
    scan = nv * r * ((4 + 2 * 2) * dk * dv / C + 2 * 2 * dv) if lp else 4 * nv * r * (dk * dv / C + dv)
    return {
        "delta_matmul_copies": copies,
        # fp32 decay masks and I + A; K_beta K^T, Q K^T and the masked scores (the scan's per-chunk
        # casts) in bf16 under autocast
        "delta_chunk_matrices": (3 * 4 + 3 * 2 if lp else 6 * 4) * nv * C * r,
        "delta_scan": scan,
    }


def _delta_cp_handoff(nv: float, dk: int, dv: int, C: int, n: int, S: int, cp: int, lp: bool) -> float:
    """``delta_net_saved``'s two-pass hand-off term under CP (DeltaRuleCore with a StateHandoff) per local
    token, arguments as ``_delta_rule_matmuls``; per sequence over its S local tokens."""
    if lp:  # under autocast, in bf16 casts (bytes, per sequence and value head): per chunk k * write
        # decay^T twice, W, U0 (C x dk or dv), the state part S (dk x dv) and the product M so far
        # (dk x dk), after the first chunk A twice; the scan's first chunk casts q * read decay and W;
        # the fold casts each M and state it multiplies (not the gathered tensor), the mean over ranks
        transition = 2 * (n * C * (3 * dk + dv) + n * dk * (dk + dv) + 2 * (n - 1) * dk * dk + 2 * C * dk)
        return nv * (transition + (cp - 1) / 2 * 2 * dk * (dk + dv)) / S
    # state_transition: per chunk the contiguous copies of k * write decay for its two products
    # (dk x C each), the state part S entering it (dk x dv), and after the first chunk the
    # transition A and the product M so far (dk x dk each); the scan's first chunk now reads a
    # state with a gradient: its q * read decay copy (C x dk)
    transition_elements = 2 * n * dk * C + n * dk * dv + 2 * (n - 1) * dk * dk + C * dk
    # the hand-off: rank j > 0 folds the gathered (M, S) of the ranks before it (keeping the
    # gathered tensor and j states): planned as the mean over the cp ranks
    gathered = (cp - 1) / 2 * dk * dv + (cp - 1) * dk * (dk + dv)
    return 4 * nv * (transition_elements + gathered) / S


def delta_net_handoff(args: Qwen3_5Args, compute: int) -> list[tuple[str, float]]:
    """The context-parallel hand-off of one Gated DeltaNet layer (``DeltaRuleCore`` with a hand-off),
    per sequence of one rank: each convolution's last K-1 inputs (q, k, v; compute dtype), the
    document starts among them under ``block_causal`` (fp32), and the fp32 (M, S) of
    ``state_transition``: nv x dk x (dk + dv)."""
    kd = args.linear_num_key_heads * args.linear_key_head_dim
    vd = args.linear_num_value_heads * args.linear_value_head_dim
    tail = args.linear_conv_kernel - 1
    calls = [("conv tail", float(compute * tail * c)) for c in (kd, kd, vd)]
    if args.attention_mask == "block_causal":
        calls.insert(0, ("conv tail document starts", 4.0 * tail))
    dk, dv = args.linear_key_head_dim, args.linear_value_head_dim
    calls.append(("state transition (M, S)", 4.0 * args.linear_num_value_heads * dk * (dk + dv)))
    return calls


def moe_ffn_saved(args: Qwen3_5MoeArgs, layout: BlockLayout, moe: bool) -> dict[str, float]:
    """Qwen3.5-MoE's feed-forward per local token: ``models/moe``'s routed experts, and the gated shared
    expert (``GatedFeedForward``): its SwiGLU (as ``models/moe`` counts shared experts), the gate's
    sigmoid (one per token) and the SwiGLU's output kept by the gating product (compute dtype); the
    shared expert is replicated inside the tp group (``TP_PLAN``), whole on every tp rank."""
    terms = moe_ffn_saved_routed(args, layout, moe)
    if moe and args.shared_expert_hidden_dim:
        cb = layout.compute
        terms["shared_expert"] = 4 * cb * args.shared_expert_hidden_dim + cb * (args.dim + 1)
    return terms


def moe_ffn_norm_consumers(args: Qwen3_5MoeArgs, moe: bool) -> int:
    """Matmuls the feed-forward's norm feeds: the router gate and the gated shared expert's w1, w3 and
    gate (``models/moe`` counts shared experts without a gate)."""
    return 1 + (3 if args.shared_expert_hidden_dim else 0) if moe else 2


def planner_terms(args: Qwen3_5Args) -> PlannerTerms:
    """The planner's view of Qwen3.5 blocks: Llama's attention (MoE family: ``models/moe``'s routed
    feed-forward) on the full-attention blocks, the Gated DeltaNet (``delta_net_saved``, its input
    norm feeding six projections, the CP hand-off) on the others."""
    if isinstance(args, Qwen3_5MoeArgs):
        base = dataclasses.replace(
            moe_planner_terms(args),
            ffn_saved=functools.partial(moe_ffn_saved, args),
            ffn_norm_consumers=functools.partial(moe_ffn_norm_consumers, args),
        )
    else:
        base = llama_planner_terms(args)
    return dataclasses.replace(
        base,
        rope_dim=args.rotary_dim,
        attention_saved=functools.partial(gated_attention_saved, args),
        recurrent=RecurrentMixerTerms(
            saved=functools.partial(delta_net_saved, args),
            norm_consumers=6,  # wq, wk, wv, wz, wb, wa
            cp_handoff=functools.partial(delta_net_handoff, args),
        ),
        norm_normed_fp32=True,  # OffsetRMSNorm: normed * (1 + w) in fp32, then the cast
        recurrent_blocks=frozenset(i for i in range(args.n_layers) if not args.is_full_attention(i)),
    )


def tp_divisible(args: Qwen3_5Args) -> dict[str, int]:
    """Sizes tensor parallelism splits evenly (heads of both mixers, hidden sizes, vocabulary)."""
    sizes = {
        "model.n_heads": args.n_heads,
        "model.n_kv_heads": args.kv_heads,
        "model.linear_num_key_heads": args.linear_num_key_heads,
        "model.linear_num_value_heads": args.linear_num_value_heads,
        "model.vocab_size": args.vocab_size,
    }
    if not isinstance(args, Qwen3_5MoeArgs):
        sizes["model FFN hidden size"] = args.hidden_dim
    return sizes


# Tensor parallelism. Full-attention blocks: Llama's plan (wq's rows hold whole heads, query and gate
# together). Gated DeltaNet blocks: the projections column-parallel by heads (nk / tp key heads and
# nv / tp value heads per rank, so value head j still reads key head j // (nv / nk) locally), the
# convolutions' channels and the decay's per-head vectors sharded with them ("shard_params"), the
# per-head output norm on the local heads, wo row-parallel; the recurrence itself needs no traffic.
# MoE blocks: models/moe's plan (experts replicated inside tp, expert-parallel over the data axes).
TP_PLAN: dict[str, str] = {
    **LLAMA_TP_PLAN,
    "layers.*.delta_net": "gather_input",
    "layers.*.delta_net.wq": "colwise",
    "layers.*.delta_net.wk": "colwise",
    "layers.*.delta_net.wv": "colwise",
    "layers.*.delta_net.wz": "colwise",
    "layers.*.delta_net.wb": "colwise",
    "layers.*.delta_net.wa": "colwise",
    "layers.*.delta_net.q_conv": "shard_params",
    "layers.*.delta_net.k_conv": "shard_params",
    "layers.*.delta_net.v_conv": "shard_params",
    "layers.*.delta_net.decay": "shard_params",
    "layers.*.delta_net.norm": "head_norm",
    "layers.*.delta_net.wo": "rowwise",
    "layers.*.moe": "moe_io",
    "layers.*.moe.router.gate": "replicate",
    "layers.*.moe.shared_experts": "replicate",
}


def device_check(args: ModelArgs, device_type: str) -> None:
    """``ModelSpec.device_check``: ``model.linear_kernel=fla`` needs CUDA and flash-linear-attention."""
    assert isinstance(args, Qwen3_5Args)  # the family's own args
    check_linear_kernel(args.linear_kernel, device_type)
