"""Export a checkpoint to a Hugging Face Llama folder.

    python -m trainer.export_hf outputs/debug/checkpoints/step-300 hf/debug
    python -m trainer.export_hf <step-N> <out_dir> --dtype bfloat16 --max-shard-size 2GB

Writes ``model.safetensors`` (or shards plus ``model.safetensors.index.json``), a Llama
``config.json`` that ``transformers.LlamaForCausalLM.from_pretrained(out_dir)`` loads, and
``meshwright.json`` (the tokenizer choice, for ``trainer.generate``; a ``tokenizer.json`` the
run used is copied alongside). Runs on one process from any layout's checkpoint: DCP
reassembles the full tensors.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import sys

from models import get_spec
from models.errors import ConfigError
from parallelisms.utils import DTYPES
from trainer.checkpoint import load_full_state, read_marker, verify_files
from trainer.hf import save_hf


def parse_size(text: str) -> int:
    """``"5GB"``, ``"500MB"``, ``"123"`` (bytes) -> bytes (powers of 1000, as HF's max_shard_size)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?B?)\s*", text.upper())
    if not m:
        raise ConfigError(f"--max-shard-size={text!r}: use a size like 5GB, 500MB or a byte count.")
    scale = {
        "": 1,
        "B": 1,
        "KB": 1e3,
        "MB": 1e6,
        "GB": 1e9,
        "TB": 1e12,
        "K": 1e3,
        "M": 1e6,
        "G": 1e9,
        "T": 1e12,
    }
    return int(float(m.group(1)) * scale[m.group(2)])


def export(
    checkpoint: str, out_dir: str, *, dtype: str = "float32", max_shard_size: str = "5GB"
) -> list[str]:
    """Convert the DCP checkpoint folder ``checkpoint`` (a ``step-N``) into ``out_dir``; return the files."""
    if dtype not in DTYPES:
        raise ConfigError(f"--dtype={dtype!r} is not one of {sorted(DTYPES)}.")
    info = read_marker(checkpoint)
    verify_files(checkpoint, info)
    if "model" not in info:
        raise ConfigError(
            f"{checkpoint} records no model config; it was not written by meshwright's trainer."
        )
    state = load_full_state(checkpoint, "model.")
    spec = get_spec(info["model"].get("family", "llama"))
    args = spec.make_args(info["model"])
    tokenizer = info.get("tokenizer", "byte")
    extra = {
        "tokenizer": "byte",
        "model": info["model"],
        "step": info["step"],
        "source": os.path.abspath(checkpoint),
    }
    bos = eos = None
    try:
        from trainer.tokenizer import build_tokenizer

        tok = build_tokenizer(tokenizer)
        bos, eos = tok.bos_id, tok.eos_id
    except ConfigError:  # the tokenizer file moved: export the weights anyway
        tok = None
    if tokenizer != "byte":
        extra["tokenizer"] = "tokenizer.json" if tok is not None else None
    files = save_hf(state, spec, args, out_dir, max_shard_bytes=parse_size(max_shard_size), dtype=DTYPES[dtype],
                    extra=extra, bos_id=bos, eos_id=eos)  # fmt: skip
    if tokenizer != "byte" and tok is not None:
        shutil.copyfile(tokenizer, os.path.join(out_dir, "tokenizer.json"))
        files.append("tokenizer.json")
    return files


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trainer.export_hf", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "checkpoint", help="a complete checkpoint folder, e.g. outputs/debug/checkpoints/step-300"
    )
    parser.add_argument("out_dir", help="the Hugging Face folder to write")
    parser.add_argument(
        "--dtype", default="float32", choices=sorted(DTYPES), help="dtype of the saved weights"
    )
    parser.add_argument("--max-shard-size", default="5GB", help="largest safetensors file (e.g. 5GB, 500MB)")
    args = parser.parse_args(argv)
    try:
        files = export(args.checkpoint, args.out_dir, dtype=args.dtype, max_shard_size=args.max_shard_size)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {', '.join(files)} to {args.out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
