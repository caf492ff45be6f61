"""Export a checkpoint to a Hugging Face folder (Llama; Mixtral or Qwen3-MoE for the MoE family).

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
import sys

from models.errors import ConfigError
from parallelisms.utils import DTYPES
from trainer.checkpoint.export import export
from trainer.checkpoint.hf import parse_size


def _check_args(args: argparse.Namespace) -> None:
    """``ConfigError`` naming the bad argument before the checkpoint is read."""
    if parse_size(args.max_shard_size) <= 0:
        raise ConfigError(
            f"--max-shard-size={args.max_shard_size!r} must be a positive size, e.g. 5GB or 500MB."
        )
    if os.path.exists(args.out_dir) and not os.path.isdir(args.out_dir):
        raise ConfigError(
            f"out_dir {args.out_dir!r} is an existing file, not a folder; pass a folder (it is created if "
            "missing)."
        )
    if not os.path.isdir(args.checkpoint):
        what = "is a file, not a folder" if os.path.exists(args.checkpoint) else "does not exist"
        raise ConfigError(f"checkpoint {args.checkpoint!r} {what}; pass a complete step-N folder.")


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
        _check_args(args)
        files = export(args.checkpoint, args.out_dir, dtype=args.dtype, max_shard_size=args.max_shard_size)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {', '.join(files)} to {args.out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
