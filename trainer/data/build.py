"""``build_dataloader``: the loader of a split for a data config, for every source.

Prepared folders and in-memory sources go through ``loader.DataLoader``; streamed corpora through
``stream.StreamingDataLoader``. Both loaders are independent of this module (one-way imports).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING, Any, Optional

import torch

from models.errors import ConfigError
from trainer.data.batch_ramp import BatchRamp
from trainer.data.documents import _SOURCE_ALIASES, load_documents
from trainer.data.loader import DataLoader, check_enough_windows, tokenize_with_starts
from trainer.data.prepared import open_split
from trainer.data.stream import StreamingDataLoader
from trainer.data.tokenizer import Tokenizer
from trainer.data.windows import (
    ArrayStore,
    DocWindows,
    Mixture,
    PackedWindows,
    SampleOrder,
    TokenWindows,
    mixture_entry,
    mixture_names,
)

if TYPE_CHECKING:
    from trainer.config import DataConfig

__all__ = ["build_dataloader"]

logger = logging.getLogger("meshwright")

_SOURCE_SEED_STRIDE = 1_000_003  # mixture source i shuffles with seed + i * stride


def _source_windows(cfg: DataConfig, tokenizer: Tokenizer, split: str, seq_len: int) -> tuple[Any, str]:
    """Windows of one source (a prepared folder or raw documents read into memory) and a description."""
    source = _SOURCE_ALIASES.get(cfg.source, cfg.source)
    pack = bool(getattr(cfg, "pack", True))
    if source == "tokens":
        if not cfg.path:
            raise ConfigError("data.source=tokens needs data.path=<folder made by trainer.prepare_data>")
        store: Any = open_split(cfg.path, split, tokenizer)
        what = f"the {split} split of prepared data {cfg.path!r} ({store.num_docs} documents)"
        if not store.num_docs:
            raise ConfigError(
                f"{what} is empty (it was prepared with a val_fraction that held nothing out); "
                "prepare with data.val_fraction>0 or disable evaluation (training.eval_freq=0)"
            )
        windows = PackedWindows(store, seq_len) if pack else DocWindows(store, seq_len, tokenizer.eos_id)
        return windows, what
    docs = load_documents(cfg, split)
    if not docs:  # validation with val_fraction=0 (train emptiness is caught in load_documents)
        raise ConfigError(
            f"the {split} split is empty (data.val_fraction={cfg.val_fraction}); "
            "set data.val_fraction>0 or disable evaluation (training.eval_freq=0)"
        )
    tokens, starts = tokenize_with_starts(docs, tokenizer)
    if pack:
        return TokenWindows(tokens, seq_len, starts), f"the {split} split ({len(docs)} documents)"
    return DocWindows(
        ArrayStore(tokens, starts), seq_len, tokenizer.eos_id
    ), f"the {split} split ({len(docs)} documents)"


def build_dataloader(
    cfg: DataConfig,
    tokenizer: Tokenizer,
    *,
    split: str,
    seq_len: int,
    global_batch_size: int,
    dp_rank: int,
    dp_size: int,
    seed: int,
    pin_memory: Optional[bool] = None,
    ramp: Optional[BatchRamp] = None,
) -> Any:
    """The loader of ``split`` for the data config ``cfg``.

    Prepared folders (``data.source=tokens``) are read window by window; raw sources are read and
    tokenized into memory (``builtin``, ``text``, ``json``, ``parquet``, ``hub``), or
    streamed when ``data.streaming=true``; ``data.sources`` mixes several of one kind.
    Only the training split is shuffled (if ``data.shuffle``). ``pin_memory`` defaults to
    whether CUDA is available. ``ramp``: ``training.batch_ramp`` (never with streaming).
    """
    pin = torch.cuda.is_available() if pin_memory is None else pin_memory
    prefetch = int(getattr(cfg, "prefetch", 0))
    if getattr(cfg, "streaming", False):
        return StreamingDataLoader(
            cfg,
            tokenizer,
            split=split,
            seq_len=seq_len,
            global_batch_size=global_batch_size,
            dp_rank=dp_rank,
            dp_size=dp_size,
            prefetch=prefetch,
            pin_memory=pin,
        )
    shuffle = bool(cfg.shuffle) and split == "train"
    entries = [mixture_entry(e) for e in (getattr(cfg, "sources", None) or [])]
    if not entries:
        windows, what = _source_windows(cfg, tokenizer, split, seq_len)
        check_enough_windows(windows, global_batch_size, what)
        if dp_rank == 0:
            logger.info(f"data: {what}: {windows.num_tokens:,} tokens, {windows.num_windows:,} windows")
        return DataLoader(
            windows,
            global_batch_size=global_batch_size,
            dp_rank=dp_rank,
            dp_size=dp_size,
            seed=seed,
            shuffle=shuffle,
            prefetch=prefetch,
            pin_memory=pin,
            ramp=ramp,
        )
    orders, names = [], mixture_names([p for p, _ in entries])
    for i, (path, weight) in enumerate(entries):
        if weight <= 0:
            raise ConfigError(f"data.sources[{i}].weight={weight} must be > 0; drop the source instead")
        windows, what = _source_windows(
            dataclasses.replace(cfg, path=path, sources=[]), tokenizer, split, seq_len
        )
        check_enough_windows(windows, 1, what)
        orders.append(SampleOrder(windows, seed + i * _SOURCE_SEED_STRIDE, shuffle))
    mixture = Mixture(orders, [w for _, w in entries], names)
    if dp_rank == 0:
        shares = ", ".join(
            f"{n} {w / sum(mixture.weights):.3f} ({o.num_windows:,} windows)"
            for n, w, o in zip(names, mixture.weights, orders)
        )
        logger.info(f"data: {split} mixture of {len(orders)} sources, target shares {shares}")
    return DataLoader(
        mixture,
        global_batch_size=global_batch_size,
        dp_rank=dp_rank,
        dp_size=dp_size,
        seed=seed,
        shuffle=shuffle,
        prefetch=prefetch,
        pin_memory=pin,
        ramp=ramp,
    )
