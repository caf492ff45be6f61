"""Named validation sets (``eval.validation``): each its own loader, token-weighted loss and perplexity.

A set is a data source read with the run's tokenizer and ``training.seq_len``, sharded over the
data-parallel ranks like the run's own validation split (``training.eval_freq`` /
``training.eval_steps``), so its loss is the mean over every target token of its batches, the
same under every layout. ``split``: ``validation`` (the share held out by the hash of each
document's key, ``val_fraction``, as ``data.val_fraction`` holds out for training), ``train``
(the rest) or ``all`` (every document: a file kept for validation only).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from trainer.data import build_dataloader
from trainer.data.tokenizer import Tokenizer

if TYPE_CHECKING:
    from trainer.config import DataConfig
    from trainer.eval.config import ValidationSource

__all__ = ["build_validation_loaders"]


def _data_config(run_data: DataConfig, v: ValidationSource) -> tuple[DataConfig, str]:
    """The run's data config with the set's source (no mixture, no streaming, no shuffling) and its split."""
    cfg = dataclasses.replace(
        run_data,
        source=v.source,
        path=v.path,
        text_field=v.text_field,
        max_documents=v.max_documents,
        val_fraction=0.0 if v.split == "all" else v.val_fraction,
        sources=[],
        streaming=False,
        shuffle=False,
        prefetch=0,
        name=None,
        split="train",
    )
    return cfg, ("train" if v.split == "all" else v.split)


def build_validation_loaders(
    sets: dict[str, ValidationSource],
    run_data: DataConfig,
    tokenizer: Tokenizer,
    *,
    seq_len: int,
    batch_size: int,
    dp_rank: int,
    dp_size: int,
    seed: int,
    default_steps: int,
) -> dict[str, tuple[Any, int]]:
    """name -> (loader, batches per evaluation); read and tokenized before any collective."""
    out = {}
    for name, v in sets.items():
        cfg, split = _data_config(run_data, v)
        loader = build_dataloader(
            cfg,
            tokenizer,
            split=split,
            seq_len=seq_len,
            global_batch_size=batch_size,
            dp_rank=dp_rank,
            dp_size=dp_size,
            seed=seed,
        )
        out[name] = (loader, v.steps or default_steps)
    return out
