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
import shutil
import sys
from typing import Any, Optional

from models import get_spec
from models.errors import ConfigError
from parallelisms.utils import DTYPES
from trainer.checkpoint import load_full_state, read_marker, verify_files
from trainer.hf import parse_size, save_hf


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
    extra, bos, eos, tokenizer_file = hf_sidecar(info, info["step"], os.path.abspath(checkpoint))
    files = save_hf(state, spec, args, out_dir, max_shard_bytes=parse_size(max_shard_size), dtype=DTYPES[dtype],
                    extra=extra, bos_id=bos, eos_id=eos)  # fmt: skip
    if tokenizer_file is not None:
        shutil.copyfile(tokenizer_file, os.path.join(out_dir, "tokenizer.json"))
        files.append("tokenizer.json")
    return files


def hf_sidecar(
    info: dict[str, Any], step: int, source: str
) -> tuple[dict[str, Any], Optional[int], Optional[int], Optional[str]]:
    """(``meshwright.json`` contents, bos id, eos id, the tokenizer.json to copy or None) of a HF
    folder written from a run whose marker fields are ``info`` (``trainer.checkpoint.model_info``)."""
    from trainer.tokenizer import build_tokenizer

    tokenizer = info.get("tokenizer", "byte")
    extra: dict[str, Any] = {"tokenizer": "byte", "model": info["model"], "step": step, "source": source}
    try:
        tok = build_tokenizer(tokenizer)
    except ConfigError:  # the tokenizer file moved: write the weights anyway
        return {**extra, "tokenizer": None}, None, None, None
    if tokenizer == "byte":
        return extra, tok.bos_id, tok.eos_id, None
    return {**extra, "tokenizer": "tokenizer.json"}, tok.bos_id, tok.eos_id, tokenizer


def _check_args(args: argparse.Namespace) -> None:
    """``ConfigError`` naming the bad argument before the checkpoint is read."""
    if parse_size(args.max_shard_size) <= 0:
        raise ConfigError(
            f"--max-shard-size={args.max_shard_size!r} must be a positive size, e.g. 5GB or 500MB."
        )
    if os.path.exists(args.out_dir) and not os.path.isdir(args.out_dir):
        raise ConfigError(
            f"out_dir {args.out_dir!r} is an existing file, not a folder; pass a folder (it is created if missing)."
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
