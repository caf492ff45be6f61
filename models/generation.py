"""Autoregressive sampling from any family's model, with or without a KV cache.

Sampling needs only the model interface every family shares (``model(tokens, positions)``,
``model.args.max_seq_len``, token mixers holding a swappable ``core``), so it lives beside
``KVCacheCore`` in ``models/`` and knows nothing of training. ``generate`` continues a token
list; ``kv_cache`` swaps each layer's core for the generation core its family's spec names
(``ModelSpec.generation_cores``: a ``KVCacheCore`` that keeps the rotated keys and values by default,
a recurrent state for a linear-attention layer), so every step runs only the new token. A
generation core has ``reset()``, called before each (re)fill. The command is
``python -m trainer.generate`` (loading: ``trainer/checkpoint/load.py``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Optional, Protocol, cast

import torch
from torch import nn

from models.spec import args_of, decoder_args

__all__ = ["generate", "kv_cache", "sample_next"]


class _Resettable(Protocol):
    def reset(self) -> None: ...


def sample_next(
    logits: torch.Tensor, temperature: float, top_k: Optional[int], generator: Optional[torch.Generator]
) -> int:
    """Next token from (V,) logits: argmax at temperature 0, else top-k sampling."""
    if temperature <= 0:
        return int(logits.argmax())
    logits = logits / temperature
    if top_k is not None and 0 < top_k < logits.numel():
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1).cpu()
    return int(torch.multinomial(probs, 1, generator=generator))


@contextlib.contextmanager
def kv_cache(model: nn.Module, max_len: int) -> Iterator[list[nn.Module]]:
    """Swap every core of ``model`` for its per-layer generation core (``ModelSpec.generation_cores`` of
    the model's family: ``KVCacheCore``, ``LatentKVCacheCore`` for multi-head latent attention, a
    family's recurrent caches); restore on exit. Yields the caches, in the model's module order."""
    from models import get_spec  # the family table imports every family; generation is imported by none

    pairs = get_spec(args_of(model).family).generation_cores(model, max_len)
    saved = [m.core for m, _ in pairs]
    for m, cache in pairs:
        m.core = cache
    try:
        yield [cache for _, cache in pairs]
    finally:
        for (m, _), core in zip(pairs, saved):
            m.core = core


@torch.no_grad()
def generate(
    model: nn.Module,
    ids: list[int],
    *,
    max_new_tokens: int,
    temperature: float = 0.8,
    top_k: Optional[int] = 50,
    eos_id: Optional[int] = None,
    generator: Optional[torch.Generator] = None,
    use_cache: bool = True,
) -> list[int]:
    """Continue ``ids`` by up to ``max_new_tokens`` sampled tokens (stops at ``eos_id``).

    With ``use_cache`` each step feeds only the new token and attends over the layers' cached
    keys/values; without, each step re-runs the whole context. Both see the last
    ``max_seq_len`` tokens at positions 0..S-1 (when the window slides, the cache is refilled),
    so greedy decoding gives the same tokens either way.
    """
    device = next(model.parameters()).device
    window = decoder_args(args_of(model)).max_seq_len
    out = list(ids)
    if not use_cache:
        for _ in range(max_new_tokens):
            logits = model(torch.tensor([out[-window:]], device=device))[0, -1].float()  # (V,)
            out.append(sample_next(logits, temperature, top_k, generator))
            if eos_id is not None and out[-1] == eos_id:
                break
        return out
    with kv_cache(model, window) as caches:
        cached = 0  # tokens of the current window already in the caches
        for _ in range(max_new_tokens):
            if cached == 0 or len(out) > window:  # first step, or the window slid: prefill again
                for cache in caches:
                    cast(_Resettable, cache).reset()
                context = out[-window:]
                new, start = context, 0
            else:
                new, start = out[cached:], cached
            positions = torch.arange(start, start + len(new), device=device)
            logits = model(torch.tensor([new], device=device), positions)[0, -1].float()  # (V,)
            cached = min(len(out), window)
            out.append(sample_next(logits, temperature, top_k, generator))
            if eos_id is not None and out[-1] == eos_id:
                break
    return out
