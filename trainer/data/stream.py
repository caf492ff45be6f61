"""Streaming without preparation (``data.streaming=true``): tokenize and pack on the fly.

Each data-parallel rank opens the source as a ``datasets`` IterableDataset (``streaming=True``:
hub datasets are never downloaded whole, local files are read incrementally) and takes its
own part with ``split_dataset_by_node``: whole files/shards per rank when their number
divides the dp degree, otherwise every rank reads the stream and keeps every dp-th row. The
rank tokenizes its documents, packs them into windows of ``seq_len + 1`` tokens (the same
overlapping layout as prepared data) or, with ``data.pack=false``, one padded window per
document, and reads them in order (no shuffling: shuffle the corpus beforehand, or prepare
it). Validation documents are held out by a hash of their text, which needs no global row
index. When a source ends, it starts over (next epoch).

Position: after every batch the loader knows, per source, the IterableDataset state before
the document at the head of its packing buffer and how many of its tokens were consumed.
A checkpoint stores that per dp rank (``stream_dp_rank<r>``) together with the global
sample count; a resumed run with the same dp degree re-opens the stream there, re-tokenizes
that document and continues with exactly the batch the uninterrupted run would have got.
The positions only describe the rank's own part of the stream, so a checkpoint cannot be
resumed under another dp degree: the loader refuses with both degrees named (prepared data,
``data=tokens``, reshards freely).

With ``data.sources``, global sample ``g`` comes from the source the mixture pattern assigns
to ``g`` (as for prepared data), each rank reading its own part of every source.
"""

from __future__ import annotations

import copy
import json
import logging
import time
import weakref
from collections import deque
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Optional

import numpy as np
import torch

from models.common import IGNORE_INDEX
from models.errors import ConfigError
from trainer.data.documents import _SOURCE_ALIASES, _expand_path, _root_cause, is_validation
from trainer.data.loader import check_dp_shard
from trainer.data.prefetch import Prefetcher
from trainer.data.tokenizer import Tokenizer, encode_documents
from trainer.data.windows import MIX_BLOCK, Batch, mixture_entry, mixture_names, mixture_pattern

if TYPE_CHECKING:
    from trainer.config import DataConfig

logger = logging.getLogger("meshwright")

STREAMABLE = ("text", "json", "parquet", "hub")
Window = tuple[np.ndarray, np.ndarray, np.ndarray]  # inputs, labels, positions: each (S,) int64


class SourceStream:
    """One source's documents for one dp rank, packed into windows, with a resumable position."""

    def __init__(
        self,
        cfg: DataConfig,
        path: str,
        tokenizer: Tokenizer,
        *,
        split: str,
        seq_len: int,
        dp_rank: int,
        dp_size: int,
    ) -> None:
        self.source = _SOURCE_ALIASES.get(cfg.source, cfg.source)
        if self.source not in STREAMABLE:
            raise ConfigError(
                f"data.streaming=true with data.source={cfg.source!r}: streaming reads "
                f"{list(STREAMABLE)}; prepared data (tokens) and builtin are not streamed"
            )
        if not path:
            raise ConfigError(
                f"data.path={path!r}: data.streaming=true needs a path (hub id, file, directory or glob)"
            )
        self.cfg, self.path, self.tokenizer = cfg, path, tokenizer
        self.split, self.seq_len, self.dp_rank, self.dp_size = split, seq_len, dp_rank, dp_size
        self.pack = bool(getattr(cfg, "pack", True))
        self.field = "text" if self.source == "text" else cfg.text_field
        if self.source != "hub":
            self.files = _expand_path(path, self.source)  # clear errors before any reading

    @staticmethod
    def initial_state() -> dict[str, Any]:
        return {"epoch": 0, "ds": None, "skip": 0}

    def _open(self) -> Any:
        import datasets
        from datasets.distributed import split_dataset_by_node

        try:
            if self.source == "hub":
                ds = datasets.load_dataset(self.path, self.cfg.name, split=self.cfg.split, streaming=True)
            else:
                kwargs = {"sample_by": "document"} if self.source == "text" else {}
                ds = datasets.load_dataset(
                    self.source, data_files={"train": self.files}, split="train", streaming=True, **kwargs
                )
        except Exception as err:
            raise ConfigError(
                f"cannot stream data.path={self.path!r} (data.source={self.source}): "
                f"{_root_cause(err)}; check the path/name (and network access for the hub)"
            ) from err
        return split_dataset_by_node(ds, rank=self.dp_rank, world_size=self.dp_size)

    def _documents(self, ds_state: Optional[dict]) -> Iterator[tuple[dict, dict, np.ndarray]]:
        """(state before, state after, ``[bos] tokens [eos]``) of this rank's documents of the split."""
        ds = self._open()
        if ds_state is not None:
            ds.load_state_dict(ds_state)
        it = iter(ds)
        want_val = self.split == "validation"
        val_fraction = float(self.cfg.val_fraction)
        while True:
            before = ds.state_dict()
            try:
                row = next(it)
            except StopIteration:
                return
            if self.field not in row:
                raise ConfigError(
                    f"data.text_field={self.field!r} is not a column of data.path={self.path!r} "
                    f"(columns: {sorted(row)}); set data.text_field to the text column"
                )
            text = row[self.field]
            if text is None:
                continue
            if not isinstance(text, str):
                raise ConfigError(
                    f"data.text_field={self.field!r} holds {type(text).__name__} values in "
                    f"data.path={self.path!r}, not text; set data.text_field to the text column"
                )
            if is_validation(text, val_fraction) != want_val:
                continue
            tokens, _ = encode_documents(self.tokenizer, [text], np.dtype(np.int64))
            yield before, ds.state_dict(), tokens

    def _packed(self, state: dict[str, Any]) -> Iterator[tuple[Window, dict[str, Any]]]:
        """Overlapping windows of ``S + 1`` tokens across documents, from ``state`` on."""
        S = self.seq_len
        head: deque[tuple[dict, np.ndarray]] = deque()  # documents still (partly) in the buffer
        offset = state["skip"]  # consumed tokens of head[0]
        avail = -offset
        for before, _, tokens in self._documents(state["ds"]):
            head.append((before, tokens))
            avail += len(tokens)
            while avail >= S + 1:
                parts, pos_parts, need, i, o = [], [], S + 1, 0, offset
                while need:
                    doc = head[i][1]
                    take = min(need, len(doc) - o)
                    parts.append(doc[o : o + take])
                    pos_parts.append(np.arange(take))  # restart at the window and at each document
                    need, i, o = need - take, i + 1, 0
                row, pos = np.concatenate(parts), np.concatenate(pos_parts)
                offset, avail = offset + S, avail - S
                while offset >= len(head[0][1]):
                    offset -= len(head.popleft()[1])
                yield (
                    (row[:-1], row[1:], pos[:-1]),
                    {"epoch": state["epoch"], "ds": head[0][0], "skip": offset},
                )

    def _per_document(self, state: dict[str, Any]) -> Iterator[tuple[Window, dict[str, Any]]]:
        """One window per document: truncated to ``S + 1`` tokens, padded, labels ignored there."""
        S = self.seq_len
        for _, after, tokens in self._documents(state["ds"]):
            row = tokens[: S + 1]
            n = len(row) - 1
            inputs = np.full(S, self.tokenizer.eos_id, dtype=np.int64)
            labels = np.full(S, IGNORE_INDEX, dtype=np.int64)
            inputs[:n], labels[:n] = row[:-1], row[1:]
            yield (inputs, labels, np.arange(S)), {"epoch": state["epoch"], "ds": after, "skip": 0}

    def windows(self, state: dict[str, Any]) -> Iterator[tuple[Window, dict[str, Any]]]:
        """Windows from ``state`` on, forever (a source that ends starts its next epoch)."""
        state = copy.deepcopy(state)
        while True:
            produced = False
            for item in (self._packed if self.pack else self._per_document)(state):
                produced = True
                yield item
            if not produced and state["ds"] is None:
                raise ConfigError(
                    f"the {self.split} split of data.path={self.path!r} has no window of "
                    f"seq_len={self.seq_len} "
                    f"for dp rank {self.dp_rank} of {self.dp_size}; add data, lower training.seq_len, or "
                    "(validation) raise data.val_fraction"
                )
            state = {"epoch": state["epoch"] + 1, "ds": None, "skip": 0}


def _produce(
    streams: list[SourceStream],
    states: list[dict[str, Any]],
    start: int,
    global_batch_size: int,
    local: int,
    rank: int,
    pattern: Optional[np.ndarray],
) -> Iterator[tuple[Batch, tuple[int, list]]]:
    """Local batches from ``start`` on, each with (global samples after it, per-source states)."""
    states = copy.deepcopy(states)
    iters = [s.windows(st) for s, st in zip(streams, states)]
    while True:
        first = start + rank * local
        rows = []
        for g in range(first, first + local):
            src = 0 if pattern is None else int(pattern[g % MIX_BLOCK])
            window, states[src] = next(iters[src])
            rows.append(window)
        inputs, labels, positions = (torch.from_numpy(np.stack(x)) for x in zip(*rows))
        start += global_batch_size
        yield Batch(inputs, labels, positions), (start, copy.deepcopy(states))


class StreamingDataLoader:
    """Per-rank streaming loader with the :class:`~trainer.data.loader.DataLoader` interface."""

    def __init__(
        self,
        cfg: DataConfig,
        tokenizer: Tokenizer,
        *,
        split: str,
        seq_len: int,
        global_batch_size: int,
        dp_rank: int,
        dp_size: int,
        prefetch: int = 0,
        pin_memory: bool = False,
    ) -> None:
        check_dp_shard(dp_rank, dp_size, global_batch_size)
        entries = [mixture_entry(e) for e in (getattr(cfg, "sources", None) or [])] or [(cfg.path, 1.0)]
        for i, (_, w) in enumerate(entries):
            if w <= 0:
                raise ConfigError(f"data.sources[{i}].weight={w} must be > 0; drop the source instead")
        self.names = mixture_names([p for p, _ in entries])
        self.weights = [w for _, w in entries]
        self.streams = [
            SourceStream(cfg, p, tokenizer, split=split, seq_len=seq_len, dp_rank=dp_rank, dp_size=dp_size)
            for p, _ in entries
        ]
        self.pattern = mixture_pattern(self.weights)[0] if len(entries) > 1 else None
        self.global_batch_size, self.local_batch_size = global_batch_size, global_batch_size // dp_size
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.prefetch, self.pin_memory = prefetch, pin_memory
        self.samples_seen = 0
        self._states = [SourceStream.initial_state() for _ in self.streams]
        self._prefetcher: Optional[Prefetcher] = None
        self._iter: Optional[Iterator] = None
        self._prefetch_pos = -1
        self._wait_s, self._waits = 0.0, 0
        if dp_rank == 0:
            logger.info(
                f"data: streaming the {split} split of {', '.join(p for p, _ in entries)} "
                f"(each of {dp_size} dp ranks reads its own part)"
            )

    def _iterator(self) -> Iterator[tuple[Batch, tuple[int, list]]]:
        return _produce(
            self.streams,
            self._states,
            self.samples_seen,
            self.global_batch_size,
            self.local_batch_size,
            self.dp_rank,
            self.pattern,
        )

    def next_batch(self) -> Batch:
        """This rank's next ``global_batch_size // dp_size`` windows."""
        if self._iter is None or self._prefetch_pos != self.samples_seen:
            self.close()  # the position was moved (resume, reset): reopen the streams there
            it = self._iterator()
            if self.prefetch > 0:
                self._prefetcher = Prefetcher(lambda: it, self.prefetch, self.pin_memory)
                weakref.finalize(self, self._prefetcher.close)  # the thread never outlives the loader
            self._iter = it
        if self._prefetcher is not None:
            batch, (self._prefetch_pos, states), waited = self._prefetcher.get()
        else:
            start = time.perf_counter()
            batch, (self._prefetch_pos, states) = next(self._iter)
            waited = time.perf_counter() - start
        self.samples_seen, self._states = self._prefetch_pos, states
        self._wait_s += waited
        self._waits += 1
        return batch

    def pop_metrics(self) -> dict[str, float]:
        """Mean seconds ``next_batch`` blocked per call since the last pop."""
        out = {"data_wait_s": self._wait_s / max(self._waits, 1)}
        self._wait_s, self._waits = 0.0, 0
        return out

    def reset(self) -> None:
        """Back to the start of every stream (validation restarts before each evaluation)."""
        self.close()
        self.samples_seen = 0
        self._states = [SourceStream.initial_state() for _ in self.streams]

    def close(self) -> None:
        """Stop the background thread and drop the open streams."""
        if self._prefetcher is not None:
            self._prefetcher.close()
            self._prefetcher = None
        self._iter = None

    def _key(self) -> str:
        return f"stream_dp_rank{self.dp_rank}"

    def state_dict(self) -> dict[str, Any]:
        """Global sample count, dp degree, and this rank's stream positions (JSON)."""
        return {
            "samples_seen": self.samples_seen,
            "global_batch_size": self.global_batch_size,
            "stream_dp_size": self.dp_size,
            "stream_sources": ";".join(f"{n}:{w:g}" for n, w in zip(self.names, self.weights)),
            self._key(): json.dumps(self._states),
        }

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """Resume this rank's streams where the checkpoint left them (same dp degree only)."""
        if "stream_dp_size" not in sd:
            raise ConfigError(
                "the checkpoint's data position is not a streaming one (data.streaming changed); "
                "resume with the same data settings or start a fresh job.dump_folder"
            )
        if int(sd["stream_dp_size"]) != self.dp_size or self._key() not in sd:
            raise ConfigError(
                f"the checkpoint streamed data with {sd['stream_dp_size']} data-parallel ranks, this run has "
                f"{self.dp_size}: streaming positions are per rank and cannot be resharded. Resume with the "
                "same data-parallel degree, or prepare the corpus (trainer.prepare_data, data=tokens), "
                "whose position reshards freely"
            )
        sources = ";".join(f"{n}:{w:g}" for n, w in zip(self.names, self.weights))
        if sd.get("stream_sources", sources) != sources:
            raise ConfigError(
                f"the checkpoint streamed {sd['stream_sources']}, this run streams {sources}; "
                "resume with the same data.path/data.sources"
            )
        if int(sd["global_batch_size"]) != self.global_batch_size:
            raise ConfigError(
                f"checkpoint has training.global_batch_size={sd['global_batch_size']}, this run "
                f"{self.global_batch_size}: a streaming position continues only with the same batch layout"
            )
        self.close()
        self.samples_seen = int(sd["samples_seen"])
        self._states = json.loads(sd[self._key()])
