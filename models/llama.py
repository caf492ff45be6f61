"""Dense Llama-style decoder (Llama 2 / Llama 3 shapes), free of any parallelism.

The module tree and parameter names match torchtitan's Llama 3 model, so tensor-parallel plans
(keyed by module name) and Hugging Face conversion can rely on them::

    tok_embeddings.weight
    layers.{i}.attention.{wq,wk,wv,wo}.weight
    layers.{i}.feed_forward.{w1,w2,w3}.weight
    layers.{i}.{attention_norm,ffn_norm}.weight
    norm.weight
    output.weight

Three properties let the parallelism code in ``parallelisms/`` work without touching this file:

* ``Attention`` derives the number of heads from tensor shapes at runtime, so column-sharded
  ``wq/wk/wv`` (tensor parallel) simply yield fewer local heads. It also slices the rotary
  cache to the sequence length it sees, so a sequence-sharded residual stream (sequence
  parallel) still gets the rotations of the full sequence.
* ``Transformer.forward`` tolerates a missing ``tok_embeddings`` / ``norm`` / ``output`` and
  deleted entries of the ``layers`` ``ModuleDict``, so a pipeline stage is this same class
  with pieces removed.
* ``Transformer.init_weights`` draws every parameter from its own generator seeded by
  ``(seed, canonical name)`` and writes it through a caller-supplied ``copy_fn``, so a model
  built on the meta device, sharded and materialised anywhere gets bit-identical weights to a
  one-process CPU build.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Optional, Union

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from models.errors import ConfigError

__all__ = [
    "LlamaArgs",
    "RMSNorm",
    "Attention",
    "FeedForward",
    "TransformerBlock",
    "Transformer",
    "apply_rotary_emb",
    "precompute_rope_cache",
    "num_params",
    "num_flops_per_token",
    "param_count",
]

CopyFn = Callable[[nn.Parameter, Tensor], None]


# --------------------------------------------------------------------------------------------
# Arguments
# --------------------------------------------------------------------------------------------


@dataclass
class LlamaArgs:
    """Shape and initialisation hyper-parameters of a dense Llama model."""

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
    max_seq_len: int = 2048
    tie_embeddings: bool = False
    init_std: float = 0.02

    def validate(self) -> None:
        """Raise ``ConfigError`` naming the bad value and the fix; return None when consistent."""
        for name in ("dim", "n_layers", "n_heads", "vocab_size", "multiple_of", "max_seq_len"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ConfigError(f"model.{name}={value!r} must be a positive integer.")
        for name in ("n_kv_heads", "ffn_hidden_dim"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
                raise ConfigError(f"model.{name}={value!r} must be a positive integer or null (default).")
        if self.ffn_dim_multiplier is not None and not self.ffn_dim_multiplier > 0:
            raise ConfigError(
                f"model.ffn_dim_multiplier={self.ffn_dim_multiplier!r} must be > 0 or null (no multiplier)."
            )
        for name in ("norm_eps", "rope_theta", "init_std"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and value > 0):
                raise ConfigError(f"model.{name}={value!r} must be a positive number.")
        if self.dim % self.n_heads != 0:
            raise ConfigError(
                f"model.dim={self.dim} is not divisible by model.n_heads={self.n_heads}; "
                f"choose dim as a multiple of n_heads (e.g. dim={self.n_heads * max(1, round(self.dim / self.n_heads))})."
            )
        if self.head_dim % 2 != 0:
            raise ConfigError(
                f"head_dim = model.dim / model.n_heads = {self.dim}/{self.n_heads} = {self.head_dim} is odd; "
                "rotary embeddings need an even head_dim: change dim or n_heads."
            )
        if self.n_heads % self.kv_heads != 0:
            raise ConfigError(
                f"model.n_heads={self.n_heads} is not divisible by model.n_kv_heads={self.kv_heads}; "
                "grouped-query attention needs n_kv_heads to divide n_heads (or n_kv_heads=null for n_heads)."
            )

    @property
    def head_dim(self) -> int:
        """Size of one attention head: dim // n_heads."""
        return self.dim // self.n_heads

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


# --------------------------------------------------------------------------------------------
# Rotary position embedding
# --------------------------------------------------------------------------------------------
#
# Layout: Hugging Face "rotate_half". A head vector x of size D is split into halves
# x1 = x[..., :D/2] and x2 = x[..., D/2:]; frequency i in [0, D/2) rotates the pair
# (x1[i], x2[i]) by the angle pos * theta^(-2i/D):
#     out1 = x1 * cos - x2 * sin
#     out2 = x2 * cos + x1 * sin
# which equals HF's ``x * cat(cos, cos) + rotate_half(x) * cat(sin, sin)``. Because it is the
# same layout as HF Llama checkpoints, export/import need no permutation of wq/wk rows (Meta's
# original checkpoints interleave pairs instead and would need one).
#
# The cache is one real float32 tensor of shape (max_seq_len, D) holding
# [cos(angles) | sin(angles)], each (max_seq_len, D/2). Real, not complex: complex tensors
# interact badly with DTensor and torch.compile. One tensor sharded along dim 0 is all that
# context parallelism needs to split it by sequence.


def precompute_rope_cache(head_dim: int, max_seq_len: int, theta: float = 10000.0) -> Tensor:
    """The (max_seq_len, head_dim) float32 rotary cache ``[cos | sin]`` computed on CPU.

    Angles are computed in float64 and rounded once, so the cache is identical on every device
    and accurate at long positions.
    """
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))  # (D/2,)
    positions = torch.arange(max_seq_len, dtype=torch.float64)  # (S,)
    angles = torch.outer(positions, inv_freq)  # (S, D/2)
    return torch.cat([angles.cos(), angles.sin()], dim=-1).to(torch.float32)  # (S, D)


def apply_rotary_emb(xq: Tensor, xk: Tensor, rope_cache: Tensor) -> tuple[Tensor, Tensor]:
    """Rotate queries and keys (B, S, n_heads, D) by the rotate_half layout; computed in fp32.

    ``rope_cache`` is (S, D) as produced by ``precompute_rope_cache`` and already sliced to S.
    """
    cos, sin = rope_cache.chunk(2, dim=-1)  # (S, D/2) each
    cos = cos[None, :, None, :]  # (1, S, 1, D/2), broadcasts over batch and heads
    sin = sin[None, :, None, :]

    def rotate(x: Tensor) -> Tensor:
        x1, x2 = x.float().chunk(2, dim=-1)  # (B, S, nh, D/2) each
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).type_as(x)  # (B, S, nh, D)

    return rotate(xq), rotate(xk)


def repeat_kv(x: Tensor, n_rep: int) -> Tensor:
    """Repeat each key/value head ``n_rep`` times along dim 1: (B, n_kv, S, D) -> (B, n_kv*n_rep, S, D).

    Same order as ``torch.repeat_interleave(x, n_rep, dim=1)``: query head j uses kv head
    j // n_rep, which stays true for any contiguous (tensor-parallel) slice of the heads.
    """
    if n_rep == 1:
        return x
    B, n_kv, S, D = x.shape
    return x[:, :, None, :, :].expand(B, n_kv, n_rep, S, D).reshape(B, n_kv * n_rep, S, D)


# --------------------------------------------------------------------------------------------
# Modules
# --------------------------------------------------------------------------------------------


class RMSNorm(nn.Module):
    """Root-mean-square layer norm (Zhang & Sennrich, 2019), normalised in fp32.

    Parameter and attribute names follow ``torch.nn.RMSNorm`` (``weight``, ``eps``).
    """

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.normalized_shape = (dim,)
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def reset_parameters(self) -> None:
        """Set the gain to ones."""
        nn.init.ones_(self.weight)

    def forward(self, x: Tensor) -> Tensor:
        # fp32 statistics: in bf16 the mean of squares over thousands of channels loses digits.
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)  # (..., H)
        return normed.type_as(x) * self.weight

    def extra_repr(self) -> str:
        return f"{self.normalized_shape}, eps={self.eps}"


class Attention(nn.Module):
    """Causal multi-head attention with rotary embeddings and grouped-query attention.

    Head counts are not stored: they are read from tensor shapes in ``forward``, so that
    tensor parallelism (which shards ``wq/wk/wv`` by output features and ``wo`` by input
    features) needs no change here.
    """

    def __init__(self, args: LlamaArgs) -> None:
        super().__init__()
        self.head_dim = args.head_dim
        self.wq = nn.Linear(args.dim, args.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * self.head_dim, args.dim, bias=False)

    def forward(self, x: Tensor, rope_cache: Tensor) -> Tensor:
        """``x`` (B, S, H); ``rope_cache`` (>= S, D), the first S rows are used."""
        B, S, _ = x.shape  # (B, S, H)
        # Sliced here, where the whole sequence is present: under sequence parallelism the
        # residual stream outside attention holds only S / tp tokens per rank.
        rope_cache = rope_cache[:S]  # (S, D)
        q = self.wq(x).view(B, S, -1, self.head_dim)  # (B, S, nh, D)   nh: local query heads
        k = self.wk(x).view(B, S, -1, self.head_dim)  # (B, S, nkv, D)  nkv: local kv heads
        v = self.wv(x).view(B, S, -1, self.head_dim)  # (B, S, nkv, D)
        q, k = apply_rotary_emb(q, k, rope_cache)

        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, heads, S, D)
        # Explicit repeat rather than SDPA's enable_gqa: works with every backend, under
        # torch.compile, and for whatever local head counts tensor parallelism leaves.
        n_rep = q.size(1) // k.size(1)
        k = repeat_kv(k, n_rep)  # (B, nh, S, D)
        v = repeat_kv(v, n_rep)  # (B, nh, S, D)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, nh, S, D)
        out = out.transpose(1, 2).reshape(B, S, -1)  # (B, S, nh*D)
        return self.wo(out)  # (B, S, H)


class FeedForward(nn.Module):
    """SwiGLU feed-forward: ``w2(silu(w1 x) * w3 x)``."""

    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

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

    def forward(self, x: Tensor, rope_cache: Tensor) -> Tensor:
        h = x + self.attention(self.attention_norm(x), rope_cache)  # (B, S, H)
        return h + self.feed_forward(self.ffn_norm(h))  # (B, S, H)


class Transformer(nn.Module):
    """Llama decoder: embedding -> ``n_layers`` blocks -> RMSNorm -> vocabulary projection.

    Pipeline stages are this class with pieces removed: ``tok_embeddings``, ``norm`` and
    ``output`` may be set to None and entries of ``layers`` deleted (keys stay the global
    layer indices, e.g. ``{"2", "3"}``).
    """

    def __init__(self, args: LlamaArgs) -> None:
        super().__init__()
        args.validate()
        self.args = args
        self.tok_embeddings: Optional[nn.Embedding] = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(i, args) for i in range(args.n_layers)})
        self.norm: Optional[RMSNorm] = RMSNorm(args.dim, eps=args.norm_eps)
        self.output: Optional[nn.Linear] = nn.Linear(args.dim, args.vocab_size, bias=False)
        self.tie_weights()
        # Non-persistent: derived from args, never checkpointed. Allocated on the ambient device
        # (meta under `with torch.device("meta")`) and filled unless that device is meta.
        self.register_buffer("rope_cache", torch.empty(args.max_seq_len, args.head_dim), persistent=False)
        self.reset_rope_cache()

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
        shape = (self.args.max_seq_len, self.args.head_dim)
        if device.type == "meta":
            cache = torch.empty(shape, device=device)
        else:
            cache = precompute_rope_cache(self.args.head_dim, self.args.max_seq_len, self.args.rope_theta)
            cache = cache.to(device)
        self.rope_cache = cache  # replaces the registered buffer (stays non-persistent)

    def forward(self, tokens: Tensor) -> Tensor:
        """Token ids (B, S) -> logits (B, S, V).

        Stage-friendly: with ``tok_embeddings`` None the input is a hidden state (B, S, H);
        with ``output`` None the hidden state (B, S, H) is returned.
        """
        seq_len = tokens.shape[1]  # ids (B, S) or hidden state (B, S, H)
        if seq_len > self.args.max_seq_len:
            raise ConfigError(
                f"sequence length {seq_len} exceeds model.max_seq_len={self.args.max_seq_len}; "
                "raise model.max_seq_len or lower training.seq_len."
            )
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens  # (B, S, H)
        # The whole cache is passed on: attention slices it to the sequence length it sees,
        # which under sequence parallelism is larger than h's local S / tp.
        for layer in self.layers.values():
            h = layer(h, self.rope_cache)  # (B, S, H)
        h = self.norm(h) if self.norm is not None else h
        return self.output(h) if self.output is not None else h  # (B, S, V) or (B, S, H)

    @torch.no_grad()
    def init_weights(self, seed: int = 0, copy_fn: Optional[CopyFn] = None) -> None:
        """Initialise every present parameter deterministically from ``(seed, name)``.

        Each parameter gets its own CPU generator seeded by ``seed`` mixed with the CRC32 of its
        canonical name, draws its FULL tensor in float32 on CPU, and is written with
        ``copy_fn(param, full)`` (default: ``param.copy_(full.to(param.device, param.dtype))``).
        Hence the values do not depend on the device, on which other parameters exist (pipeline
        stages) nor on wrappers; a sharded caller passes a ``copy_fn`` that writes its shard.
        ``param`` itself is only ever touched through ``copy_fn``.

        Scheme (torchtitan-like): embedding N(0, 1); wq/wk/wv/w1 truncated normal
        (std=init_std, cut at 2 std); wo/w2/w3 truncated normal with depth-scaled
        std=init_std/sqrt(2*(layer_id+1)); output truncated normal (std=dim**-0.5, cut at 3 std);
        norms ones. With ``tie_embeddings`` the shared weight is drawn once, under the name
        ``tok_embeddings.weight``, with the output-head scheme: an N(0, 1) matrix used as the
        head would give logits of std sqrt(dim) at step 0.

        Also recomputes the rotary cache, on the buffer's device (the parameters' device when
        the buffer is still on meta).
        """
        copy_fn = copy_fn if copy_fn is not None else _default_copy
        args = self.args
        std = args.init_std
        head_std = args.dim**-0.5

        def init(name: str, param: nn.Parameter, fill: Callable[[Tensor, torch.Generator], None]) -> None:
            gen = torch.Generator(device="cpu").manual_seed(_param_seed(seed, name))
            full = torch.empty(param.shape, dtype=torch.float32, device="cpu")
            fill(full, gen)
            copy_fn(param, full)

        def normal(s: float) -> Callable[[Tensor, torch.Generator], None]:
            return lambda t, g: nn.init.normal_(t, mean=0.0, std=s, generator=g)

        def trunc(s: float, cutoff: float) -> Callable[[Tensor, torch.Generator], None]:
            return lambda t, g: nn.init.trunc_normal_(
                t, mean=0.0, std=s, a=-cutoff * s, b=cutoff * s, generator=g
            )

        def ones(t: Tensor, g: torch.Generator) -> None:
            t.fill_(1.0)

        embed_fill = trunc(head_std, 3.0) if args.tie_embeddings else normal(1.0)
        if self.tok_embeddings is not None:
            init("tok_embeddings.weight", self.tok_embeddings.weight, embed_fill)

        for layer_id, block in self.layers.items():
            prefix = f"layers.{layer_id}"
            out_std = std / math.sqrt(2 * (int(layer_id) + 1))
            attn, ffn = block.attention, block.feed_forward
            for proj in ("wq", "wk", "wv"):
                init(f"{prefix}.attention.{proj}.weight", getattr(attn, proj).weight, trunc(std, 2.0))
            init(f"{prefix}.attention.wo.weight", attn.wo.weight, trunc(out_std, 2.0))
            init(f"{prefix}.feed_forward.w1.weight", ffn.w1.weight, trunc(std, 2.0))
            init(f"{prefix}.feed_forward.w2.weight", ffn.w2.weight, trunc(out_std, 2.0))
            init(f"{prefix}.feed_forward.w3.weight", ffn.w3.weight, trunc(out_std, 2.0))
            init(f"{prefix}.attention_norm.weight", block.attention_norm.weight, ones)
            init(f"{prefix}.ffn_norm.weight", block.ffn_norm.weight, ones)

        if self.norm is not None:
            init("norm.weight", self.norm.weight, ones)

        if self.output is not None:
            if not args.tie_embeddings:
                init("output.weight", self.output.weight, trunc(head_std, 3.0))
            elif self.tok_embeddings is None:
                # Tied, but this piece (e.g. the last pipeline stage) holds only the head: draw
                # the same values the embedding gets in the full model.
                init("tok_embeddings.weight", self.output.weight, embed_fill)

        # The buffer's device wins (after to_empty it is the compute device, also when FSDP
        # offloads parameters to CPU); a buffer still on meta follows the parameters.
        device = self.rope_cache.device
        if device.type == "meta":
            param = next(iter(self.parameters()), None)
            device = param.device if param is not None else device
        self.reset_rope_cache(device)


def _param_seed(seed: int, name: str) -> int:
    """Generator seed for one parameter: CRC32 of ``name`` xor a multiplicative hash of ``seed``.

    Kept in 32 bits on purpose: the CPU generator seeds its Mersenne Twister from the low 32
    bits only, so ``seed`` must change those bits. Multiplying by an odd constant is a bijection
    modulo 2**32, so two seeds below 2**32 never give one parameter the same stream.
    """
    return (zlib.crc32(name.encode("utf-8")) ^ (seed * 0x9E3779B1)) & 0xFFFFFFFF


def _default_copy(param: nn.Parameter, full: Tensor) -> None:
    param.copy_(full.to(param.device, param.dtype))


# --------------------------------------------------------------------------------------------
# Counting
# --------------------------------------------------------------------------------------------


def num_params(model: nn.Module, exclude_embedding: bool = False) -> int:
    """Number of unique parameters of ``model`` (tied weights count once; works on meta).

    With ``exclude_embedding`` the weights of every ``nn.Embedding`` are left out (with tied
    embeddings that includes the shared output head).
    """
    params = {id(p): p for p in model.parameters()}
    if exclude_embedding:
        for module in model.modules():
            if isinstance(module, nn.Embedding):
                for p in module.parameters():
                    params.pop(id(p), None)
    return sum(p.numel() for p in params.values())


def _layer_param_count(args: LlamaArgs) -> int:
    attention = 2 * args.dim * args.n_heads * args.head_dim + 2 * args.dim * args.kv_heads * args.head_dim
    feed_forward = 3 * args.dim * args.hidden_dim
    norms = 2 * args.dim
    return attention + feed_forward + norms


def param_count(args: LlamaArgs) -> int:
    """Total parameters of ``Transformer(args)``, computed analytically (tied head counted once)."""
    embedding = args.vocab_size * args.dim
    head = 0 if args.tie_embeddings else args.vocab_size * args.dim
    return embedding + args.n_layers * _layer_param_count(args) + args.dim + head


def num_flops_per_token(args: LlamaArgs, seq_len: int) -> int:
    """Training FLOPs (forward + backward) per token, torchtitan / PaLM convention.

    ``6 * N + 12 * n_layers * n_heads * head_dim * seq_len`` where ``N`` is every parameter
    except the token embedding (a lookup, not a matmul); the output head is a matmul and
    counts, once, also when tied to the embedding. The second term is the attention
    score and value matmuls (2 * 2 * L * H * S forward, times 3 with backward); causal masking
    is not discounted. ``N`` is computed from ``args``; no model is needed.
    """
    n_nonembedding = args.n_layers * _layer_param_count(args) + args.dim + args.vocab_size * args.dim
    attention = 12 * args.n_layers * args.n_heads * args.head_dim * seq_len
    return 6 * n_nonembedding + attention
