"""Hugging Face export: a DCP checkpoint -> a HF folder (``export``, the command line
``python -m trainer.export_hf``, ``trainer/export_hf.py``), the live model of a run -> ``<folder>/step-N-hf``
at its last step (``save_hf_step``, ``checkpoint.last_save_in_hf``; the ``Checkpointer`` calls it), and
the ``meshwright.json`` sidecar both write (``hf_sidecar``); both add the tokenizer files and
``generation_config.json`` (``trainer.checkpoint.hf_tokenizer``)."""

from __future__ import annotations

import logging
import os
import shutil
import time
from typing import TYPE_CHECKING, Any, Optional

import torch.distributed as dist
from torch import nn

from models import get_spec
from models.errors import ConfigError
from models.spec import ModelArgs, decoder_args
from parallelisms.utils import DTYPES
from trainer.checkpoint.hf import parse_size, save_hf, save_hf_distributed
from trainer.checkpoint.hf_tokenizer import write_tokenizer_files
from trainer.checkpoint.storage import (
    fsync_dir,
    hf_step_dir,
    load_full_state,
    make_dir,
    read_marker,
    step_dir,
    verify_files,
)
from trainer.data.tokenizer import build_tokenizer

if TYPE_CHECKING:
    from models.spec import ModelSpec
    from trainer.config import CheckpointConfig

__all__ = ["export", "hf_sidecar", "save_hf_step"]

logger = logging.getLogger("meshwright")


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
    return files + write_tokenizer_files(out_dir, tokenizer, max_len=decoder_args(args).max_seq_len)


def hf_sidecar(
    info: dict[str, Any], step: int, source: str
) -> tuple[dict[str, Any], Optional[int], Optional[int], Optional[str]]:
    """(``meshwright.json`` contents, bos id, eos id, the run's tokenizer -- ``"byte"``, the
    tokenizer.json to ship, or None when that file is gone -- for ``write_tokenizer_files``) of a HF
    folder written from a run whose marker fields are ``info``
    (``trainer.checkpoint.contents.model_info``)."""
    tokenizer = info.get("tokenizer", "byte")
    extra: dict[str, Any] = {"tokenizer": "byte", "model": info["model"], "step": step, "source": source}
    try:
        tok = build_tokenizer(tokenizer)
    except ConfigError:  # the tokenizer file moved: write the weights anyway
        return {**extra, "tokenizer": None}, None, None, None
    if tokenizer == "byte":
        return extra, tok.bos_id, tok.eos_id, "byte"
    return {**extra, "tokenizer": "tokenizer.json"}, tok.bos_id, tok.eos_id, tokenizer


def save_hf_step(
    module: nn.Module,
    target: tuple[ModelSpec, ModelArgs],  # (spec, the family's args)
    cfg: CheckpointConfig,
    info: dict[str, Any],
    step: int,
    *,
    folder: str,
    token: str,
    group: Optional[dist.ProcessGroup] = None,
) -> str:
    """Write the live ``module`` (``one_module`` of the run's parts, any layout but PP) as a Hugging Face
    folder ``<folder>/step-N-hf`` (as ``export`` would from the checkpoint of ``step``); return its path.
    Collective over ``group``; ``info`` is the run's marker fields (``model_info``), ``target`` its
    (spec, model args), ``token`` names the temporary folder.

    One tensor is gathered at a time and rank 0 writes each safetensors file as soon as it is
    full (``trainer.checkpoint.hf.save_hf_distributed``). Atomic like a checkpoint: written into
    ``step-N-hf.tmp-<token>`` and renamed when complete, replacing an older folder of that step.
    """
    rank = dist.get_rank()
    start = time.perf_counter()
    final = hf_step_dir(folder, step)
    tmp = f"{final}.tmp-{token}"
    if rank == 0:
        make_dir(folder)
        make_dir(tmp)
    source = os.path.abspath(step_dir(folder, step) if cfg.enable else folder)
    extra, bos, eos, tokenizer = hf_sidecar(info, step, source)
    spec, args = target
    files = save_hf_distributed(
        module,
        spec,
        args,
        tmp,
        is_writer=rank == 0,
        max_shard_bytes=parse_size(cfg.hf_max_shard_size),
        dtype=DTYPES[cfg.hf_dtype],
        extra=extra,
        bos_id=bos,
        eos_id=eos,
    )
    if rank == 0:
        files += write_tokenizer_files(tmp, tokenizer, max_len=decoder_args(args).max_seq_len)
        _commit_folder(tmp, final, f"{final}.trash-{token}")
    dist.barrier(group=group)  # the folder is complete once save_hf_step() returns anywhere
    logger.info(
        f"Hugging Face weights of step {step} ({len(files)} files) saved to {final} in "
        f"{time.perf_counter() - start:.2f}s"
    )
    return final


def _commit_folder(tmp: str, final: str, trash: str) -> None:
    """Rank 0: fsync every file of ``tmp``, then rename it to ``final`` (an older ``final`` goes to
    ``trash`` first and is deleted after)."""
    for name in os.listdir(tmp):
        with open(os.path.join(tmp, name), "rb") as f:
            os.fsync(f.fileno())
    if os.path.exists(final):
        os.rename(final, trash)
    os.rename(tmp, final)
    fsync_dir(os.path.dirname(final))
    shutil.rmtree(trash, ignore_errors=True)
