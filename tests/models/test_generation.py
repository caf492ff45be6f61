"""Generation with a KV cache gives the cache-less path's greedy tokens, also when the window slides."""

from __future__ import annotations

import time

import pytest
import torch

from models.generation import generate
from models.llama import LlamaArgs, Transformer


@pytest.mark.parametrize("n_kv_heads", [2, 4])
def test_kv_cache_matches_full_recompute(n_kv_heads: int) -> None:
    args = LlamaArgs(
        dim=64, n_layers=3, n_heads=4, n_kv_heads=n_kv_heads, vocab_size=97, ffn_hidden_dim=96, max_seq_len=24
    )
    model = Transformer(args)
    model.init_weights(seed=1)
    model.eval()
    prompt = torch.randint(0, args.vocab_size, (7,), generator=torch.Generator().manual_seed(0)).tolist()
    # 40 new tokens with a 24-token window: the window slides and the cache is refilled.
    start = time.perf_counter()
    plain = generate(model, prompt, max_new_tokens=40, temperature=0, use_cache=False)
    t_plain = time.perf_counter() - start
    start = time.perf_counter()
    cached = generate(model, prompt, max_new_tokens=40, temperature=0, use_cache=True)
    t_cached = time.perf_counter() - start
    assert cached == plain and len(cached) == len(prompt) + 40
    assert all(type(m.core).__name__ == "AttentionCore" for m in model.modules() if hasattr(m, "core"))
    print(
        f"greedy tokens identical; no-cache {t_plain:.3f}s vs cache {t_cached:.3f}s: "
        f"{t_plain / t_cached:.2f}x"
    )


def test_kv_cache_logits_equal_full_forward() -> None:
    """Token by token through the cache gives the same logits as one forward over the sequence."""
    from models.generation import kv_cache

    args = LlamaArgs(
        dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=97, ffn_hidden_dim=96, max_seq_len=32
    )
    model = Transformer(args)
    model.init_weights(seed=2)
    tokens = torch.randint(0, args.vocab_size, (1, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = model(tokens)
        with kv_cache(model, args.max_seq_len):
            first = model(tokens[:, :5], torch.arange(5))
            rest = [model(tokens[:, i : i + 1], torch.tensor([i])) for i in range(5, 12)]
    stepwise = torch.cat([first, *rest], dim=1)
    torch.testing.assert_close(stepwise, full, rtol=1e-5, atol=1e-5)


def test_kv_cache_speed_on_the_debug_shapes() -> None:
    """No window slide: the cache runs one token per step instead of the whole context."""
    args = LlamaArgs(
        dim=256, n_layers=4, n_heads=8, n_kv_heads=4, vocab_size=512, ffn_hidden_dim=768, max_seq_len=512
    )
    model = Transformer(args)
    model.init_weights(seed=3)
    model.eval()
    prompt = list(range(1, 33))
    times = {}
    outs = {}
    for use_cache in (False, True):
        start = time.perf_counter()
        outs[use_cache] = generate(model, prompt, max_new_tokens=128, temperature=0, use_cache=use_cache)
        times[use_cache] = time.perf_counter() - start
    assert outs[True] == outs[False]
    ratio = times[False] / times[True]
    print(
        f"debug shapes, 128 greedy tokens: {128 / times[False]:.0f} tok/s without cache, "
        f"{128 / times[True]:.0f} tok/s with cache ({ratio:.2f}x)"
    )
