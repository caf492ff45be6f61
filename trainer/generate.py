"""Sample text from a trained model: a checkpoint folder or an exported Hugging Face folder.

    python -m trainer.generate outputs/debug/checkpoints/step-300 --prompt "def main("
    python -m trainer.generate hf/debug --prompt "import " --temperature 0.7 --top-k 40 \\
        --max-new-tokens 200 --num-samples 3 --device cuda

Autoregressive sampling with a KV cache: each layer's attention core is swapped for a
``KVCacheCore`` that keeps the rotated keys and values, so every step runs only the new token
(``--no-cache`` re-runs the whole context instead; the greedy tokens are the same). The context
is the last ``model.max_seq_len`` tokens. ``--temperature 0`` is greedy decoding; the tokens/s
of each sample are printed to stderr.

Argument parsing and printing only: sampling is ``models/generation.py``, loading
``trainer/checkpoint/load.py``.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

import torch

from models.errors import ConfigError
from models.generation import generate
from trainer.checkpoint.load import load_model


def _check_args(args: argparse.Namespace) -> str:
    """``ConfigError`` naming the bad argument before any weights are read; returns the device."""
    if not (math.isfinite(args.temperature) and args.temperature >= 0):
        raise ConfigError(
            f"--temperature={args.temperature} must be a finite number >= 0 (0 = greedy decoding)."
        )
    for flag, value, low in (
        ("--max-new-tokens", args.max_new_tokens, 1),
        ("--num-samples", args.num_samples, 1),
        ("--top-k", args.top_k, 0),
    ):
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
        ids = generate(
            model,
            prompt_ids,
            max_new_tokens=args.max_new_tokens,
            temperature=args.temperature,
            top_k=args.top_k or None,
            eos_id=tokenizer.eos_id,
            generator=gen,
            use_cache=not args.no_cache,
        )
        seconds = time.perf_counter() - start
        if args.num_samples > 1:
            print(f"--- sample {i + 1} ---")
        print(tokenizer.decode(ids[1:]), flush=True)
        new_tokens = len(ids) - len(prompt_ids)
        cache = "no KV cache" if args.no_cache else "KV cache"
        print(
            f"[{new_tokens} tokens in {seconds:.2f}s = {new_tokens / max(seconds, 1e-9):.1f} tokens/s, "
            f"{cache}]",
            file=sys.stderr,
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
