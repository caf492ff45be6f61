"""The attention core: the replaceable piece of ``Attention`` that turns rotated q, k, v into
the attention output, and the masks it applies. Free of any parallelism.

``Attention.forward`` projects and rotates q/k/v and hands them to ``self.core``:

    core(q, k, v, positions=positions)   q (B, S, nh, D), k/v (B, S, nkv, D) -> (B, S, nh, D)

i.e. AFTER RoPE and BEFORE the grouped-query expansion, so a core that moves keys and values
between ranks (context parallel's all-gather core in ``parallelisms/context_parallel.py``) moves
only the kv heads. ``positions`` are the tokens' RoPE positions ((B, S), (S,) or None for 0..S-1).

Masks (``model.attention_mask``):

* ``causal``: token i attends to tokens j <= i, by TRUE token index in the sequence.
* ``block_causal``: causal, and only within the same packed document. Documents are identified
  from the positions alone: positions restart at 0 at each document start, so within the
  sequence a document is the set of tokens sharing ``index - position`` (its start index).
  Key j <= i belongs to query i's document iff ``index_i - pos_i == index_j - pos_j`` (a restart
  between j and i makes ``pos_i`` smaller than ``i - j + pos_j``). With positions None (one
  document, e.g. generation) block-causal is causal.

On CPU a mask is a dense additive float tensor (0 / -inf, built once per batch and shared by
every layer through the core's one-entry cache) fed to SDPA's fused CPU kernel; on CUDA
``block_causal`` runs FlexAttention with a ``BlockMask`` built from the same index tensors, so no
(S, S) tensor is ever materialised. Plain ``causal`` without a mask tensor stays SDPA
``is_causal=True`` everywhere.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional, Protocol, Union, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from models.common import repeat_kv
from models.errors import ConfigError

if TYPE_CHECKING:  # imported where used: CPU-only runs never load FlexAttention
    from torch.nn.attention.flex_attention import BlockMask

__all__ = [
    "ATTENTION_MASKS",
    "AttentionCore",
    "KVCacheCore",
    "LatentAttentionCore",
    "LatentKVCacheCore",
    "Mask",
    "MaskCache",
    "MaskSpec",
    "RecurrentCore",
    "StateHandoff",
    "attend",
    "attention_cache_cores",
    "compiled_flex_attention",
    "document_ids",
    "validate_attention_mask",
]

ATTENTION_MASKS = ("causal", "block_causal")
# A built mask: an additive float tensor (B|1, 1, Sq, Sk) for SDPA, or FlexAttention's BlockMask (CUDA)
Mask = Union[Tensor, "BlockMask"]


def validate_attention_mask(value: object) -> None:
    """``model.attention_mask`` must be one of ``ATTENTION_MASKS``."""
    if value not in ATTENTION_MASKS:
        raise ConfigError(
            f"model.attention_mask={value!r} is not one of {list(ATTENTION_MASKS)}; use causal, or "
            "block_causal to stop attention at document boundaries (BOS/EOS) of packed sequences."
        )


@dataclass
class MaskSpec:
    """Which keys each query may see, by true token index and document.

    ``q_index`` (Sq,) / ``k_index`` (Sk,): true indices of the queries and keys in the full
    sequence (not necessarily sorted: a context-parallel shard holds two chunks, and gathered
    keys come in rank order). ``q_doc`` (B, Sq) / ``k_doc`` (B, Sk): document ids, or None for
    plain causal.
    """

    q_index: Tensor
    k_index: Tensor
    q_doc: Optional[Tensor] = None
    k_doc: Optional[Tensor] = None

    def allowed(self) -> Tensor:
        """Boolean (B|1, Sq, Sk): True where the query may attend the key."""
        allowed = self.k_index[None, None, :] <= self.q_index[None, :, None]  # (1, Sq, Sk)
        if self.q_doc is not None and self.k_doc is not None:
            allowed = allowed & (self.q_doc[:, :, None] == self.k_doc[:, None, :])  # (B, Sq, Sk)
        return allowed

    def additive(self, dtype: torch.dtype) -> Tensor:
        """Additive float mask (B|1, 1, Sq, Sk): 0 where allowed, -inf elsewhere."""
        allowed = self.allowed()
        mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
        mask.masked_fill_(~allowed, float("-inf"))
        return mask[:, None]  # (B|1, 1, Sq, Sk)

    def block_mask(self, batch: int, heads: Optional[int] = None) -> BlockMask:
        """A FlexAttention ``BlockMask`` evaluating the same rule block by block (CUDA)."""
        from torch.nn.attention.flex_attention import create_block_mask

        q_index, k_index, q_doc, k_doc = self.q_index, self.k_index, self.q_doc, self.k_doc

        def mask_mod(b: Tensor, h: Tensor, qi: Tensor, ki: Tensor) -> Tensor:
            ok = k_index[ki] <= q_index[qi]
            if q_doc is not None and k_doc is not None:
                ok = ok & (q_doc[b, qi] == k_doc[b, ki])
            return ok

        b = batch if q_doc is not None else None
        return create_block_mask(
            mask_mod, b, heads, self.q_index.numel(), self.k_index.numel(), device=self.q_index.device
        )


def document_ids(index: Tensor, positions: Tensor) -> Tensor:
    """Document id of each token: its document's start index ``index - position`` ((B, S))."""
    if positions.dim() == 1:
        positions = positions[None]
    return index[None, :] - positions  # (B, S)


def compiled_flex_attention() -> Callable[..., Tensor]:
    """``flex_attention`` compiled (eager FlexAttention materialises the scores). Called lazily,
    on first CUDA use, so CPU-only runs never touch inductor."""
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def attend(
    q: Tensor, k: Tensor, v: Tensor, mask: Optional[Mask], *, flex: Optional[Callable[..., Tensor]] = None
) -> Tensor:
    """Attention of q (B, Sq, nh, D) over k/v (B, Sk, nkv, D) -> (B, Sq, nh, D).

    ``mask``: None (square causal, ``is_causal=True``), an additive float tensor
    (B|1, 1, Sq, Sk) for SDPA, or a FlexAttention ``BlockMask`` run by ``flex``.
    """
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, heads, S, D)
    if flex is not None:
        out = flex(q, k, v, block_mask=mask, enable_gqa=q.size(1) != k.size(1))
        return out.transpose(1, 2)  # (B, Sq, nh, D)
    # Explicit repeat rather than SDPA's enable_gqa: works with every backend, under
    # torch.compile, and for whatever local head counts tensor parallelism leaves.
    n_rep = q.size(1) // k.size(1)
    k = repeat_kv(k, n_rep)  # (B, nh, Sk, D)
    v = repeat_kv(v, n_rep)  # (B, nh, Sk, D)
    if mask is None:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, nh, Sq, D)
    else:
        dense = cast(Tensor, mask)  # a BlockMask comes with ``flex`` (above)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=dense)  # (B, nh, Sq, D)
    return out.transpose(1, 2)  # (B, Sq, nh, D)


class MaskCache:
    """One-entry cache of the mask of the current batch, shared by the layers of a model.

    Keyed on the positions tensor object (and its version counter), the sequence length, dtype
    and device: every layer of one forward (and an activation-checkpoint recompute) gets the
    same positions tensor, so the mask is built once per (micro)batch.
    """

    def __init__(self) -> None:
        self._key: Optional[tuple] = None
        self._positions: Optional[Tensor] = None
        self._value: Optional[Mask] = None

    def get(self, positions: Optional[Tensor], key: tuple, build: Callable[[], Mask]) -> Mask:
        full_key = (key, None if positions is None else positions._version)
        if self._value is not None and self._positions is positions and self._key == full_key:
            return self._value
        self._value = build()
        self._positions, self._key = positions, full_key
        return self._value


class AttentionCore(nn.Module):
    """Default core: repeat the kv heads and run SDPA (or FlexAttention on CUDA for
    block-causal masks). Parameterless; one instance is shared by all layers of a model so
    that a block-causal mask is built once per batch."""

    def __init__(self, attention_mask: str = "causal") -> None:
        super().__init__()
        validate_attention_mask(attention_mask)
        self.attention_mask = attention_mask
        self.cache = MaskCache()
        self.flex: Optional[Callable[..., Tensor]] = None  # compiled on first CUDA block-causal call

    def forward(self, q: Tensor, k: Tensor, v: Tensor, *, positions: Optional[Tensor] = None) -> Tensor:
        """q (B, S, nh, D), k/v (B, S, nkv, D) after RoPE -> (B, S, nh, D)."""
        if self.attention_mask == "causal" or positions is None:
            return attend(q, k, v, None)
        B, S = q.shape[:2]
        use_flex = q.is_cuda

        def build() -> Mask:
            index = torch.arange(S, device=q.device)
            doc = document_ids(index, positions.to(q.device)).expand(B, S)
            spec = MaskSpec(index, index, doc, doc)
            return spec.block_mask(B) if use_flex else spec.additive(q.dtype)

        mask = self.cache.get(positions, (B, S, q.dtype, q.device, use_flex), build)
        if use_flex and self.flex is None:
            self.flex = compiled_flex_attention()
        return attend(q, k, v, mask, flex=self.flex if use_flex else None)

    def extra_repr(self) -> str:
        return f"attention_mask={self.attention_mask}"


class KVCacheCore(nn.Module):
    """Inference core that keeps the keys and values of every token seen so far (one per layer).

    Each call appends the new tokens' rotated k/v (B, Sn, nkv, D) to a buffer of ``max_len``
    positions and attends the new queries over everything cached, causally by index: token i of
    the cache is visible to new token t iff i <= t. Call ``reset()`` before a new sequence; the
    caller passes each new token's position (its index in the cache) to the model.
    """

    def __init__(self, max_len: int) -> None:
        super().__init__()
        self.max_len = max_len
        self.k: Optional[Tensor] = None
        self.v: Optional[Tensor] = None
        self.length = 0

    def reset(self) -> None:
        """Forget the cached tokens (the buffers are kept for the next sequence)."""
        self.length = 0

    def forward(self, q: Tensor, k: Tensor, v: Tensor, *, positions: Optional[Tensor] = None) -> Tensor:
        """q (B, Sn, nh, D), k/v (B, Sn, nkv, D) for the Sn new tokens -> (B, Sn, nh, D)."""
        B, Sn = k.shape[:2]
        if self.length + Sn > self.max_len:
            raise ValueError(f"KV cache of {self.max_len} positions is full; reset it and prefill again")
        if (
            self.k is None
            or self.v is None  # set with k
            or self.k.shape[0] != B
            or self.k.dtype != k.dtype
            or self.k.device != k.device
        ):
            self.k = k.new_empty(B, self.max_len, *k.shape[2:])  # (B, L, nkv, D)
            self.v = v.new_empty(B, self.max_len, *v.shape[2:])
        self.k[:, self.length : self.length + Sn] = k
        self.v[:, self.length : self.length + Sn] = v
        self.length += Sn
        index = torch.arange(self.length, device=q.device)
        mask = MaskSpec(index[-Sn:], index).additive(q.dtype)  # (1, 1, Sn, L)
        return attend(q, self.k[:, : self.length], self.v[:, : self.length], mask)


# --------------------------------------------------------------------------------------------
# Latent attention cores (multi-head latent attention, models/deepseek_v3)
# --------------------------------------------------------------------------------------------

# Expand the compressed keys/values: (B, Sk, 1, C) -> k (B, Sk, nh, Dqk), v (B, Sk, nh, Dv).
Expand = Callable[[Tensor], tuple[Tensor, Tensor]]


class LatentAttentionCore(nn.Module):
    """Core of multi-head latent attention (MLA): it receives the queries and the COMPRESSED keys and
    values of the tokens at hand (one latent per token, shared by all heads: the normalised KV latent
    and the rotated shared RoPE key, concatenated, (B, S, 1, C)) with the ``expand`` function that
    up-projects latents to per-head keys and values. This core expands at once and attends like
    ``AttentionCore`` (same masks, one shared instance per model). Cores that move or keep keys
    swap in here and move or keep the latents instead: context parallel all-gathers them before
    expanding (``parallelisms/context_parallel.py``), generation caches them
    (``LatentKVCacheCore``)."""

    def __init__(self, attention_mask: str = "causal") -> None:
        super().__init__()
        self.inner = AttentionCore(attention_mask)

    @property
    def attention_mask(self) -> str:
        return self.inner.attention_mask

    def forward(
        self, q: Tensor, latent: Tensor, *, expand: Expand, positions: Optional[Tensor] = None
    ) -> Tensor:
        """q (B, S, nh, Dqk), latent (B, S, 1, C) -> (B, S, nh, Dv)."""
        k, v = expand(latent)  # (B, S, nh, Dqk), (B, S, nh, Dv)
        return self.inner(q, k, v, positions=positions)


class LatentKVCacheCore(nn.Module):
    """Inference core of MLA that caches the compressed latents (B, L, 1, C) of every token seen so far,
    not the expanded per-head keys and values (nh * (Dqk + Dv) / C times more), and expands the whole
    cache at each step. Same contract as ``KVCacheCore``."""

    def __init__(self, max_len: int) -> None:
        super().__init__()
        self.max_len = max_len
        self.latent: Optional[Tensor] = None
        self.length = 0

    def reset(self) -> None:
        """Forget the cached tokens (the buffer is kept for the next sequence)."""
        self.length = 0

    def forward(
        self, q: Tensor, latent: Tensor, *, expand: Expand, positions: Optional[Tensor] = None
    ) -> Tensor:
        """q (B, Sn, nh, Dqk), latent (B, Sn, 1, C) for the Sn new tokens -> (B, Sn, nh, Dv)."""
        B, Sn = latent.shape[:2]
        if self.length + Sn > self.max_len:
            raise ValueError(f"KV cache of {self.max_len} positions is full; reset it and prefill again")
        if (
            self.latent is None
            or self.latent.shape[0] != B
            or self.latent.dtype != latent.dtype
            or self.latent.device != latent.device
        ):
            self.latent = latent.new_empty(B, self.max_len, *latent.shape[2:])  # (B, L, 1, C)
        self.latent[:, self.length : self.length + Sn] = latent
        self.length += Sn
        k, v = expand(self.latent[:, : self.length])  # (B, L, nh, Dqk), (B, L, nh, Dv)
        index = torch.arange(self.length, device=q.device)
        mask = MaskSpec(index[-Sn:], index).additive(q.dtype)  # (1, 1, Sn, L)
        return attend(q, k, v, mask)


def attention_cache_cores(model: nn.Module, max_len: int) -> list[tuple[nn.Module, nn.Module]]:
    """(module, its generation core) for every attention module of ``model`` (a module whose ``core``
    is an attention core): a ``KVCacheCore`` of ``max_len`` positions, or a ``LatentKVCacheCore`` for
    multi-head latent attention (it caches the latents, not the expanded K/V). The default of
    ``ModelSpec.generation_cores``; a family with other token mixers adds its own caches to these."""
    pairs: list[tuple[nn.Module, nn.Module]] = []
    for m in model.modules():
        core = getattr(m, "core", None)
        if isinstance(core, LatentAttentionCore):
            pairs.append((m, LatentKVCacheCore(max_len)))
        elif isinstance(core, AttentionCore):
            pairs.append((m, KVCacheCore(max_len)))
    return pairs


# --------------------------------------------------------------------------------------------
# Recurrent cores (linear attention, models/qwen3_5): what context parallelism hands across ranks
# --------------------------------------------------------------------------------------------


class StateHandoff(Protocol):
    """What a recurrent core asks of context parallelism (``parallelisms/context_parallel.py``) when the
    sequence is split into contiguous slices, one per cp rank, in rank order. Every rank calls both
    methods in the same order (they are collectives); both are differentiable."""

    def previous(self, x: Tensor) -> Optional[Tensor]:
        """The previous rank's ``x`` (same shape), None on the first rank."""
        ...

    def incoming_state(self, m: Tensor, s: Tensor) -> Optional[Tensor]:
        """This rank's incoming state from every rank's effect on a handed-in state (``final = m @ S0
        + s``, from a zero state): the prefix combination over the previous ranks, None on the first."""
        ...


class RecurrentCore(nn.Module):
    """Base class of a token mixer's core that carries a state along the sequence (a linear attention's
    recurrent state, its convolution window). ``handoff`` is None on one process; context parallelism
    sets it, and the core then continues the previous rank's state instead of starting from zero."""

    handoff: Optional[StateHandoff] = None
