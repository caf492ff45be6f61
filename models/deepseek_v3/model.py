"""DeepSeek-V3-style decoder (DeepSeek-V2-Lite, DeepSeek-V3, Kimi K2 shapes), free of any parallelism.

The MoE decoder of ``models/moe/model.py`` with multi-head latent attention (MLA) in every block,
YaRN RoPE, group-limited sigmoid routing and optional multi-token prediction (MTP). Module tree::

    tok_embeddings.weight
    layers.{i}.attention.wq.weight                      (nh * Dqk, H)   without q_lora_rank (V2-Lite)
    layers.{i}.attention.{wq_a, q_norm, wq_b}.weight    (Cq, H), (Cq,), (nh * Dqk, Cq)   with q_lora_rank
    layers.{i}.attention.wkv_a.weight                   (C + R, H)      KV latent and shared RoPE key
    layers.{i}.attention.kv_norm.weight                 (C,)
    layers.{i}.attention.wkv_b.weight                   (nh * (Dn + Dv), C)
    layers.{i}.attention.wo.weight                      (H, nh * Dv)
    layers.{i}.{attention_norm,ffn_norm}.weight
    layers.{i}.feed_forward.{w1,w2,w3}.weight           the first ``first_k_dense`` layers
    layers.{i}.moe.{router.gate, experts.w1/w2/w3, shared_experts.*, expert_bias}   the others
    mtp.{k}.{enorm,hnorm}.weight, mtp.{k}.proj.weight, mtp.{k}.block.*  (k < mtp_depth)
    norm.weight, output.weight

Sizes: H = dim, nh = n_heads, Dn = qk_nope_head_dim, R = qk_rope_head_dim, Dqk = Dn + R,
Dv = v_head_dim, C = kv_lora_rank, Cq = q_lora_rank.

MLA (DeepSeek-V2 section 2.1). Queries come from ``wq`` or from a low-rank path
``wq_b(q_norm(wq_a x))``; each head's query is [nope (Dn) | rope (R)]. Keys and values come from ONE
compressed latent per token: ``wkv_a x`` = [c (C) | k_rope (R)]; ``c`` is normalised
(``kv_norm``) and up-projected per head by ``wkv_b`` to [k_nope (Dn) | v (Dv)]; ``k_rope`` is a
single RoPE key shared by all heads (decoupled RoPE). The attention core receives the queries and
the latent [c | rotated k_rope] (B, S, 1, C + R) with the up-projection (``expand``), so a core
that gathers (context parallel) or caches (generation) keys moves C + R numbers per token instead
of nh * (Dqk + Dv). RoPE uses the rotate-half layout (``models.common``); Hugging Face's
interleaved layout (``rope_interleave``) is a fixed permutation of the rope rows of ``wq``/``wq_b``
and ``wkv_a``, applied by the adapter (``hf.py``). The softmax scale is 1/sqrt(Dqk), times
``yarn_mscale(factor, mscale_all_dim)**2`` under YaRN (applied to the queries).

Routing: the MoE router of ``models/moe`` with ``score_func=sigmoid``, ``n_group`` / ``topk_group``
(group-limited routing), ``route_scale`` (routed_scaling_factor), the aux-loss-free expert bias and
the sequence-wise auxiliary loss (``aux_loss_type=sequence``).

MTP (DeepSeek-V3 section 2.2, ``mtp_depth`` = D > 0): module k (1..D) takes the previous depth's
hidden state h (the main model's last hidden state, before the final norm, for k=1) and the
embedding of the token k positions ahead, ``h' = block(proj([hnorm(h); enorm(emb(t_{i+k}))]))``,
and predicts token t_{i+k+1} through the shared final norm and output head; the embedding and the
head are the main model's. Each module runs on all S positions of the window: the caller passes
per position and depth the id of token i+k and the target (``mtp_inputs`` / ``mtp_labels``,
(B, S, D), ``IGNORE_INDEX`` where there is none: past the window, across a packed document's
end), built on the whole sequence, so a split along it (context parallel, sequence parallel)
needs nothing else; causal attention keeps the filler past the end out of the valid positions.
Without them the model shifts its own tokens. The summed cross-entropy of the D modules times
``mtp_loss_weight / D`` per token (``mtp_grad_scale``: of the trainer's step; else of the forward)
is added to the gradient only (``AddAuxGrad``, like the MoE auxiliary loss), so the logits and the
trainer's ``loss`` stay next-token; the (D, 2) loss sums and target counts are recorded per
forward (``mtp_records``) for the trainer to log as ``mtp_loss``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from models.attention import LatentAttentionCore
from models.common import (
    IGNORE_INDEX,
    CopyFn,
    ParamInit,
    RMSNorm,
    apply_rotary_emb,
    head_deferred,
    yarn_softmax_scale,
)
from models.errors import ConfigError
from models.llama.model import _positive_int, rope_rows
from models.moe.args import MoEArgs
from models.moe.model import TP_PLAN as MOE_TP_PLAN
from models.moe.model import AddAuxGrad, MoEBlock, MoETransformer, _recomputing
from models.moe.model import planner_terms as moe_planner_terms
from models.spec import AttentionComm, AttentionShape, BlockLayout, ParamCounts, PlannerTerms

__all__ = [
    "TP_PLAN",
    "DeepSeekV3Args",
    "attention_comm",
    "DeepSeekV3Block",
    "DeepSeekV3Transformer",
    "MLAttention",
    "MTPModule",
    "flops_per_token",
    "mtp_depth",
    "param_counts",
    "planner_terms",
    "tp_divisible",
]

# The eps of the two latent RMSNorms: DeepSeek's reference code and transformers use RMSNorm's
# default there, not the config's rms_norm_eps.
LATENT_NORM_EPS = 1e-6


# --------------------------------------------------------------------------------------------
# Arguments
# --------------------------------------------------------------------------------------------


@dataclass
class DeepSeekV3Args(MoEArgs):
    """The MoE decoder's fields (experts, routing, balancing) plus MLA and MTP.

    Llama's ``n_kv_heads`` / ``attn_head_dim`` / ``qk_norm`` have no meaning here (MLA has one latent
    per token); ``head_dim`` is the RoPE size ``qk_rope_head_dim``, the size of the rotary cache.
    """

    family: str = "deepseek_v3"
    q_lora_rank: Optional[int] = None  # query latent size Cq; null = full-rank wq (DeepSeek-V2-Lite)
    kv_lora_rank: int = 64  # KV latent size C
    qk_nope_head_dim: int = 32  # per-head query/key part without RoPE, Dn
    qk_rope_head_dim: int = 16  # per-head query / shared key RoPE part, R
    v_head_dim: int = 32  # per-head value size, Dv
    score_func: str = "sigmoid"
    n_group: int = 1
    topk_group: int = 1
    aux_loss_type: str = "sequence"
    mtp_depth: int = 0  # multi-token prediction modules D (0 = off)
    mtp_loss_weight: float = 0.3  # lambda: weight of the mean MTP loss in the objective
    hf_rope_interleave: bool = (
        True  # RoPE row layout of this model's Hugging Face files (DeepSeek's: interleaved)
    )

    def validate(self) -> None:
        """Raise ``ConfigError`` naming the bad value and the fix; return None when consistent."""
        super().validate()
        for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            _positive_int(getattr(self, name), f"model.{name}")
        if self.q_lora_rank is not None:
            _positive_int(self.q_lora_rank, "model.q_lora_rank", "or null (full-rank queries)")
        if self.qk_rope_head_dim % 2:
            raise ConfigError(
                f"model.qk_rope_head_dim={self.qk_rope_head_dim} is odd; rotary embeddings need an even size."
            )
        if self.n_kv_heads is not None or self.qk_norm or self.attn_head_dim is not None:
            raise ConfigError(
                "model.n_kv_heads / qk_norm / attn_head_dim are Llama-attention keys; multi-head latent "
                "attention "
                "has one latent per token: leave them null/false and set kv_lora_rank, qk_nope_head_dim, "
                "qk_rope_head_dim, v_head_dim."
            )
        if isinstance(self.mtp_depth, bool) or not isinstance(self.mtp_depth, int) or self.mtp_depth < 0:
            raise ConfigError(
                f"model.mtp_depth={self.mtp_depth!r} must be an integer >= 0 (0 turns MTP off)."
            )
        w = self.mtp_loss_weight
        if not (isinstance(w, (int, float)) and math.isfinite(w) and w >= 0):
            raise ConfigError(f"model.mtp_loss_weight={w!r} must be a finite number >= 0.")
        if self.mtp_depth and self.tie_embeddings:
            raise ConfigError(
                "model.mtp_depth > 0 with model.tie_embeddings=true is not supported; DeepSeek-V3 unties "
                "them."
            )

    @property
    def head_dim(self) -> int:
        """The rotary size: MLA rotates only the R = qk_rope_head_dim part of each head."""
        return self.qk_rope_head_dim

    @property
    def qk_head_dim(self) -> int:
        """Per-head query/key size Dn + R."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim


# --------------------------------------------------------------------------------------------
# Modules
# --------------------------------------------------------------------------------------------


class MLAttention(nn.Module):
    """Multi-head latent attention (see the module docstring). Local head counts are read from the
    shapes of ``wq``/``wq_b`` and ``wkv_b`` outputs, so column-sharding them (tensor parallel) needs no
    change here; the down-projections ``wq_a``/``wkv_a`` and the latent norms are per token."""

    def __init__(self, args: DeepSeekV3Args, core: Optional[nn.Module] = None) -> None:
        super().__init__()
        self.nope_dim, self.rope_dim, self.v_dim = (
            args.qk_nope_head_dim,
            args.qk_rope_head_dim,
            args.v_head_dim,
        )
        self.kv_rank = args.kv_lora_rank
        qk = args.qk_head_dim
        if args.q_lora_rank is None:
            self.wq = nn.Linear(args.dim, args.n_heads * qk, bias=False)
        else:
            self.wq_a = nn.Linear(args.dim, args.q_lora_rank, bias=False)
            self.q_norm = RMSNorm(args.q_lora_rank, eps=LATENT_NORM_EPS)
            self.wq_b = nn.Linear(args.q_lora_rank, args.n_heads * qk, bias=False)
        self.wkv_a = nn.Linear(args.dim, self.kv_rank + self.rope_dim, bias=False)
        self.kv_norm = RMSNorm(self.kv_rank, eps=LATENT_NORM_EPS)
        self.wkv_b = nn.Linear(self.kv_rank, args.n_heads * (self.nope_dim + self.v_dim), bias=False)
        self.wo = nn.Linear(args.n_heads * self.v_dim, args.dim, bias=False)
        # The point where the one rotated RoPE key meets every head: a pass-through, named so that
        # tensor parallel can sum its gradient over the ranks' heads (TP_PLAN "sum_grad").
        self.rope_key = nn.Identity()
        self.q_scale = yarn_softmax_scale(args.rope_scaling)
        self.core = core if core is not None else LatentAttentionCore(args.attention_mask)

    def init_weights(self, init: ParamInit, prefix: str, std: float, out_std: float) -> None:
        """Projections into attention: truncated normal (std); ``wo``: depth-scaled ``out_std``; norms
        ones."""
        for name in ("wq", "wq_a", "wq_b", "wkv_a", "wkv_b"):
            if hasattr(self, name):
                init.trunc_normal(f"{prefix}.{name}.weight", getattr(self, name).weight, std, 2.0)
        init.trunc_normal(f"{prefix}.wo.weight", self.wo.weight, out_std, 2.0)
        if hasattr(self, "q_norm"):
            self.q_norm.init_weights(init, f"{prefix}.q_norm")
        self.kv_norm.init_weights(init, f"{prefix}.kv_norm")

    def queries(self, x: Tensor) -> Tensor:
        """(B, S, H) -> (B, S, nh * Dqk), full-rank or through the query latent."""
        if hasattr(self, "wq"):
            return self.wq(x)
        return self.wq_b(self.q_norm(self.wq_a(x)))

    def expand(self, latent: Tensor) -> tuple[Tensor, Tensor]:
        """Latents (B, Sk, 1, C + R) -> keys (B, Sk, nh, Dqk), values (B, Sk, nh, Dv)."""
        c, k_rope = latent.split([self.kv_rank, self.rope_dim], dim=-1)  # (B, Sk, 1, C), (B, Sk, 1, R)
        B, Sk = c.shape[:2]
        kv = self.wkv_b(c.squeeze(2)).view(B, Sk, -1, self.nope_dim + self.v_dim)  # (B, Sk, nh, Dn + Dv)
        k_nope, v = kv.split([self.nope_dim, self.v_dim], dim=-1)
        k = torch.cat([k_nope, k_rope.expand(-1, -1, k_nope.shape[2], -1)], dim=-1)  # (B, Sk, nh, Dqk)
        return k, v

    def forward(self, x: Tensor, *, rope_cache: Tensor, positions: Optional[Tensor] = None) -> Tensor:
        """``x`` (B, S, H); ``rope_cache`` (max_seq_len, R); ``positions`` (S,), (B, S) or None."""
        B, S, _ = x.shape
        rope = rope_rows(rope_cache, S, positions)  # (S, R) or (B, S, R)
        q = self.queries(x).view(B, S, -1, self.nope_dim + self.rope_dim)  # (B, S, nh, Dqk)
        q_nope, q_rope = q.split([self.nope_dim, self.rope_dim], dim=-1)
        c, k_rope = self.wkv_a(x).split([self.kv_rank, self.rope_dim], dim=-1)  # (B, S, C), (B, S, R)
        q_rope, k_rope = apply_rotary_emb(q_rope, k_rope.unsqueeze(2), rope)  # (B, S, nh, R), (B, S, 1, R)
        k_rope = self.rope_key(k_rope)
        q = torch.cat([q_nope, q_rope], dim=-1)  # (B, S, nh, Dqk)
        if self.q_scale != 1.0:
            q = q * self.q_scale
        latent = torch.cat([self.kv_norm(c).unsqueeze(2), k_rope], dim=-1)  # (B, S, 1, C + R)
        out = self.core(q, latent, expand=self.expand, positions=positions)  # (B, S, nh, Dv)
        return self.wo(out.reshape(B, S, -1))  # (B, S, H)


class DeepSeekV3Block(MoEBlock):
    """The MoE family's block with multi-head latent attention."""

    def build_attention(self, args: Any) -> MLAttention:
        return MLAttention(args)


class MTPModule(nn.Module):
    """One multi-token-prediction depth: ``block(proj([hnorm(h); enorm(emb)]))`` (DeepSeek-V3 eq. 21-22).

    Its block is MLA + a DENSE SwiGLU (``ffn_hidden_dim``), not an MoE layer as in DeepSeek-V3's
    released MTP layer: the module then holds only dense parameters, which every data-parallel layout
    (FSDP, DDP, ZeRO-1, EP's dense part) handles as the rest of the root module."""

    def __init__(self, layer_id: int, args: DeepSeekV3Args) -> None:
        super().__init__()
        self.enorm = RMSNorm(args.dim, eps=args.norm_eps)
        self.hnorm = RMSNorm(args.dim, eps=args.norm_eps)
        self.proj = nn.Linear(2 * args.dim, args.dim, bias=False)
        self.block = DeepSeekV3Block(layer_id, dataclasses.replace(args, first_k_dense=layer_id + 1))

    def init_weights(self, init: ParamInit, prefix: str, init_std: float) -> None:
        self.enorm.init_weights(init, f"{prefix}.enorm")
        self.hnorm.init_weights(init, f"{prefix}.hnorm")
        init.trunc_normal(f"{prefix}.proj.weight", self.proj.weight, init_std, 2.0)
        self.block.init_weights(init, f"{prefix}.block", init_std)

    def forward(self, h: Tensor, emb: Tensor, *, rope_cache: Tensor, positions: Optional[Tensor]) -> Tensor:
        x = self.proj(torch.cat([self.hnorm(h), self.enorm(emb)], dim=-1))  # (B, S', 2H) -> (B, S', H)
        return self.block(x, rope_cache=rope_cache, positions=positions)  # (B, S', H)


class MTPModules(nn.ModuleDict):
    """The D MTP modules (keys "0".."D-1"); calling it runs them all, so a wrapper that hooks module calls
    (FSDP: the MTP modules share a unit with the final norm and the head) sees one call."""

    def forward(
        self,
        h: Tensor,
        embs: list[Tensor],
        labels: Tensor,
        *,
        rope_cache: Tensor,
        positions: Optional[Tensor],
        head: Callable[[Tensor], Tensor],
        loss_fn: Callable[[Tensor, Tensor], Tensor],
    ) -> Tensor:
        """(D, 2): per depth k, the summed cross-entropy and the number of targets. Module k runs on all S
        positions: position i combines the previous depth's hidden state at i with ``embs[k-1]`` at i (the
        embedding of token i+k) and predicts ``labels[..., k-1]`` at i (token i+k+1, ``IGNORE_INDEX``
        where it does not exist); causal attention keeps the tail's filler out of the valid positions.
        ``head`` = final norm + output; ``loss_fn(logits, labels)`` = summed token cross-entropy."""
        out = []
        for k, module in enumerate(self.values()):
            h = module(h, embs[k], rope_cache=rope_cache, positions=positions)  # (B, S, H)
            target = labels[..., k]  # (B, S)
            out.append(
                torch.stack([loss_fn(head(h), target).float(), (target != IGNORE_INDEX).sum().float()])
            )
        return torch.stack(out)


def mtp_loss_sum(logits: Tensor, labels: Tensor) -> Tensor:
    """Summed cross-entropy of (B, S, V) ``logits`` against (B, S) ``labels`` (``IGNORE_INDEX`` skipped)."""
    return F.cross_entropy(
        logits.flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
    )


def mtp_targets(
    inputs: Tensor, labels: Tensor, depth: int, positions: Optional[Tensor] = None
) -> tuple[Tensor, Tensor]:
    """Multi-token-prediction inputs and targets of a whole (B, S) window, before any split along it.

    Returns (B, S, D) ids of token i+k and (B, S, D) targets ``labels[i+k]`` (token i+k+1) of
    position i for k = 1..D; a target is ``IGNORE_INDEX`` past the window's end, where the label
    is ignored (padding), and, with per-document ``positions`` (block-causal masking), when token
    i+k or token i+k+1 lies in another document than token i (the window's last label, whose
    token is outside the window, counts as in i's document, as for the next-token loss).
    Context parallelism then shards these like the labels, so each rank gets the tokens of other
    ranks' shards that its positions need.
    """
    B, S = inputs.shape
    index = torch.arange(S, device=inputs.device)
    ext_ids = torch.cat([inputs, inputs.new_zeros(B, depth)], dim=1)  # (B, S + D)
    ext_labels = torch.cat([labels, labels.new_full((B, depth), IGNORE_INDEX)], dim=1)
    ids = torch.stack([ext_ids[:, k : k + S] for k in range(1, depth + 1)], dim=-1)  # (B, S, D)
    targets = torch.stack([ext_labels[:, k : k + S] for k in range(1, depth + 1)], dim=-1)  # (B, S, D)
    if positions is not None:
        doc = (index - positions).expand(B, S)  # a document's first index, per token
        big = torch.iinfo(doc.dtype).max  # past the window: "unknown", never equal
        ext_doc = torch.cat([doc, doc.new_full((B, depth + 1), big)], dim=1)
        ext_doc[:, S] = doc[:, -1]  # token S (the last label) counts as in the last token's document
        for k in range(1, depth + 1):
            same = (ext_doc[:, k : k + S] == doc) & (ext_doc[:, k + 1 : k + 1 + S] == doc)
            targets[..., k - 1] = targets[..., k - 1].masked_fill(~same, IGNORE_INDEX)
    return ids, targets


def batch_inputs(
    args: DeepSeekV3Args, inputs: Tensor, labels: Tensor, positions: Optional[Tensor]
) -> dict[str, Tensor]:
    """The family's extra model inputs of a training window (``ModelSpec.batch_inputs``): with MTP
    modules, ``mtp_inputs`` / ``mtp_labels`` (B, S, D) from :func:`mtp_targets`; none otherwise."""
    if args.mtp_depth < 1:
        return {}
    ids, targets = mtp_targets(inputs, labels, args.mtp_depth, positions)
    return {"mtp_inputs": ids, "mtp_labels": targets}


def shifted_tokens(tokens: Tensor, depth: int) -> tuple[Tensor, Tensor]:
    """MTP inputs and targets of a window alone (no labels, no documents): (B, S, D) ids of token i+k
    (0 past the end) and of token i+k+1 (``IGNORE_INDEX`` past the end), k = 1..D."""
    B, S = tokens.shape
    pad = tokens.new_full((B, depth + 1), IGNORE_INDEX)
    ext = torch.cat([tokens, pad], dim=1)  # (B, S + D + 1)
    ids = torch.stack([ext[:, k : k + S] for k in range(1, depth + 2)], dim=-1)  # (B, S, D + 1)
    return ids[..., :depth].clamp(min=0), ids[..., 1:]


class DeepSeekV3Transformer(MoETransformer):
    """The MoE decoder with MLA blocks and optional MTP modules (pipeline-stage friendly: the MTP
    modules need the embedding, the final norm and the head, so they run only where all are present)."""

    args: DeepSeekV3Args

    def __init__(self, args: DeepSeekV3Args) -> None:
        super().__init__(args)
        self.mtp: Optional[MTPModules] = (
            MTPModules({str(k): MTPModule(args.n_layers + k, args) for k in range(args.mtp_depth)})
            if args.mtp_depth
            else None
        )
        self.share_attention_core()
        self.mtp_records: list[Tensor] = []  # per forward: (D,) MTP losses (detached), for the trainer's log
        # per token of the step (set by the trainer); None: the forward's own tokens
        self.mtp_grad_scale: Optional[float] = None
        # (logits, labels) -> summed cross-entropy; the trainer's also reduces vocab-sharded logits
        self.mtp_loss_fn: Callable[[Tensor, Tensor], Tensor] = mtp_loss_sum

    def build_block(self, layer_id: int, args: Any) -> nn.Module:
        return DeepSeekV3Block(layer_id, args)

    def share_attention_core(self) -> None:
        """One latent core for every MLA layer (the mask is built once per batch)."""
        cores = [m for m in self.modules() if isinstance(m, MLAttention)]
        for attention in cores[1:]:
            attention.core = cores[0].core

    @torch.no_grad()
    def init_weights(
        self, seed: int = 0, copy_fn: Optional[CopyFn] = None, *, init: Optional[ParamInit] = None
    ) -> None:
        init = init if init is not None else ParamInit(seed, copy_fn)
        super().init_weights(init=init)
        if self.mtp is not None:
            for k, module in self.mtp.items():
                cast(MTPModule, module).init_weights(init, f"mtp.{k}", self.args.init_std)
        self.mtp_records = []

    def forward(
        self,
        tokens: Tensor,
        positions: Optional[Tensor] = None,
        mtp_inputs: Optional[Tensor] = None,
        mtp_labels: Optional[Tensor] = None,
    ) -> Tensor:
        """Token ids (B, S) -> next-token logits (B, S, V) (stage-friendly like ``Transformer``). With
        MTP modules, a whole model and gradients enabled, the MTP loss also flows into backward.
        ``mtp_inputs`` / ``mtp_labels`` (B, S, D): per depth k, the id of token i+k and the target
        (token i+k+1 or ``IGNORE_INDEX``) of position i; built by the caller on the whole sequence
        (before any split along it, with document boundaries applied), from ``tokens`` when None."""
        norm, output = self.norm, self.output
        if self.mtp is None or self.tok_embeddings is None or norm is None or output is None:
            return super().forward(tokens, positions)
        B, S = tokens.shape
        if S > self.args.max_seq_len:
            raise ConfigError(
                f"sequence length {S} exceeds model.max_seq_len={self.args.max_seq_len}; "
                "raise model.max_seq_len or lower training.seq_len."
            )
        train_mtp = torch.is_grad_enabled()
        deferred = head_deferred(output)  # the loss runs the head chunk by chunk (mtp_loss_fn too)
        if train_mtp:  # one embedding call for the window and the D shifted windows (B, S, D) -> (D*B, S)
            if mtp_inputs is None:
                mtp_inputs, mtp_labels = shifted_tokens(tokens, self.args.mtp_depth)
            ids = torch.cat([tokens, mtp_inputs.movedim(-1, 0).flatten(0, 1)])
            h, *embs = self.tok_embeddings(ids).split(B)  # (B, S, H) each (S / tp under sequence parallel)
        else:
            h = self.tok_embeddings(tokens)  # (B, S, H)
        for layer in self.layers.values():
            h = layer(h, rope_cache=self.rope_cache, positions=positions)  # (B, S, H)
        if train_mtp:
            stats = self.mtp(
                h,
                embs,
                mtp_labels,
                rope_cache=self.rope_cache,
                positions=positions,
                head=(lambda x: norm(x)) if deferred else (lambda x: output(norm(x))),
                loss_fn=self.mtp_loss_fn,
            )  # (D, 2)
            if not _recomputing():
                self.mtp_records.append(stats.detach())
            # objective: mtp_loss_weight / D * summed MTP cross-entropy per token of the step (the
            # trainer's mtp_grad_scale, data parallel included), or per token of this forward
            scale = self.mtp_grad_scale if self.mtp_grad_scale is not None else 1.0 / tokens.numel()
            weight = self.args.mtp_loss_weight / self.args.mtp_depth * scale
            h = AddAuxGrad.apply(h, stats[:, 0].sum() * weight)  # h unchanged; backward adds d(MTP loss)
        return norm(h) if deferred else output(norm(h))  # (B, S, V), or (B, S, H) deferred

    def reset_mtp_stats(self) -> None:
        """Forget the recorded MTP losses (start of an optimizer step)."""
        self.mtp_records = []


# --------------------------------------------------------------------------------------------
# Counting
# --------------------------------------------------------------------------------------------


def attention_params(args: DeepSeekV3Args) -> int:
    """Parameters of one ``MLAttention``."""
    nh, dim = args.n_heads, args.dim
    if args.q_lora_rank is None:
        q = dim * nh * args.qk_head_dim
    else:
        q = dim * args.q_lora_rank + args.q_lora_rank + args.q_lora_rank * nh * args.qk_head_dim
    kv = dim * (args.kv_lora_rank + args.qk_rope_head_dim) + args.kv_lora_rank
    kv += args.kv_lora_rank * nh * (args.qk_nope_head_dim + args.v_head_dim)
    return q + kv + nh * args.v_head_dim * dim


def _layer_params(args: DeepSeekV3Args, moe: bool) -> tuple[int, int]:
    """(total, active) parameters of one block."""
    dim = args.dim
    common = attention_params(args) + 2 * dim
    if not moe:
        dense = common + 3 * dim * args.hidden_dim
        return dense, dense
    expert = 3 * dim * args.moe_hidden_dim
    shared = common + dim * args.num_experts + args.num_shared_experts * expert
    return shared + args.num_experts * expert, shared + args.top_k * expert


def param_counts(args: DeepSeekV3Args) -> ParamCounts:
    """Parameters of ``DeepSeekV3Transformer(args)`` (MTP modules included); ``active``: top-k experts."""
    embedding = args.vocab_size * args.dim
    head = 0 if args.tie_embeddings else args.vocab_size * args.dim
    total = active = embedding + head + args.dim
    for i in range(args.n_layers):
        t, a = _layer_params(args, args.is_moe_layer(i))
        total, active = total + t, active + a
    mtp = 2 * args.dim + 2 * args.dim * args.dim + _layer_params(args, moe=False)[0]  # dense block
    total += args.mtp_depth * mtp
    active += args.mtp_depth * mtp
    return ParamCounts(total=total, active=active, embedding=embedding)


def flops_per_token(args: DeepSeekV3Args, seq_len: int) -> int:
    """Training FLOPs per token: 6 x active matmul parameters (head once per MTP depth too) plus the
    attention scores (Dqk) and values (Dv): 6 * L * nh * (Dqk + Dv) * S (no causal discount)."""
    counts = param_counts(args)
    head = args.vocab_size * args.dim
    n_matmul = counts.active - counts.embedding + (head if args.tie_embeddings else 0) + args.mtp_depth * head
    layers = args.n_layers + args.mtp_depth
    attention = 6 * layers * args.n_heads * (args.qk_head_dim + args.v_head_dim) * seq_len
    return 6 * n_matmul + attention


def mtp_flops_per_token(args: DeepSeekV3Args, seq_len: int) -> int:
    """The MTP modules' share of ``flops_per_token`` (their blocks, projections and head passes)."""
    return flops_per_token(args, seq_len) - flops_per_token(dataclasses.replace(args, mtp_depth=0), seq_len)


def mtp_depth(args: DeepSeekV3Args) -> int:
    """Multi-token-prediction modules (``ModelSpec.mtp_depth``)."""
    return args.mtp_depth


def attention_comm(args: DeepSeekV3Args) -> AttentionComm:
    """MLA's traffic: CP gathers the latent; under TP the input gradient is complete when only the
    replicated down-projections read it (q_lora_rank set), and backward all-reduces the inputs of the
    column-wise up-projections (query latent, KV latent: their norms' outputs) and the shared RoPE key
    (a slice of ``wkv_a``'s output), one all-reduce each."""
    q_latent = args.q_lora_rank or 0
    latents = ((q_latent,) if q_latent else ()) + (args.kv_lora_rank,)
    return AttentionComm(
        cp_gather_dim=args.kv_lora_rank + args.qk_rope_head_dim,
        tp_entry_partial=args.q_lora_rank is None,
        tp_backward_all_reduces=(*((n, "norm") for n in latents), (args.qk_rope_head_dim, "matmul")),
        # per head: q and k (Dqk), v and the output projection's input (Dv); latents: the query latent
        # before and after its norm, [c | k_rope] from wkv_a and c after kv_norm
        saved=(
            args.n_heads * 2 * (args.qk_head_dim + args.v_head_dim),
            2 * q_latent + 2 * args.kv_lora_rank + args.qk_rope_head_dim,
        ),
    )


def _latent_norm(layout: BlockLayout, width: float, source_width: float) -> float:
    """A latent RMSNorm (``q_norm`` / ``kv_norm``, ``width`` wide) over a projection's output: its fp32
    input (the projection's output storage itself, ``source_width`` wide, when that is fp32; a fresh
    fp32 copy otherwise), the rsqrt, the normalised latent (compute dtype)."""
    source = 4 * source_width if layout.compute == 4 else 4 * width
    return source + 4 + layout.compute * width


def attention_saved(args: DeepSeekV3Args, layout: BlockLayout) -> dict[str, float]:
    """What ``MLAttention`` saves for backward per local token, after the input norm (which feeds two
    replicated down-projections, ``wq``/``wq_a`` and ``wkv_a``): the query latent's norm and the
    up-projection's input (q_lora_rank); the KV latent's norm; the latent [c | k_rope] that ``wkv_b``
    keeps (under CP gathered over the whole sequence; under autocast over an fp32 latent, the bf16
    cast of c); then what SDPA keeps of q (nh x Dqk, split by tp), of the per-head expanded keys and
    values and of its result, which depends on the kernel: q/k and v head sizes differ (Dqk != Dv,
    every DeepSeek shape), which torch's fused CPU kernel does not take, so on CPU SDPA runs its math
    path (measured): copies of the scaled q, of K and of V, the softmax probabilities (nh x ``keys``
    per query token: the whole sequence, S^2 per head), no log-sum-exp; a fused kernel (CUDA's
    memory-efficient attention, or Dqk == Dv) keeps q, K, V as given -- V a view of ``wkv_b``'s whole
    output, nh x (Dn + Dv) -- and the fp32 log-sum-exp per head (planned, not measured here). The
    output (nh x Dv) is ``wo``'s input."""
    nh, cb, cp = args.n_heads / layout.tp, layout.compute, layout.cp
    Dn, R, Dv = args.qk_nope_head_dim, args.qk_rope_head_dim, args.v_head_dim
    C, Cq = args.kv_lora_rank, args.q_lora_rank
    terms: dict[str, float] = {}
    if Cq:  # query latent: its norm, and wq_b's input (the gain's output, cast by autocast)
        terms["q_latent"] = _latent_norm(layout, Cq, Cq) + cb * Cq
    terms["kv_latent_norm"] = _latent_norm(layout, C, C + R)
    terms["kv_latent"] = (2 * C if layout.cast_each else cb * (C + R)) * cp
    terms["q"] = cb * nh * (Dn + R)
    terms["k_expanded"] = cb * nh * (Dn + R) * cp
    if Dn + R != Dv and not layout.fused_attention:  # SDPA's math path
        terms["v_expanded"] = cb * nh * Dv * cp
        terms["attention_probs"] = cb * nh * layout.keys
    else:  # a fused kernel
        terms["v_expanded"] = cb * nh * (Dn + Dv) * cp
        terms["attention_lse"] = 4 * nh
    terms["attention_out"] = cb * nh * Dv
    return terms


def planner_terms(args: DeepSeekV3Args) -> PlannerTerms:
    """The planner's view of DeepSeek-V3 blocks: MLA (its traffic, its saved latents and per-head
    tensors, RoPE over R = qk_rope_head_dim, a norm feeding two down-projections) and the MoE
    feed-forward. Llama's rules (the article's, the op-level checkpointing cache) count MLA as n_heads
    heads of dim / n_heads."""
    return dataclasses.replace(
        moe_planner_terms(args),
        comm=attention_comm(args),
        shape=AttentionShape(args.n_heads, args.n_heads, args.dim // args.n_heads),
        rope_dim=args.qk_rope_head_dim,
        attention_saved=functools.partial(attention_saved, args),
        attention_norm_consumers=2,
    )


def tp_divisible(args: DeepSeekV3Args) -> dict[str, int]:
    sizes = {"model.n_heads": args.n_heads, "model.vocab_size": args.vocab_size}
    if args.first_k_dense or args.mtp_depth:
        sizes["model FFN hidden size"] = args.hidden_dim
    return sizes


# MLA under tensor parallel: heads split (wq / wq_b / wkv_b column-wise, wo row-wise); the low-rank
# down-projections wq_a / wkv_a and the latent norms are replicated and run on the gathered sequence
# (the block input is gathered once, "gather_input"). The up-projections' input gradients come back as
# partial sums over the ranks' heads and are all-reduced by the column-wise styles; the shared RoPE key
# feeds every rank's heads directly, so its gradient is all-reduced at ``rope_key`` ("sum_grad": one
# (B, S, R) all-reduce per layer in backward). MoE and dense FFN layers as in the MoE family.
TP_PLAN: dict[str, str] = {
    **{k: v for k, v in MOE_TP_PLAN.items() if not k.startswith("layers.*.attention.")},
    "layers.*.attention.wq": "colwise",
    "layers.*.attention.wq_a": "replicate",
    "layers.*.attention.q_norm": "replicate",
    "layers.*.attention.wq_b": "colwise",
    "layers.*.attention.wkv_a": "replicate",
    "layers.*.attention.kv_norm": "replicate",
    "layers.*.attention.wkv_b": "colwise",
    "layers.*.attention.rope_key": "sum_grad",
    "layers.*.attention.wo": "rowwise",
}
# MTP modules: their block (dense FFN) as the main blocks; the two norms on the residual-stream layout
# (sequence-sharded under SP) and the token-wise projection replicated, run on this rank's tokens.
TP_PLAN.update(
    {
        "mtp.*.enorm": "norm",
        "mtp.*.hnorm": "norm",
        "mtp.*.proj": "replicate",
        **{
            f"mtp.*.block.{k[len('layers.*.') :]}": v for k, v in TP_PLAN.items() if k.startswith("layers.*.")
        },
    }
)
