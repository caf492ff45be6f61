"""Export logic: a DCP checkpoint -> a Hugging Face folder, and the ``meshwright.json`` sidecar that
the checkpointer also writes beside its own HF exports (``hf_sidecar``); both add the tokenizer
files and ``generation_config.json`` (``trainer.checkpoint.hf_tokenizer``). The command line is
``python -m trainer.export_hf`` (``trainer/export_hf.py``)."""

from __future__ import annotations

import os
from typing import Any, Optional

from models import get_spec
from models.errors import ConfigError
from parallelisms.utils import DTYPES
from trainer.checkpoint.hf import parse_size, save_hf
from trainer.checkpoint.hf_tokenizer import write_tokenizer_files
from trainer.checkpoint.storage import load_full_state, read_marker, verify_files
from trainer.data.tokenizer import build_tokenizer

__all__ = ["export", "hf_sidecar"]


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
    extra, bos, eos, tokenizer = hf_sidecar(info, info["step"], os.path.abspath(checkpoint))
    files = save_hf(
        state,
        spec,
        args,
        out_dir,
        max_shard_bytes=parse_size(max_shard_size),
        dtype=DTYPES[dtype],
        extra=extra,
        bos_id=bos,
        eos_id=eos,
    )
    return files + write_tokenizer_files(out_dir, tokenizer, max_len=args.max_seq_len)


def hf_sidecar(
    info: dict[str, Any], step: int, source: str
) -> tuple[dict[str, Any], Optional[int], Optional[int], Optional[str]]:
    """(``meshwright.json`` contents, bos id, eos id, the run's tokenizer -- ``"byte"``, the
    tokenizer.json to ship, or None when that file is gone -- for ``write_tokenizer_files``) of a HF
    folder written from a run whose marker fields are ``info``
    (``trainer.checkpoint.checkpointer.model_info``)."""
    tokenizer = info.get("tokenizer", "byte")
    extra: dict[str, Any] = {"tokenizer": "byte", "model": info["model"], "step": step, "source": source}
    try:
        tok = build_tokenizer(tokenizer)
    except ConfigError:  # the tokenizer file moved: write the weights anyway
        return {**extra, "tokenizer": None}, None, None, None
    if tokenizer == "byte":
        return extra, tok.bos_id, tok.eos_id, "byte"
    return {**extra, "tokenizer": "tokenizer.json"}, tok.bos_id, tok.eos_id, tokenizer
