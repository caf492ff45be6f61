"""Dense Llama-style decoder (Llama 2 / Llama 3 shapes), free of any parallelism.

The module tree and parameter names match torchtitan's Llama 3 model, so tensor-parallel plans
(keyed by module name) and Hugging Face conversion can rely on them::

    tok_embeddings.weight
    layers.{i}.attention.{wq,wk,wv,wo}.weight
    layers.{i}.attention.{q_norm,k_norm}.weight      (with qk_norm: Qwen3's per-head norms)
    layers.{i}.feed_forward.{w1,w2,w3}.weight
    layers.{i}.{attention_norm,ffn_norm}.weight
    norm.weight
    output.weight

Four properties let the parallelism code in ``parallelisms/`` work without touching this file:

* ``Attention`` derives the number of heads from tensor shapes at runtime, so column-sharded
  ``wq/wk/wv`` (tensor parallel) simply yield fewer local heads. It picks its rotary rows by
  each token's position where the whole (local) sequence is present, so a sequence-sharded
  residual stream (sequence parallel) and a sequence shard (context parallel) both get the
  right rotations.
* ``Attention`` delegates the attention itself to a swappable ``core`` (``models/attention.py``,
  one instance shared by all layers) that receives q, k, v after RoPE and before the grouped-query
  expansion plus the positions, so context parallelism replaces the core and nothing else.
* ``Transformer.forward`` tolerates a missing ``tok_embeddings`` / ``norm`` / ``output`` and
  deleted entries of the ``layers`` ``ModuleDict``, so a pipeline stage is this same class
  with pieces removed.
* ``init_weights(init)`` on every module draws each parameter from its own generator seeded by
  ``(seed, canonical name)`` (``models.common.ParamInit``), so a model built on the meta device,
  sharded and materialised anywhere gets bit-identical weights to a one-process CPU build.

``LLAMA_SPEC`` in ``models/llama/__init__.py`` is what the rest of the stack sees (``models/spec.py``);
the Hugging Face adapter lives in ``models/llama/hf.py`` (this file never imports it).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Optional, Protocol, Union, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from models.attention import AttentionCore, document_ids, validate_attention_mask
from models.common import (
    CopyFn,
    OutputHead,
    ParamInit,
    RMSNorm,
    RopeScaling,
    apply_rotary_emb,
    head_deferred,
    precompute_rope_cache,
    repeat_kv,
)
from models.errors import ConfigError
from models.mup import MupArgs
from models.spec import AttentionComm, AttentionShape, BlockLayout, ModelArgs, ParamCounts, PlannerTerms

__all__ = [
    "TP_PLAN",
    "Attention",
    "FeedForward",
    "LlamaArgs",
    "Transformer",
    "TransformerBlock",
    "num_flops_per_token",
    "param_counts",
    "planner_terms",
]


# --------------------------------------------------------------------------------------------
# Arguments
# --------------------------------------------------------------------------------------------


@dataclass
class LlamaArgs(ModelArgs):
    """Shape and initialisation hyper-parameters of a dense Llama model."""

    family: str = "llama"
    dim: int = 256
    n_layers: int = 4
    n_heads: int = 8
    n_kv_heads: Optional[int] = None  # None -> n_heads (grouped-query attention when smaller)
    vocab_size: int = 512
    multiple_of: int = 256  # FFN hidden size rounded up to a multiple of this
    ffn_dim_multiplier: Optional[float] = None
    ffn_hidden_dim: Optional[int] = None  # explicit FFN hidden size; overrides the Llama formula
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    max_seq_len: int = 2048
    tie_embeddings: bool = False
    init_std: float = 0.02
    attention_mask: str = "causal"  # causal | block_causal (no attention across packed documents)
    attn_head_dim: Optional[int] = None  # explicit head size (Qwen3: 128); None = dim / n_heads
    qk_norm: bool = False  # RMSNorm over each q and k head before RoPE (Qwen3, Qwen3-MoE)
    mup: MupArgs = field(default_factory=MupArgs)  # µP (models/mup.py); off by default
    logit_softcap: Optional[float] = (
        None  # cap * tanh(logits / cap) on the output logits (Gemma 2); None = off
    )

    def validate(self) -> None:
        """Raise ``ConfigError`` naming the bad value and the fix; return None when consistent."""
        if self.mup.enable:
            self.mup.validate()
            if self.tie_embeddings:
                raise ConfigError(
                    "model.mup.enable=true with model.tie_embeddings=true: µP initialises and scales the "
                    "embedding and the output head differently, so they cannot share one weight. Set "
                    "model.tie_embeddings=false (or model.mup.enable=false)."
                )
        for name in ("dim", "n_layers", "n_heads", "vocab_size", "multiple_of", "max_seq_len"):
            _positive_int(getattr(self, name), f"model.{name}")
        for name in ("n_kv_heads", "ffn_hidden_dim", "attn_head_dim"):
            value = getattr(self, name)
            if value is not None:
                _positive_int(value, f"model.{name}", "or null (default)")
        if self.ffn_dim_multiplier is not None and not self.ffn_dim_multiplier > 0:
            raise ConfigError(
                f"model.ffn_dim_multiplier={self.ffn_dim_multiplier!r} must be > 0 or null (no multiplier)."
            )
        for name in ("norm_eps", "rope_theta", "init_std"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and value > 0):
                raise ConfigError(f"model.{name}={value!r} must be a positive number.")
        if self.logit_softcap is not None and not self.logit_softcap > 0:
            raise ConfigError(
                f"model.logit_softcap={self.logit_softcap!r} must be > 0 (Gemma 2: 30.0) or null (no "
                "capping)."
            )
        self.rope_scaling.validate()
        validate_attention_mask(self.attention_mask)
        if self.attn_head_dim is None and self.dim % self.n_heads != 0:
            raise ConfigError(
                f"model.dim={self.dim} is not divisible by model.n_heads={self.n_heads}; "
                "choose dim as a multiple of n_heads (e.g. "
                f"dim={self.n_heads * max(1, round(self.dim / self.n_heads))})"
                " or set model.attn_head_dim explicitly."
            )
        if self.head_dim % 2 != 0:
            source = (
                f"model.attn_head_dim={self.attn_head_dim}"
                if self.attn_head_dim is not None
                else f"head_dim = model.dim / model.n_heads = {self.dim}/{self.n_heads} = {self.head_dim}"
            )
            raise ConfigError(
                f"{source} is odd; rotary embeddings need an even head size: change attn_head_dim, dim or "
                "n_heads."
            )
        if self.n_heads % self.kv_heads != 0:
            raise ConfigError(
                f"model.n_heads={self.n_heads} is not divisible by model.n_kv_heads={self.kv_heads}; "
                "grouped-query attention needs n_kv_heads to divide n_heads (or n_kv_heads=null for n_heads)."
            )

    @property
    def head_dim(self) -> int:
        """Size of one attention head: ``attn_head_dim`` if set, else dim // n_heads."""
        return self.attn_head_dim if self.attn_head_dim is not None else self.dim // self.n_heads

    @property
    def kv_heads(self) -> int:
        """Number of key/value heads: n_kv_heads, or n_heads when unset."""
        return self.n_kv_heads if self.n_kv_heads is not None else self.n_heads

    @property
    def hidden_dim(self) -> int:
        """FFN hidden size: ``ffn_hidden_dim`` if set, else the Llama rule.

        Llama rule: ``h = int(2 * 4 * dim / 3)``; ``h = int(ffn_dim_multiplier * h)`` if a
        multiplier is set; then round ``h`` up to a multiple of ``multiple_of``.
        """
        if self.ffn_hidden_dim is not None:
            return self.ffn_hidden_dim
        hidden = int(2 * 4 * self.dim / 3)
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return self.multiple_of * ((hidden + self.multiple_of - 1) // self.multiple_of)


def _positive_int(value: object, key: str, alternative: str = "") -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(
            f"{key}={value!r} must be a positive integer{' ' + alternative if alternative else ''}."
        )


# --------------------------------------------------------------------------------------------
# Modules
# --------------------------------------------------------------------------------------------


def rope_rows(rope_cache: Tensor, seq_len: int, positions: Optional[Tensor]) -> Tensor:
    """Rotary rows for the tokens at hand: (S, D) for positions 0..S-1, else ``rope_cache[positions]``
    ((S, D) or (B, S, D) for positions (S,) or (B, S))."""
    if positions is None:
        return rope_cache[:seq_len]
    return rope_cache[positions]


class Attention(nn.Module):
    """Causal multi-head attention with rotary embeddings, grouped-query attention and, with
    ``qk_norm``, an RMSNorm over each query and key head before RoPE (Qwen3's ``q_norm`` /
    ``k_norm``: one gain of size head_dim shared by all heads, so tensor parallelism needs no
    change: each rank normalises its own heads with the replicated gain).

    Head counts are not stored: they are read from tensor shapes in ``forward``, so that
    tensor parallelism (which shards ``wq/wk/wv`` by output features and ``wo`` by input
    features) needs no change here. The attention itself is ``self.core``
    (``models/attention.py``): it gets q, k, v after RoPE and before the grouped-query
    expansion, plus the positions, and applies ``model.attention_mask``; context parallelism
    swaps in a core that gathers keys and values across ranks.
    """

    def __init__(self, args: LlamaArgs, core: Optional[nn.Module] = None) -> None:
        super().__init__()
        self.head_dim = args.head_dim
        self.wq = nn.Linear(args.dim, args.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * self.head_dim, args.dim, bias=False)
        self.q_norm: Optional[RMSNorm] = RMSNorm(self.head_dim, eps=args.norm_eps) if args.qk_norm else None
        self.k_norm: Optional[RMSNorm] = RMSNorm(self.head_dim, eps=args.norm_eps) if args.qk_norm else None
        self.core = core if core is not None else AttentionCore(getattr(args, "attention_mask", "causal"))
        # µP: q is multiplied so that the core's 1/sqrt(D) gives attn_mult / D (models/mup.py); None: off
        self.q_scale: Optional[float] = args.mup.attention_scale(self.head_dim) if args.mup.enable else None
        # QK-clip (optimizer.qk_clip_tau): when asked, the forward keeps the largest pre-softmax
        # logit of each (local) query head, a running max until the caller resets it.
        self.record_max_logit = False
        self.max_logit: Optional[Tensor] = None  # (nh,) fp32

    def init_weights(self, init: ParamInit, prefix: str, std: float, out_std: float) -> None:
        """wq/wk/wv: truncated normal (std, cut at 2 std); wo: depth-scaled ``out_std``; q/k norms: ones."""
        for proj in ("wq", "wk", "wv"):
            init.trunc_normal(f"{prefix}.{proj}.weight", getattr(self, proj).weight, std, 2.0)
        init.trunc_normal(f"{prefix}.wo.weight", self.wo.weight, out_std, 2.0)
        if self.q_norm is not None and self.k_norm is not None:
            self.q_norm.init_weights(init, f"{prefix}.q_norm")
            self.k_norm.init_weights(init, f"{prefix}.k_norm")

    def norm_qk(self, q: Tensor, k: Tensor) -> tuple[Tensor, Tensor]:
        """Per-head RMSNorm of q (B, S, nh, D) and k (B, S, nkv, D) before RoPE with ``qk_norm``
        (over the last dim, D), else the identity."""
        if self.q_norm is None or self.k_norm is None:
            return q, k
        return self.q_norm(q), self.k_norm(k)

    def forward(self, x: Tensor, *, rope_cache: Tensor, positions: Optional[Tensor] = None) -> Tensor:
        """``x`` (B, S, H); ``rope_cache`` (max_seq_len, D); ``positions`` (S,) or (B, S) or None (0..S-1)."""
        B, S, _ = x.shape  # (B, S, H)
        # Rows are picked here, where the whole (local) sequence is present: under sequence
        # parallelism the residual stream outside attention holds only S / tp tokens per rank.
        rope = rope_rows(rope_cache, S, positions)  # (S, D) or (B, S, D)
        q = self.wq(x).view(B, S, -1, self.head_dim)  # (B, S, nh, D)   nh: local query heads
        k = self.wk(x).view(B, S, -1, self.head_dim)  # (B, S, nkv, D)  nkv: local kv heads
        v = self.wv(x).view(B, S, -1, self.head_dim)  # (B, S, nkv, D)
        q, k = self.norm_qk(q, k)
        q, k = apply_rotary_emb(q, k, rope)
        if self.q_scale is not None:
            q = q * self.q_scale
        if self.record_max_logit:
            self._record_max_logit(q, k, positions)
        out = self.core(q, k, v, positions=positions)  # (B, S, nh, D)
        return self.wo(out.reshape(B, S, -1))  # (B, S, nh*D) -> (B, S, H)

    @torch.no_grad()
    def _record_max_logit(self, q: Tensor, k: Tensor, positions: Optional[Tensor]) -> None:
        """Per query head, the largest pre-softmax logit ``q.k / sqrt(D)`` over the pairs the mask
        allows (causal; block-causal within documents): one extra Q K^T (B, nh, S, S) in fp32."""
        B, S, nh, D = q.shape
        keys = repeat_kv(k.transpose(1, 2), nh // k.size(2)).float()  # (B, nh, S, D)
        scores = q.transpose(1, 2).float() @ keys.transpose(-1, -2) / math.sqrt(D)  # (B, nh, S, S)
        index = torch.arange(S, device=q.device)
        allowed = (index[None, :] <= index[:, None])[None]  # (1, S, S)
        if getattr(self.core, "attention_mask", "causal") == "block_causal" and positions is not None:
            doc = document_ids(index, positions.to(q.device)).expand(B, S)  # (B, S)
            allowed = allowed & (doc[:, :, None] == doc[:, None, :])  # (B, S, S)
        top = scores.masked_fill(~allowed[:, None], float("-inf")).amax(dim=(0, 2, 3))  # (nh,)
        self.max_logit = top if self.max_logit is None else torch.maximum(self.max_logit, top)


class FeedForward(nn.Module):
    """SwiGLU feed-forward: ``w2(silu(w1 x) * w3 x)``."""

    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def init_weights(self, init: ParamInit, prefix: str, std: float, out_std: float) -> None:
        """w1: truncated normal (std); w2/w3: depth-scaled ``out_std`` (torchtitan's scheme)."""
        init.trunc_normal(f"{prefix}.w1.weight", self.w1.weight, std, 2.0)
        init.trunc_normal(f"{prefix}.w2.weight", self.w2.weight, out_std, 2.0)
        init.trunc_normal(f"{prefix}.w3.weight", self.w3.weight, out_std, 2.0)

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))  # (B, S, H) -> (B, S, F) -> (B, S, H)


class TransformerBlock(nn.Module):
    """Pre-norm decoder block: ``h = x + attn(norm(x)); out = h + ffn(norm(h))``."""

    def __init__(self, layer_id: int, args: LlamaArgs) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.attention = Attention(args)
        self.feed_forward = FeedForward(args.dim, args.hidden_dim)
        self.attention_norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.ffn_norm = RMSNorm(args.dim, eps=args.norm_eps)

    def init_weights(self, init: ParamInit, prefix: str, init_std: float) -> None:
        """Output projections get ``init_std / sqrt(2 (layer_id + 1))`` (depth scaling); ``init_std`` is
        already µP's ``init_std / sqrt(m)`` when ``model.mup`` is on (``Transformer.init_weights``)."""
        out_std = init_std / math.sqrt(2 * (self.layer_id + 1))
        self.attention.init_weights(init, f"{prefix}.attention", init_std, out_std)
        self.feed_forward.init_weights(init, f"{prefix}.feed_forward", init_std, out_std)
        self.attention_norm.init_weights(init, f"{prefix}.attention_norm")
        self.ffn_norm.init_weights(init, f"{prefix}.ffn_norm")

    def forward(self, x: Tensor, *, rope_cache: Tensor, positions: Optional[Tensor] = None) -> Tensor:
        h = x + self.attention(
            self.attention_norm(x), rope_cache=rope_cache, positions=positions
        )  # (B, S, H)
        return h + self.feed_forward(self.ffn_norm(h))  # (B, S, H)


class Block(Protocol):
    """What ``Transformer`` calls on each of its blocks beyond ``forward`` (``build_block``'s modules)."""

    def init_weights(self, init: ParamInit, prefix: str, init_std: float) -> None: ...


class Transformer(nn.Module):
    """Llama decoder: embedding -> ``n_layers`` blocks -> RMSNorm -> vocabulary projection.

    Pipeline stages are this class with pieces removed: ``tok_embeddings``, ``norm`` and
    ``output`` may be set to None and entries of ``layers`` deleted (keys stay the global
    layer indices, e.g. ``{"2", "3"}``).
    """

    rope_cache: Tensor  # a non-persistent buffer (registered in __init__)

    def __init__(self, args: LlamaArgs) -> None:
        super().__init__()
        args.validate()
        self.args = args
        self.tok_embeddings: Optional[nn.Embedding] = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict({str(i): self.build_block(i, args) for i in range(args.n_layers)})
        self.norm: Optional[RMSNorm] = RMSNorm(args.dim, eps=args.norm_eps)
        self.output: Optional[nn.Linear] = OutputHead(args.dim, args.vocab_size, softcap=args.logit_softcap)
        self.tie_weights()
        self.share_attention_core()
        # Non-persistent: derived from args, never checkpointed. Allocated on the ambient device
        # (meta under `with torch.device("meta")`) and filled unless that device is meta.
        self.register_buffer("rope_cache", torch.empty(args.max_seq_len, args.head_dim), persistent=False)
        self.reset_rope_cache()

    def build_block(self, layer_id: int, args: Any) -> nn.Module:
        """One repeated block; families with other blocks (MoE) override this."""
        return TransformerBlock(layer_id, args)

    def share_attention_core(self) -> None:
        """Give every block's attention one shared core, so a per-batch mask is built once."""
        cores = [m for m in self.modules() if isinstance(m, Attention)]
        for attention in cores[1:]:
            attention.core = cores[0].core

    def tie_weights(self) -> None:
        """With ``tie_embeddings``, make ``output.weight`` the embedding's Parameter (if both exist)."""
        if self.args.tie_embeddings and self.tok_embeddings is not None and self.output is not None:
            if self.output.weight is not self.tok_embeddings.weight:
                self.output.weight = self.tok_embeddings.weight

    def _apply(self, fn: Callable[[Tensor], Tensor], recurse: bool = True) -> Transformer:
        # nn.Module._apply replaces each module's Parameter independently when it cannot swap
        # ``.data`` in place (e.g. ``to_empty`` / ``to`` between meta and a real device), which
        # silently unties the head from the embedding. Re-tie after every conversion.
        super()._apply(fn, recurse)
        self.tie_weights()
        return self

    def reset_rope_cache(self, device: Optional[Union[torch.device, str]] = None) -> None:
        """(Re)compute the rotary cache on ``device`` (default: where the buffer lives now).

        Needed after ``to_empty``: meta construction leaves buffers uninitialised. The values
        are computed on CPU and moved, so they are identical on every device.
        """
        device = torch.device(device) if device is not None else self.rope_cache.device
        a = self.args
        if device.type == "meta":
            cache = torch.empty((a.max_seq_len, a.head_dim), device=device)
        else:
            cache = precompute_rope_cache(a.head_dim, a.max_seq_len, a.rope_theta, a.rope_scaling).to(device)
        self.rope_cache = cache  # replaces the registered buffer (stays non-persistent)

    def forward(self, tokens: Tensor, positions: Optional[Tensor] = None) -> Tensor:
        """Token ids (B, S) -> logits (B, S, V).

        ``positions`` (S,) or (B, S) gives each token's position (a sequence shard, or packed
        documents restarting at 0); None means 0..S-1. Stage-friendly: with ``tok_embeddings``
        None the input is a hidden state (B, S, H); with ``output`` None the hidden state
        (B, S, H) is returned.
        """
        seq_len = tokens.shape[1]  # ids (B, S) or hidden state (B, S, H)
        if seq_len > self.args.max_seq_len:
            raise ConfigError(
                f"sequence length {seq_len} exceeds model.max_seq_len={self.args.max_seq_len}; "
                "raise model.max_seq_len or lower training.seq_len."
            )
        mup = self.args.mup
        if self.tok_embeddings is not None:
            h = self.tok_embeddings(tokens)  # (B, S, H)
            if mup.enable:
                h = h * mup.input_mult
        else:
            h = tokens
        # The whole cache is passed on: attention picks the rows of the sequence it sees,
        # which under sequence parallelism is larger than h's local S / tp.
        for layer in self.layers.values():
            h = layer(h, rope_cache=self.rope_cache, positions=positions)  # (B, S, H)
        h = self.norm(h) if self.norm is not None else h
        if self.output is None:
            return h  # (B, S, H)
        if head_deferred(self.output):  # the chunked loss runs the head (training.loss_chunk_size)
            if mup.enable:
                raise ConfigError(
                    "training.loss_chunk_size > 0 with model.mup.enable=true is not supported (the µP logit "
                    "scale follows the head); set training.loss_chunk_size=0 or model.mup.enable=false."
                )
            return h  # (B, S, H)
        logits = self.output(h)  # (B, S, V)
        return logits * mup.logit_scale(self.args.dim) if mup.enable else logits

    @torch.no_grad()
    def init_weights(
        self, seed: int = 0, copy_fn: Optional[CopyFn] = None, *, init: Optional[ParamInit] = None
    ) -> None:
        """Initialise every present parameter deterministically from ``(seed, name)``.

        ``init`` (default ``ParamInit(seed, copy_fn)``) writes each parameter through its
        ``copy_fn``; a sharded caller passes one that writes its shard. Scheme (torchtitan-like):
        embedding N(0, 1); wq/wk/wv/w1 truncated normal (std=init_std, cut at 2 std); wo/w2/w3
        depth-scaled std=init_std/sqrt(2*(layer_id+1)); output truncated normal (std=dim**-0.5,
        cut at 3 std); norms ones. Under ``model.mup`` the block stds are divided by sqrt(dim/base_dim)
        and the output's is base_dim**-0.5 (``models/mup.py``). With ``tie_embeddings`` the shared
        weight is drawn once, under
        the name ``tok_embeddings.weight``, with the output-head scheme: an N(0, 1) matrix used
        as the head would give logits of std sqrt(dim) at step 0.

        Also recomputes the rotary cache, on the buffer's device (the parameters' device when
        the buffer is still on meta).
        """
        init = init if init is not None else ParamInit(seed, copy_fn)
        args = self.args
        head_std = args.dim**-0.5
        block_std = args.init_std
        if args.mup.enable:  # models/mup.py: the base model's head, hidden variance 1/fan_in
            head_std = args.mup.base_dim**-0.5
            block_std = args.init_std / math.sqrt(args.mup.width_mult(args.dim))

        def embed_fill(name: str, param: Tensor) -> None:
            if args.tie_embeddings:
                init.trunc_normal(name, param, head_std, 3.0)
            else:
                init.normal(name, param, 1.0)

        if self.tok_embeddings is not None:
            embed_fill("tok_embeddings.weight", self.tok_embeddings.weight)
        for layer_id, block in self.layers.items():
            cast(Block, block).init_weights(init, f"layers.{layer_id}", block_std)
        if self.norm is not None:
            self.norm.init_weights(init, "norm")
        if self.output is not None:
            if not args.tie_embeddings:
                init.trunc_normal("output.weight", self.output.weight, head_std, 3.0)
            elif self.tok_embeddings is None:
                # Tied, but this piece (e.g. the last pipeline stage) holds only the head: draw
                # the same values the embedding gets in the full model.
                embed_fill("tok_embeddings.weight", self.output.weight)

        # The buffer's device wins (after to_empty it is the compute device, also when FSDP
        # offloads parameters to CPU); a buffer still on meta follows the parameters.
        device = self.rope_cache.device
        if device.type == "meta":
            param = next(iter(self.parameters()), None)
            device = param.device if param is not None else device
        self.reset_rope_cache(device)


# --------------------------------------------------------------------------------------------
# Counting
# --------------------------------------------------------------------------------------------


def _attention_params(args: LlamaArgs) -> int:
    """wq/wk/wv/wo, plus the two per-head gains (head_dim each) with ``qk_norm``."""
    projections = 2 * args.dim * args.n_heads * args.head_dim + 2 * args.dim * args.kv_heads * args.head_dim
    return projections + (2 * args.head_dim if args.qk_norm else 0)


def param_counts(args: LlamaArgs) -> ParamCounts:
    """Parameters of ``Transformer(args)``, computed analytically (tied head counted once).

    Dense, so ``active == total``.
    """
    layer = _attention_params(args) + 3 * args.dim * args.hidden_dim + 2 * args.dim
    embedding = args.vocab_size * args.dim
    head = 0 if args.tie_embeddings else args.vocab_size * args.dim
    total = embedding + args.n_layers * layer + args.dim + head
    return ParamCounts(total=total, active=total, embedding=embedding)


def num_flops_per_token(args: LlamaArgs, seq_len: int, counts: Optional[ParamCounts] = None) -> int:
    """Training FLOPs (forward + backward) per token, torchtitan / PaLM convention.

    ``6 * N + 12 * n_layers * n_heads * head_dim * seq_len`` where ``N`` is every *active*
    parameter except the token embedding (a lookup, not a matmul); the output head is a matmul
    and counts, once, also when tied to the embedding. The second term is the attention
    score and value matmuls (2 * 2 * L * H * S forward, times 3 with backward); causal masking
    is not discounted. Shared by every family with Llama attention (pass ``counts``).
    """
    counts = counts if counts is not None else param_counts(args)
    tied_head = args.vocab_size * args.dim if args.tie_embeddings else 0
    n_matmul = counts.active - counts.embedding + tied_head
    attention = 12 * args.n_layers * args.n_heads * args.head_dim * seq_len
    return 6 * n_matmul + attention


def lr_scale(model_args: ModelArgs) -> Optional[Callable[[str, int], float]]:
    """µP's per-parameter factor of ``optimizer.lr`` (``ModelSpec.lr_scale``): ``base_dim / dim`` for the
    blocks' matrices, 1 for the embedding, the head and every vector; None without ``model.mup``."""
    args = cast(LlamaArgs, model_args)
    if not args.mup.enable:
        return None
    hidden = args.mup.hidden_lr_scale(args.dim)

    def scale(name: str, ndim: int) -> float:
        return hidden if name.startswith("layers.") and ndim >= 2 else 1.0

    return scale


def ties_embeddings(args: LlamaArgs) -> bool:
    """Whether the output head shares the token embedding's weight (``ModelSpec.ties_embeddings``)."""
    return args.tie_embeddings


def attention_mask(args: LlamaArgs) -> str:
    """The attention mask kind, causal or block_causal (``ModelSpec.attention_mask``)."""
    return args.attention_mask


def qk_norm(args: LlamaArgs) -> bool:
    """Whether the attention normalises each q and k head before RoPE (``ModelSpec.qk_norm``)."""
    return args.qk_norm


# --------------------------------------------------------------------------------------------
# The planner's terms (``ModelSpec.planner_terms``)
# --------------------------------------------------------------------------------------------


def attention_saved(args: LlamaArgs, layout: BlockLayout) -> dict[str, float]:
    """What ``Attention`` and ``models/attention.py``'s core save for backward per local token, after
    the input norm: q after RoPE; K and V after the grouped-query repeat (a copy to n_heads, or a free
    view when one KV head is local; none when the kernel takes grouped heads: ``layout.grouped_kv``),
    gathered over the whole sequence under CP (all-gather implementation); SDPA's fp32 log-sum-exp
    per head; its output (also the input of ``wo``). With ``qk_norm`` (Qwen3), the per-head RMSNorms'
    (before RoPE, on the local heads and tokens) fp32 input (the projection's output itself when
    fp32), rsqrt per head, and normalised head saved by the gain multiply (compute dtype)."""
    D, cb = args.head_dim, layout.compute
    nh, nkv = args.n_heads / layout.tp, args.kv_heads / layout.tp
    kv_width = nkv * D if (nh == nkv or layout.grouped_kv) else (D if nkv == 1 else nh * D)
    terms = {
        "q": cb * nh * D,
        "kv": 2 * cb * kv_width * layout.cp,
        "attention_lse": 4 * nh,
        "attention_out": cb * nh * D,
    }
    if args.qk_norm:
        terms["qk_norm"] = (nh + nkv) * ((4 + cb) * D + 4)
    return terms


def ffn_saved(args: LlamaArgs, layout: BlockLayout, moe: bool = False) -> dict[str, float]:
    """SwiGLU (``FeedForward``), after its norm: w1 and w3 outputs, silu(w1 x) and their product (the
    input of w2), all hidden/tp wide. A dense family has no MoE block (``moe`` is never set)."""
    return {"mlp": 4 * layout.compute * args.hidden_dim / layout.tp}


def planner_terms(args: LlamaArgs) -> PlannerTerms:
    """The planner's view of Llama blocks (also Qwen3's and the MoE family's attention): CP gathers K
    and V of the kv heads."""
    return PlannerTerms(
        comm=AttentionComm(cp_gather_dim=2 * args.kv_heads * args.head_dim),
        shape=AttentionShape(args.n_heads, args.kv_heads, args.head_dim, qk_norm=args.qk_norm),
        rope_dim=args.head_dim,
        ffn_hidden_dim=args.hidden_dim,
        attention_saved=functools.partial(attention_saved, args),
        ffn_saved=functools.partial(ffn_saved, args),
    )


def tp_divisible(args: LlamaArgs) -> dict[str, int]:
    """Sizes tensor parallelism splits evenly (key -> value)."""
    return {
        "model.n_heads": args.n_heads,
        "model.n_kv_heads": args.kv_heads,
        "model FFN hidden size": args.hidden_dim,
        "model.vocab_size": args.vocab_size,
    }


# Module-name pattern -> abstract TP style (turned into torch ParallelStyles by
# parallelisms/tensor_parallel.py). "*" matches a block key. The attention and FFN entries
# gather the (sequence-sharded) residual stream on entry; wo/w2 reduce it back (Megatron f/g).
TP_PLAN: dict[str, str] = {
    "tok_embeddings": "embedding",
    "layers.*.attention_norm": "norm",
    "layers.*.attention": "gather_input",
    "layers.*.attention.wq": "colwise",
    "layers.*.attention.wk": "colwise",
    "layers.*.attention.wv": "colwise",
    "layers.*.attention.wo": "rowwise",
    "layers.*.attention.q_norm": "head_norm",  # with qk_norm: this rank's heads, gain replicated
    "layers.*.attention.k_norm": "head_norm",
    "layers.*.ffn_norm": "norm",
    "layers.*.feed_forward": "gather_input",
    "layers.*.feed_forward.w1": "colwise",
    "layers.*.feed_forward.w3": "colwise",
    "layers.*.feed_forward.w2": "rowwise",
    "norm": "norm",
    "output": "head",
}
