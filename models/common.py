"""Building blocks shared by every model family: norms, rotary embeddings, GQA and the
deterministic seed-by-name initialisation. Free of any parallelism.

Rotary embeddings use the Hugging Face "rotate_half" layout. A head vector x of size D is
split into halves x1 = x[..., :D/2] and x2 = x[..., D/2:]; frequency i in [0, D/2) rotates the
pair (x1[i], x2[i]) by the angle pos * inv_freq[i]:

    out1 = x1 * cos - x2 * sin
    out2 = x2 * cos + x1 * sin

which equals HF's ``x * cat(cos, cos) + rotate_half(x) * cat(sin, sin)``, so Hugging Face
checkpoints need no permutation of wq/wk rows. The cache is one real float32 tensor of shape
(max_seq_len, D) holding [cos | sin]; the model indexes it with each token's *position*
(``positions``), so a sequence shard (context parallel) or a packed document gets its true
rotation.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor, nn

from models.cpu_gemm import linear
from models.errors import ConfigError

__all__ = [
    "IGNORE_INDEX",
    "CopyFn",
    "OutputHead",
    "ParamInit",
    "RMSNorm",
    "WRAPPER_PREFIXES",
    "RopeScaling",
    "apply_rotary_emb",
    "num_params",
    "precompute_rope_cache",
    "repeat_kv",
    "rope_attention_factor",
    "rope_inv_freq",
    "unwrapped_name",
    "yarn_mscale",
    "yarn_softmax_scale",
]

# Label value the loss skips (padding, document ends without a successor). The one definition.
IGNORE_INDEX = -100

CopyFn = Callable[[Tensor, Tensor], None]

# The name components that wrapping a block adds to its parameters' names: torch.compile's
# ``OptimizedModule`` (``_orig_mod``) and activation checkpointing's ``CheckpointWrapper``
# (``_checkpoint_wrapped_module``). The one definition: it lives in models/, the lowest layer,
# because the model (MoE layer names), parallelisms, the trainer (optimizer and HF names) and the
# tests all need a parameter's name as the model itself spells it. FSDP2 adds no component, and
# DDP's ``module.`` never reaches these readers (``parallelisms.parallelize.model_parts`` strips it).
WRAPPER_PREFIXES: tuple[str, ...] = ("_checkpoint_wrapped_module.", "_orig_mod.")


def unwrapped_name(name: str) -> str:
    """A parameter's, buffer's or module's name as the model names it: without the compile and
    activation-checkpoint wrapper components (``WRAPPER_PREFIXES``), wherever they occur."""
    for prefix in WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


# --------------------------------------------------------------------------------------------
# Rotary position embedding
# --------------------------------------------------------------------------------------------

ROPE_TYPES = ("default", "linear", "llama3", "yarn")


@dataclass
class RopeScaling:
    """Long-context rescaling of the rotary frequencies (``model.rope_scaling``).

    ``default``: none. ``linear``: every frequency divided by ``factor`` (position
    interpolation). ``llama3``: Llama 3.1's piecewise rule -- wavelengths shorter than
    ``original_max_seq_len / high_freq_factor`` are kept, those longer than
    ``original_max_seq_len / low_freq_factor`` are divided by ``factor``, and the band in
    between is interpolated smoothly. ``yarn`` (DeepSeek-V3, Kimi K2; Peng et al. 2023): the
    dimensions that turn fewer than ``beta_slow`` times over ``original_max_seq_len`` are divided
    by ``factor``, those that turn more than ``beta_fast`` times are kept, with a linear ramp
    between; cos and sin are multiplied by ``attention_factor`` (derived, as in transformers, from
    ``mscale`` / ``mscale_all_dim`` when 0), and ``mscale_all_dim`` also rescales the softmax of
    MLA attention (``yarn_softmax_scale``).
    """

    type: str = "default"  # default | linear | llama3
    factor: float = 1.0
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    original_max_seq_len: int = 8192  # llama3 / yarn: the pre-training context
    beta_fast: float = 32.0  # yarn: rotations above which a dimension is kept (extrapolated)
    beta_slow: float = 1.0  # yarn: rotations below which a dimension is interpolated (/ factor)
    mscale: float = 0.0  # yarn: numerator of the cos/sin scale (0 = absent, as in HF)
    mscale_all_dim: float = 0.0  # yarn: denominator of the cos/sin scale and MLA's softmax scale (0 = absent)
    attention_factor: float = 0.0  # yarn: explicit cos/sin scale (0 = derived from factor and mscale)

    def validate(self) -> None:
        """Raise ``ConfigError`` naming the bad value and the fix."""
        if self.type not in ROPE_TYPES:
            raise ConfigError(
                f"model.rope_scaling.type={self.type!r} is not one of {list(ROPE_TYPES)}; pick one of them."
            )
        if self.type == "default":
            return
        if not self.factor > 0:
            raise ConfigError(f"model.rope_scaling.factor={self.factor} must be > 0.")
        if self.type == "yarn":
            if not (self.beta_slow > 0 and self.beta_fast > 0):
                raise ConfigError(
                    f"model.rope_scaling: beta_fast={self.beta_fast} and beta_slow={self.beta_slow} must be "
                    "> 0."
                )
            for name in ("mscale", "mscale_all_dim", "attention_factor"):
                if getattr(self, name) < 0:
                    raise ConfigError(
                        f"model.rope_scaling.{name}={getattr(self, name)} must be >= 0 (0 = absent)."
                    )
        if self.type in ("llama3", "yarn") and self.original_max_seq_len <= 0:
            raise ConfigError(
                f"model.rope_scaling.original_max_seq_len={self.original_max_seq_len} must be positive."
            )
        if self.type == "llama3":
            if not 0 < self.low_freq_factor < self.high_freq_factor:
                raise ConfigError(
                    f"model.rope_scaling: low_freq_factor={self.low_freq_factor} must be > 0 and below "
                    f"high_freq_factor={self.high_freq_factor}."
                )
            if self.original_max_seq_len <= 0:
                raise ConfigError(
                    f"model.rope_scaling.original_max_seq_len={self.original_max_seq_len} must be positive."
                )


def rope_inv_freq(head_dim: int, theta: float, scaling: Optional[RopeScaling] = None) -> Tensor:
    """Inverse frequencies (D/2,) in float64, rescaled per ``scaling``."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))  # (D/2,)
    if scaling is None or scaling.type == "default":
        return inv_freq
    if scaling.type == "linear":
        return inv_freq / scaling.factor
    if scaling.type == "yarn":
        return _yarn_inv_freq(inv_freq, head_dim, theta, scaling)
    # llama3: keep high frequencies, divide low ones by factor, interpolate the band between.
    low_wavelen = scaling.original_max_seq_len / scaling.low_freq_factor
    high_wavelen = scaling.original_max_seq_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (scaling.original_max_seq_len / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    blended = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, blended, scaled)


def _yarn_inv_freq(inv_freq: Tensor, head_dim: int, theta: float, scaling: RopeScaling) -> Tensor:
    """YaRN's blend of extrapolated (kept) and interpolated (/ factor) frequencies; the correction
    range is truncated to whole dimensions, as in transformers and DeepSeek's reference code."""

    def correction_dim(rotations: float) -> float:
        return (
            head_dim
            * math.log(scaling.original_max_seq_len / (rotations * 2 * math.pi))
            / (2 * math.log(theta))
        )

    low = max(math.floor(correction_dim(scaling.beta_fast)), 0)
    high: float = min(math.ceil(correction_dim(scaling.beta_slow)), head_dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)  # (D/2,)
    keep = 1 - ramp  # 1: extrapolate (high frequency), 0: interpolate
    return inv_freq / scaling.factor * (1 - keep) + inv_freq * keep


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention-temperature correction ``0.1 * mscale * ln(factor) + 1`` (1 for factor <= 1)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def rope_attention_factor(scaling: Optional[RopeScaling]) -> float:
    """The factor YaRN multiplies cos and sin by (1 for every other RoPE), transformers' rule."""
    if scaling is None or scaling.type != "yarn":
        return 1.0
    if scaling.attention_factor:
        return scaling.attention_factor
    if scaling.mscale and scaling.mscale_all_dim:
        return yarn_mscale(scaling.factor, scaling.mscale) / yarn_mscale(
            scaling.factor, scaling.mscale_all_dim
        )
    return yarn_mscale(scaling.factor)


def yarn_softmax_scale(scaling: Optional[RopeScaling]) -> float:
    """Multiplier of MLA's softmax scale 1/sqrt(qk_head_dim): ``yarn_mscale(factor, mscale_all_dim)**2``
    under YaRN with ``mscale_all_dim`` set (DeepSeek-V2/V3), else 1."""
    if scaling is None or scaling.type != "yarn" or not scaling.mscale_all_dim:
        return 1.0
    return yarn_mscale(scaling.factor, scaling.mscale_all_dim) ** 2


def precompute_rope_cache(
    head_dim: int, max_seq_len: int, theta: float = 10000.0, scaling: Optional[RopeScaling] = None
) -> Tensor:
    """The (max_seq_len, head_dim) float32 rotary cache ``[cos | sin]`` computed on CPU.

    Angles are computed in float64 and rounded once, so the cache is identical on every device
    and accurate at long positions.
    """
    inv_freq = rope_inv_freq(head_dim, theta, scaling)  # (D/2,)
    positions = torch.arange(max_seq_len, dtype=torch.float64)  # (S,)
    angles = torch.outer(positions, inv_freq)  # (S, D/2)
    cache = torch.cat([angles.cos(), angles.sin()], dim=-1)  # (S, D)
    return (cache * rope_attention_factor(scaling)).to(torch.float32)


def apply_rotary_emb(xq: Tensor, xk: Tensor, rope: Tensor) -> tuple[Tensor, Tensor]:
    """Rotate queries and keys (B, S, n_heads, D) by the rotate_half layout; computed in fp32.

    ``rope`` holds each token's ``[cos | sin]`` row: (S, D) shared by the batch, or (B, S, D)
    when positions differ per sequence (packed documents).
    """
    cos, sin = rope.chunk(2, dim=-1)  # (S, D/2) or (B, S, D/2)
    if rope.dim() == 2:
        cos, sin = cos[None], sin[None]  # (1, S, D/2)
    cos = cos[:, :, None, :]  # (B|1, S, 1, D/2), broadcasts over heads
    sin = sin[:, :, None, :]

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
# Norm
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

    def init_weights(self, init: ParamInit, prefix: str) -> None:
        """Gain of ones (through ``init`` so sharded parameters get their slice)."""
        init.ones(f"{prefix}.weight", self.weight)

    def forward(self, x: Tensor) -> Tensor:
        # fp32 statistics: in bf16 the mean of squares over thousands of channels loses digits.
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)  # (..., H)
        return normed.type_as(x) * self.weight

    def extra_repr(self) -> str:
        return f"{self.normalized_shape}, eps={self.eps}"


# --------------------------------------------------------------------------------------------
# Output head
# --------------------------------------------------------------------------------------------


class OutputHead(nn.Linear):
    """The output projection to the vocabulary (an ``nn.Linear``: same parameter name, TP styles, FSDP
    and checkpoint keys), with optional logit soft-capping (Gemma 2): ``cap * tanh(logits / cap)``.

    Every family's head is this module, so capping reaches each one (and DeepSeek-V3's MTP heads,
    which share it) through this one place. The cap is elementwise: under tensor parallelism it runs
    on the vocab-sharded logits (a DTensor under loss parallel) with no communication. ``softcap``
    None (the default) is the plain projection, bitwise.

    ``deferred`` (set by the trainer under ``training.loss_chunk_size``): the model does not call the
    head and returns the final hidden states (B, S, H) instead of the logits; the loss then runs this
    module chunk by chunk over the tokens (``trainer/step.py``), so the (B, S, V) logits never exist
    at once. Every family reads it through :func:`head_deferred`."""

    def __init__(self, dim: int, vocab_size: int, softcap: Optional[float] = None) -> None:
        super().__init__(dim, vocab_size, bias=False)
        self.softcap = softcap
        self.deferred = False
        self.onednn = False  # fp32 CPU GEMMs through oneDNN (models/cpu_gemm.py, training.cpu_gemm)

    def forward(self, x: Tensor) -> Tensor:
        logits = linear(x, self.weight, self.bias, onednn=self.onednn)  # (B, S, V)
        if self.softcap is None:
            return logits
        return torch.tanh(logits / self.softcap) * self.softcap

    def extra_repr(self) -> str:
        return super().extra_repr() + (f", softcap={self.softcap}" if self.softcap is not None else "")


def head_deferred(head: Optional[nn.Module]) -> bool:
    """Whether the model's forward returns the final hidden states instead of calling ``head``
    (an :class:`OutputHead` the trainer deferred to a chunked loss)."""
    return isinstance(head, OutputHead) and head.deferred


# --------------------------------------------------------------------------------------------
# Deterministic initialisation
# --------------------------------------------------------------------------------------------


class ParamInit:
    """Seed-by-name initialiser: each parameter draws its FULL tensor in float32 on CPU from a
    generator seeded by ``(seed, canonical name)`` and is written through ``copy_fn``.

    The values therefore depend neither on the device, nor on which other parameters exist
    (pipeline stages), nor on wrappers; a sharded caller passes a ``copy_fn`` that writes only
    its slice. Each module's ``init_weights(init, prefix)`` calls the methods below with the
    canonical names of its parameters, so a new block type brings its own scheme.
    """

    def __init__(self, seed: int = 0, copy_fn: Optional[CopyFn] = None) -> None:
        self.seed = seed
        self.copy_fn = copy_fn if copy_fn is not None else _default_copy

    def fill(self, name: str, param: Tensor, fill: Callable[[Tensor, torch.Generator], object]) -> None:
        """Draw ``param``'s full value with ``fill(tensor, generator)`` and write it."""
        gen = torch.Generator(device="cpu").manual_seed(param_seed(self.seed, name))
        full = torch.empty(param.shape, dtype=torch.float32, device="cpu")
        fill(full, gen)
        self.copy_fn(param, full)

    def normal(self, name: str, param: Tensor, std: float) -> None:
        """N(0, std^2)."""
        self.fill(name, param, lambda t, g: nn.init.normal_(t, mean=0.0, std=std, generator=g))

    def trunc_normal(self, name: str, param: Tensor, std: float, cutoff: float) -> None:
        """N(0, std^2) truncated at ``cutoff`` standard deviations."""
        self.fill(
            name,
            param,
            lambda t, g: nn.init.trunc_normal_(
                t, mean=0.0, std=std, a=-cutoff * std, b=cutoff * std, generator=g
            ),
        )

    def ones(self, name: str, param: Tensor) -> None:
        """All ones (norm gains)."""
        self.fill(name, param, lambda t, g: t.fill_(1.0))

    def zeros(self, name: str, param: Tensor) -> None:
        """All zeros (biases, e.g. MoE expert bias)."""
        self.fill(name, param, lambda t, g: t.zero_())


def param_seed(seed: int, name: str) -> int:
    """Generator seed for one parameter: CRC32 of ``name`` xor a multiplicative hash of ``seed``.

    Kept in 32 bits on purpose: the CPU generator seeds its Mersenne Twister from the low 32
    bits only, so ``seed`` must change those bits. Multiplying by an odd constant is a bijection
    modulo 2**32, so two seeds below 2**32 never give one parameter the same stream.
    """
    return (zlib.crc32(name.encode("utf-8")) ^ (seed * 0x9E3779B1)) & 0xFFFFFFFF


def _default_copy(param: Tensor, full: Tensor) -> None:
    param.copy_(full.to(param.device, param.dtype))


# --------------------------------------------------------------------------------------------
# Counting
# --------------------------------------------------------------------------------------------


def num_params(model: nn.Module, exclude_embedding: bool = False) -> int:
    """Number of unique parameters of a built ``model`` (tied weights count once; works on meta).

    With ``exclude_embedding`` the weights of every ``nn.Embedding`` are left out (with tied
    embeddings that includes the shared output head). The analytic counterpart, from args
    alone, is ``ModelSpec.param_counts``.
    """
    params = {id(p): p for p in model.parameters()}
    if exclude_embedding:
        for module in model.modules():
            if isinstance(module, nn.Embedding):
                for p in module.parameters():
                    params.pop(id(p), None)
    return sum(p.numel() for p in params.values())
