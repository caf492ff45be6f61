"""Sample text from a trained model: a checkpoint folder or an exported Hugging Face folder.

    python -m trainer.generate outputs/debug/checkpoints/step-300 --prompt "def main("
    python -m trainer.generate hf/debug --prompt "import " --temperature 0.7 --top-k 40 \\
        --max-new-tokens 200 --num-samples 3 --device cuda

Autoregressive sampling with a KV cache: each layer's attention core is swapped for a
``KVCacheCore`` that keeps the rotated keys and values, so every step runs only the new token
(``--no-cache`` re-runs the whole context instead; the greedy tokens are the same). The context
is the last ``model.max_seq_len`` tokens. ``--temperature 0`` is greedy decoding; the tokens/s
of each sample are printed to stderr.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import time
from collections.abc import Iterator
from typing import Any, Optional

import torch
from torch import nn

from models import get_spec
from models.attention import KVCacheCore
from models.errors import ConfigError
from models.spec import ModelSpec
from trainer.checkpoint.checkpointer import MARKER, load_full_state, read_marker, verify_files
from trainer.checkpoint.hf import CONFIG_FILE, MESHWRIGHT_FILE, read_hf
from trainer.data.tokenizer import Tokenizer, build_tokenizer


def _build(spec: ModelSpec, args: Any, state: dict[str, torch.Tensor], device: torch.device) -> nn.Module:
    with torch.device("meta"):
        model = spec.build(args)
    model.to_empty(device=device)
    model.reset_rope_cache(device)
    missing = sorted(set(model.state_dict()) - set(state))
    if missing:
        raise ConfigError(f"the weights lack {missing[0]!r} ({len(missing)} tensors missing).")
    model.load_state_dict({k: v.to(torch.float32) for k, v in state.items()}, strict=True)
    return model.eval()


def load_model(path: str, device: str | torch.device = "cpu") -> tuple[nn.Module, Optional[Tokenizer]]:
    """(model in eval mode, tokenizer or None) from a ``step-N`` checkpoint or a HF model folder."""
    device = torch.device(device)
    if os.path.isfile(os.path.join(path, MARKER)):
        info = read_marker(path)
        verify_files(path, info)
        spec = get_spec(info["model"].get("family", "llama"))
        model = _build(spec, spec.make_args(info["model"]), load_full_state(path, "model."), device)
        tokenizer = info.get("tokenizer", "byte")
    elif os.path.isfile(os.path.join(path, CONFIG_FILE)):
        model_spec, args, state = read_hf(path)
        model = _build(model_spec, args, state, device)
        tokenizer = None
        extra_path = os.path.join(path, MESHWRIGHT_FILE)
        if os.path.isfile(extra_path):
            with open(extra_path, encoding="utf-8") as f:
                tokenizer = json.load(f).get("tokenizer")
        elif os.path.isfile(os.path.join(path, "tokenizer.json")):
            tokenizer = "tokenizer.json"
        if tokenizer not in (None, "byte"):
            tokenizer = os.path.join(path, tokenizer)
    else:
        raise ConfigError(
            f"{path} is neither a meshwright checkpoint (no {MARKER}) nor a Hugging Face folder (no "
            f"{CONFIG_FILE}); pass e.g. outputs/debug/checkpoints/step-300."
        )
    return model, (build_tokenizer(tokenizer) if tokenizer else None)


def _sample(logits: torch.Tensor, temperature: float, top_k: Optional[int],
            generator: Optional[torch.Generator]) -> int:  # fmt: skip
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
def kv_cache(model: nn.Module, max_len: int) -> Iterator[list[KVCacheCore]]:
    """Swap every attention core of ``model`` for a per-layer ``KVCacheCore``; restore on exit."""
    attentions = [m for m in model.modules() if isinstance(getattr(m, "core", None), nn.Module)]
    saved = [m.core for m in attentions]
    caches = [KVCacheCore(max_len) for _ in attentions]
    for m, cache in zip(attentions, caches):
        m.core = cache
    try:
        yield caches
    finally:
        for m, core in zip(attentions, saved):
            m.core = core


@torch.no_grad()
def generate(model: nn.Module, ids: list[int], *, max_new_tokens: int, temperature: float = 0.8,
             top_k: Optional[int] = 50, eos_id: Optional[int] = None,
             generator: Optional[torch.Generator] = None, use_cache: bool = True) -> list[int]:  # fmt: skip
    """Continue ``ids`` by up to ``max_new_tokens`` sampled tokens (stops at ``eos_id``).

    With ``use_cache`` each step feeds only the new token and attends over the layers' cached
    keys/values; without, each step re-runs the whole context. Both see the last
    ``max_seq_len`` tokens at positions 0..S-1 (when the window slides, the cache is refilled),
    so greedy decoding gives the same tokens either way.
    """
    device = next(model.parameters()).device
    window = model.args.max_seq_len
    out = list(ids)
    if not use_cache:
        for _ in range(max_new_tokens):
            logits = model(torch.tensor([out[-window:]], device=device))[0, -1].float()  # (V,)
            out.append(_sample(logits, temperature, top_k, generator))
            if eos_id is not None and out[-1] == eos_id:
                break
        return out
    with kv_cache(model, window) as caches:
        cached = 0  # tokens of the current window already in the caches
        for _ in range(max_new_tokens):
            if cached == 0 or len(out) > window:  # first step, or the window slid: prefill again
                for cache in caches:
                    cache.reset()
                context = out[-window:]
                new, start = context, 0
            else:
                new, start = out[cached:], cached
            positions = torch.arange(start, start + len(new), device=device)
            logits = model(torch.tensor([new], device=device), positions)[0, -1].float()  # (V,)
            cached = min(len(out), window)
            out.append(_sample(logits, temperature, top_k, generator))
            if eos_id is not None and out[-1] == eos_id:
                break
    return out


def _check_args(args: argparse.Namespace) -> str:
    """``ConfigError`` naming the bad argument before any weights are read; returns the device."""
    if not (math.isfinite(args.temperature) and args.temperature >= 0):
        raise ConfigError(
            f"--temperature={args.temperature} must be a finite number >= 0 (0 = greedy decoding)."
        )
    for flag, value, low in (("--max-new-tokens", args.max_new_tokens, 1), ("--num-samples", args.num_samples, 1),
                             ("--top-k", args.top_k, 0)):  # fmt: skip
        if value < low:
            raise ConfigError(
                f"{flag}={value} must be >= {low}" + (" (0 = all tokens)." if low == 0 else ".")
            )
    if not os.path.isdir(args.path):
        what = "is a file, not a folder" if os.path.exists(args.path) else "does not exist"
        raise ConfigError(
            f"{args.path} {what}; pass a checkpoint step-N folder or an exported Hugging Face folder."
        )
    device = args.device
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        kind = torch.device(device).type
    except RuntimeError as e:
        raise ConfigError(f"--device={device!r} is not a device; use auto, cpu or cuda (e.g. cuda:1).") from e
    if kind == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"--device={device} but no CUDA device is available; use --device cpu.")
    if kind not in ("cpu", "cuda"):
        raise ConfigError(f"--device={device!r}: use auto, cpu or cuda.")
    return device


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trainer.generate", description=__doc__.split("\n\n")[0])
    parser.add_argument("path", help="a checkpoint step-N folder or an exported Hugging Face folder")
    parser.add_argument("--prompt", default="", help="text to continue")
    parser.add_argument("--max-new-tokens", type=int, default=200)
    parser.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    parser.add_argument("--top-k", type=int, default=50, help="sample among the k likeliest tokens; 0 = all")
    parser.add_argument("--num-samples", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="auto", help="auto | cpu | cuda")
    parser.add_argument("--no-cache", action="store_true", help="re-run the whole context at every step")
    args = parser.parse_args(argv)
    try:
        device = _check_args(args)
        model, tokenizer = load_model(args.path, device)
        if tokenizer is None:
            raise ConfigError(
                f"{args.path} names no tokenizer; add a tokenizer.json or meshwright.json to it."
            )
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    gen = torch.Generator().manual_seed(args.seed)
    prompt_ids = [tokenizer.bos_id, *tokenizer.encode(args.prompt)]
    for i in range(args.num_samples):
        start = time.perf_counter()
        ids = generate(model, prompt_ids, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                       top_k=args.top_k or None, eos_id=tokenizer.eos_id, generator=gen,
                       use_cache=not args.no_cache)  # fmt: skip
        seconds = time.perf_counter() - start
        if args.num_samples > 1:
            print(f"--- sample {i + 1} ---")
        print(tokenizer.decode(ids[1:]), flush=True)
        new_tokens = len(ids) - len(prompt_ids)
        cache = "no KV cache" if args.no_cache else "KV cache"
        print(f"[{new_tokens} tokens in {seconds:.2f}s = {new_tokens / max(seconds, 1e-9):.1f} tokens/s, {cache}]",
              file=sys.stderr, flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
