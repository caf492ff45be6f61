"""Sample text from a trained model: a checkpoint folder or an exported Hugging Face folder.

    python -m trainer.generate outputs/debug/checkpoints/step-300 --prompt "def main("
    python -m trainer.generate hf/debug --prompt "import " --temperature 0.7 --top-k 40 \\
        --max-new-tokens 200 --num-samples 3 --device cuda

Plain autoregressive sampling without a KV cache (the whole context is re-run per token,
cropped to ``model.max_seq_len``): simple and fast enough for the small models meant to be
inspected this way. ``--temperature 0`` is greedy decoding.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, Optional

import torch
from torch import nn

from models import get_spec
from models.errors import ConfigError
from models.spec import ModelSpec
from trainer.checkpoint import MARKER, load_full_state, read_marker, verify_files
from trainer.hf import CONFIG_FILE, MESHWRIGHT_FILE, read_hf
from trainer.tokenizer import Tokenizer, build_tokenizer


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


@torch.no_grad()
def generate(model: nn.Module, ids: list[int], *, max_new_tokens: int, temperature: float = 0.8,
             top_k: Optional[int] = 50, eos_id: Optional[int] = None,
             generator: Optional[torch.Generator] = None) -> list[int]:  # fmt: skip
    """Continue ``ids`` by up to ``max_new_tokens`` sampled tokens (stops at ``eos_id``)."""
    device = next(model.parameters()).device
    out = list(ids)
    for _ in range(max_new_tokens):
        context = torch.tensor([out[-model.args.max_seq_len :]], device=device)  # (1, S)
        logits = model(context)[0, -1].float()  # (V,)
        if temperature <= 0:
            token = int(logits.argmax())
        else:
            logits = logits / temperature
            if top_k is not None and 0 < top_k < logits.numel():
                kth = torch.topk(logits, top_k).values[-1]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            probs = torch.softmax(logits, dim=-1).cpu()
            token = int(torch.multinomial(probs, 1, generator=generator))
        out.append(token)
        if eos_id is not None and token == eos_id:
            break
    return out


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
    args = parser.parse_args(argv)
    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        model, tokenizer = load_model(args.path, device)
        if tokenizer is None:
            raise ConfigError(
                f"{args.path} names no tokenizer; add a tokenizer.json or meshwright.json to it."
            )
        if args.max_new_tokens < 1:
            raise ConfigError(f"--max-new-tokens={args.max_new_tokens} must be >= 1.")
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    gen = torch.Generator().manual_seed(args.seed)
    prompt_ids = [tokenizer.bos_id, *tokenizer.encode(args.prompt)]
    for i in range(args.num_samples):
        ids = generate(model, prompt_ids, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                       top_k=args.top_k or None, eos_id=tokenizer.eos_id, generator=gen)  # fmt: skip
        if args.num_samples > 1:
            print(f"--- sample {i + 1} ---")
        print(tokenizer.decode(ids[1:]), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
