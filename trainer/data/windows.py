"""Token stores, windows and the global sample order.

A *store* is one split's flat token stream ``[bos] doc [eos] [bos] doc [eos] ...`` with the
start of every document: an in-memory array (small sources) or prepared shards
(read window by window, never whole). *Windows* cut it into samples:

* packed (``data.pack=true``): window ``k`` is ``flat[k*S : k*S + S + 1]`` (inputs = ``[:-1]``,
  labels = ``[1:]``), so consecutive windows overlap by one token and every token except the
  first is a label once; windows cross document boundaries;
* per document (``data.pack=false``): window ``k`` is document ``k`` truncated to ``S + 1``
  tokens, padded to ``S`` with labels set to the ignore index.

Every batch also carries ``positions`` for block-causal attention: each input token's offset from
the start of its document *or of the window*, whichever is later. A position restarts at 0 at
every BOS and at the window's first token (a document that began in an earlier window continues
from 0), as Megatron-LM's ``reset_position_ids`` does. So a position is always ``< seq_len <=
model.max_seq_len`` whatever the document lengths, and the positions equal what
``trainer.step.document_positions`` derives from the window's tokens alone (BOS/EOS), which CP,
PP, evaluation, streaming and prepared shards therefore all agree on.

The *order* maps a global sample index to a window: global sample ``g`` is window
``perm_e[g % N]`` of epoch ``e = g // N``. ``perm_e`` is ``torch.randperm(N)`` seeded with
``seed + e`` up to ``RANDPERM_MAX_WINDOWS`` windows (the order the in-memory loader always
had, so prepared shards of the same corpus give the same batches), and above that a
seeded Feistel permutation computed per index in O(1) memory, so start-up and resident
memory do not grow with the corpus. A :class:`Mixture` interleaves several orders by a
fixed weighted pattern of the global sample index.
"""

from __future__ import annotations

import os
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Optional, Protocol

import numpy as np
import torch

from models.common import IGNORE_INDEX
from models.errors import ConfigError

RANDPERM_MAX_WINDOWS = 1 << 22  # 32 MiB of int64 per cached epoch permutation at most
MIX_BLOCK = 10_000  # mixture pattern period: weights are realised exactly every 10k samples

# ---------------------------------------------------------------------------------- batch


@dataclass
class Batch:
    """One local batch: next-token prediction pairs and per-document token positions."""

    inputs: torch.Tensor  # (b, S) int64
    labels: torch.Tensor  # (b, S) int64; IGNORE_INDEX where nothing is predicted (padding)
    positions: Optional[torch.Tensor] = None  # (b, S) int64, restarting at 0 at every document

    def pin_memory(self) -> Batch:
        """Page-locked copies, so ``.to(cuda, non_blocking=True)`` overlaps with compute."""
        pin = lambda t: None if t is None else t.pin_memory()  # noqa: E731
        return Batch(pin(self.inputs), pin(self.labels), pin(self.positions))

    @staticmethod
    def cat(parts: Sequence[Batch]) -> Batch:
        """Rows of ``parts`` stacked in order (positions kept only if every part has them)."""
        positions = None
        if all(p.positions is not None for p in parts):
            positions = torch.cat([p.positions for p in parts])  # type: ignore[misc]
        return Batch(torch.cat([p.inputs for p in parts]), torch.cat([p.labels for p in parts]), positions)


# --------------------------------------------------------------------------------- stores


class TokenStore(Protocol):
    """One split's flat token stream and its document boundaries."""

    num_tokens: int
    num_docs: int  # 0 when boundaries are unknown

    def read(self, start: int, stop: int) -> np.ndarray:
        """Tokens ``[start, stop)`` as a fresh int64 array."""
        ...

    def doc_starts(self, docs: np.ndarray) -> np.ndarray:
        """Token offset where each document begins (``num_tokens`` for ``num_docs``)."""
        ...

    def doc_of(self, positions: np.ndarray) -> np.ndarray:
        """Index of the document holding each token position."""
        ...


class ArrayStore:
    """A store held in memory: a 1-D token tensor and (optionally) its document starts."""

    def __init__(self, tokens: torch.Tensor, doc_starts: Optional[np.ndarray] = None) -> None:
        self.tokens = tokens
        self._np = tokens.numpy()
        self.num_tokens = int(tokens.numel())
        self._starts = None if doc_starts is None else np.asarray(doc_starts, dtype=np.int64)
        self.num_docs = 0 if self._starts is None else len(self._starts)

    def read(self, start: int, stop: int) -> np.ndarray:
        return self._np[start:stop].astype(np.int64)

    def doc_starts(self, docs: np.ndarray) -> np.ndarray:
        assert self._starts is not None  # callers check num_docs first
        return np.append(self._starts, self.num_tokens)[docs]

    def doc_of(self, positions: np.ndarray) -> np.ndarray:
        assert self._starts is not None
        return np.searchsorted(self._starts, positions, side="right") - 1


class ShardStore:
    """Prepared shards: flat token files that are never read whole.

    A window is read with one positioned read (``os.pread``) of exactly its bytes, so no page
    of the corpus is mapped into the process: resident memory grows neither with the corpus
    nor with training time (a ``numpy.memmap``'s touched pages count as resident and pile up
    over a run, with kernel read-ahead on top). The per-shard document starts (``.docs.npy``)
    are opened with ``numpy.memmap`` on first use (binary searches touch a few pages).
    Documents never cross shards; opening a store costs O(number of shards), not O(tokens).
    """

    def __init__(
        self,
        token_files: list[str],
        doc_files: list[str],
        shard_tokens: list[int],
        shard_docs: list[int],
        dtype: np.dtype,
    ) -> None:
        self._token_files, self._doc_files, self.dtype = token_files, doc_files, np.dtype(dtype)
        self._offsets = np.concatenate([[0], np.cumsum(shard_tokens, dtype=np.int64)])  # (shards+1,)
        self._doc_offsets = np.concatenate([[0], np.cumsum(shard_docs, dtype=np.int64)])
        self.num_tokens = int(self._offsets[-1])
        self.num_docs = int(self._doc_offsets[-1])
        self._starts: dict[int, np.ndarray] = {}

    def _shard_starts(self, s: int) -> np.ndarray:
        if s not in self._starts:
            self._starts[s] = np.load(self._doc_files[s], mmap_mode="r")
        return self._starts[s]

    def _pread(self, s: int, start: int, stop: int) -> np.ndarray:
        """Tokens ``[start, stop)`` of shard ``s`` (shard-local offsets)."""
        size = self.dtype.itemsize
        fd = os.open(self._token_files[s], os.O_RDONLY)
        try:
            data = os.pread(fd, (stop - start) * size, start * size)
        finally:
            os.close(fd)
        return np.frombuffer(data, dtype=self.dtype)

    def read(self, start: int, stop: int) -> np.ndarray:
        out = np.empty(stop - start, dtype=np.int64)
        s = int(np.searchsorted(self._offsets, start, side="right")) - 1
        pos = start
        while pos < stop:  # a window spans at most a few shards
            end = min(stop, int(self._offsets[s + 1]))
            base = int(self._offsets[s])
            out[pos - start : end - start] = self._pread(s, pos - base, end - base)
            pos, s = end, s + 1
        return out

    def doc_starts(self, docs: np.ndarray) -> np.ndarray:
        docs = np.asarray(docs, dtype=np.int64)
        out = np.full(docs.shape, self.num_tokens, dtype=np.int64)
        shards = np.searchsorted(self._doc_offsets, docs, side="right") - 1
        for s in np.unique(shards[docs < self.num_docs]).tolist():
            mask = (shards == s) & (docs < self.num_docs)
            out[mask] = self._shard_starts(s)[docs[mask] - self._doc_offsets[s]] + self._offsets[s]
        return out

    def doc_of(self, positions: np.ndarray) -> np.ndarray:
        positions = np.asarray(positions, dtype=np.int64)
        shards = np.searchsorted(self._offsets, positions, side="right") - 1
        out = np.empty(positions.shape, dtype=np.int64)
        for s in np.unique(shards).tolist():
            mask = shards == s
            local = (
                np.searchsorted(self._shard_starts(s), positions[mask] - self._offsets[s], side="right") - 1
            )
            out[mask] = local + self._doc_offsets[s]
        return out


# -------------------------------------------------------------------------------- windows


class PackedWindows:
    """A store cut into ``num_windows`` overlapping windows of ``seq_len + 1`` tokens."""

    def __init__(self, store: TokenStore, seq_len: int) -> None:
        if seq_len < 1:
            raise ConfigError(f"training.seq_len={seq_len} must be >= 1")
        self.store = store
        self.seq_len = seq_len
        self.num_tokens = store.num_tokens
        self.num_windows = max(self.num_tokens - 1, 0) // seq_len

    def _check(self, indices: torch.Tensor) -> None:
        if len(indices) and not (0 <= int(indices.min()) and int(indices.max()) < self.num_windows):
            raise IndexError(f"window indices {indices.tolist()} out of range [0, {self.num_windows})")

    def _rows(self, indices: torch.Tensor) -> torch.Tensor:
        """(b, S+1) int64 tokens of windows ``indices``."""
        S = self.seq_len
        rows = [self.store.read(k * S, k * S + S + 1) for k in indices.tolist()]
        return torch.from_numpy(np.stack(rows)) if rows else torch.empty(0, S + 1, dtype=torch.long)

    def positions(self, indices: torch.Tensor) -> Optional[torch.Tensor]:
        """(b, S) position of every input token: its offset from the later of its document's start
        and the window's start (see the module docstring); None without boundaries."""
        if not self.store.num_docs:
            return None
        window_starts = indices.numpy()[:, None] * self.seq_len  # (b, 1)
        tokens = window_starts + np.arange(self.seq_len)  # (b, S)
        starts = self.store.doc_starts(self.store.doc_of(tokens.ravel())).reshape(tokens.shape)
        # A document that began before the window restarts at 0 there, so a position is < seq_len.
        return torch.from_numpy(tokens - np.maximum(starts, window_starts))

    def window(self, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, labels) of window ``k``, each (S,) int64."""
        if not 0 <= k < self.num_windows:
            raise IndexError(f"window {k} out of range [0, {self.num_windows})")
        row = self._rows(torch.tensor([k]))[0]
        return row[:-1], row[1:]

    def gather(self, indices: torch.Tensor) -> Batch:
        """Windows ``indices`` stacked into a :class:`Batch` of shape (len(indices), S)."""
        self._check(indices)
        rows = self._rows(indices)  # (b, S+1)
        return Batch(rows[:, :-1].contiguous(), rows[:, 1:].contiguous(), self.positions(indices))


class TokenWindows(PackedWindows):
    """Packed windows over an in-memory 1-D token tensor (a strided view, no copy)."""

    def __init__(self, tokens: torch.Tensor, seq_len: int, doc_starts: Optional[np.ndarray] = None) -> None:
        if tokens.dim() != 1 or tokens.is_floating_point():
            raise ConfigError(
                f"tokens must be a 1-D integer tensor, got shape {tuple(tokens.shape)} {tokens.dtype}"
            )
        super().__init__(ArrayStore(tokens, doc_starts), seq_len)
        self.tokens = tokens
        # Row k = tokens[k*S : k*S + S + 1].
        self._view = (
            tokens.unfold(0, seq_len + 1, seq_len) if self.num_windows else tokens.new_empty(0, seq_len + 1)
        )

    def _rows(self, indices: torch.Tensor) -> torch.Tensor:
        return self._view[indices].long()


class DocWindows:
    """One window per document (``data.pack=false``): truncated to ``seq_len + 1`` tokens,
    inputs padded with EOS and labels with the ignore index; positions count from 0."""

    def __init__(self, store: TokenStore, seq_len: int, pad_id: int) -> None:
        if seq_len < 1:
            raise ConfigError(f"training.seq_len={seq_len} must be >= 1")
        if not store.num_docs:
            raise ConfigError("data.pack=false needs document boundaries, which this data does not have")
        self.store, self.seq_len, self.pad_id = store, seq_len, pad_id
        self.num_tokens = store.num_tokens
        self.num_windows = store.num_docs

    def gather(self, indices: torch.Tensor) -> Batch:
        S, b = self.seq_len, len(indices)
        docs = indices.numpy()
        starts = self.store.doc_starts(docs)
        ends = self.store.doc_starts(docs + 1)
        inputs = torch.full((b, S), self.pad_id, dtype=torch.long)
        labels = torch.full((b, S), IGNORE_INDEX, dtype=torch.long)
        for i, (a, e) in enumerate(zip(starts.tolist(), ends.tolist())):
            row = torch.from_numpy(self.store.read(a, min(e, a + S + 1)))
            n = len(row) - 1
            inputs[i, :n], labels[i, :n] = row[:-1], row[1:]
        return Batch(inputs, labels, torch.arange(S).expand(b, S).clone())


class Windows(Protocol):
    """What the sample order needs from windows."""

    seq_len: int
    num_tokens: int
    num_windows: int

    def gather(self, indices: torch.Tensor) -> Batch: ...


# ---------------------------------------------------------------------------------- order


def feistel_permutation(x: np.ndarray, n: int, seed: int) -> np.ndarray:
    """A seeded pseudo-random bijection of ``[0, n)`` evaluated at ``x``, in O(1) memory.

    Four Feistel rounds on ``2h`` bits (``4^h >= n``) form a bijection of ``[0, 4^h)``;
    cycle-walking (apply again while the value is ``>= n``) restricts it to ``[0, n)``.
    """
    h = max(1, (max(n - 1, 1).bit_length() + 1) // 2)
    mask = np.uint64((1 << h) - 1)
    keys = [np.uint64(zlib.crc32(f"{seed}:{i}".encode()) | 1) for i in range(4)]

    def once(v: np.ndarray) -> np.ndarray:
        left, right = v >> np.uint64(h), v & mask
        for k in keys:
            f = (right * k + np.uint64(0x9E3779B97F4A7C15)) & np.uint64(0xFFFFFFFFFFFFFFFF)
            f ^= f >> np.uint64(29)
            left, right = right, (left ^ f) & mask
        return (left << np.uint64(h)) | right

    with np.errstate(over="ignore"):
        out = once(np.asarray(x, dtype=np.uint64))
        todo = out >= n
        while todo.any():
            out[todo] = once(out[todo])
            todo = out >= n
    return out.astype(np.int64)


class SampleOrder:
    """Global sample index -> window of one source: a fresh permutation every epoch."""

    def __init__(self, windows: Windows, seed: int, shuffle: bool) -> None:
        self.windows, self.seed, self.shuffle = windows, seed, shuffle
        self.num_windows = windows.num_windows
        self._perm_cache: dict[int, torch.Tensor] = {}

    def _permutation(self, epoch: int) -> torch.Tensor:
        if epoch not in self._perm_cache:
            n = self.num_windows
            if self.shuffle:
                perm = torch.randperm(n, generator=torch.Generator().manual_seed(self.seed + epoch))
            else:
                perm = torch.arange(n)
            # A batch spans at most two epochs; keep only the newest to bound memory.
            self._perm_cache = {e: p for e, p in self._perm_cache.items() if e == epoch - 1}
            self._perm_cache[epoch] = perm
        return self._perm_cache[epoch]

    def window_indices(self, samples: torch.Tensor) -> torch.Tensor:
        """Window index of each global sample index (epoch-wise permutation)."""
        n = self.num_windows
        epochs, positions = samples // n, samples % n
        out = torch.empty_like(samples)
        for epoch in epochs.unique().tolist():
            mask = epochs == epoch
            if not self.shuffle or n <= RANDPERM_MAX_WINDOWS:
                out[mask] = self._permutation(int(epoch))[positions[mask]]
            else:
                perm = feistel_permutation(positions[mask].numpy(), n, self.seed + int(epoch))
                out[mask] = torch.from_numpy(perm)
        return out

    def gather(self, samples: torch.Tensor) -> Batch:
        return self.windows.gather(self.window_indices(samples))


def mixture_pattern(weights: Sequence[float], block: int = MIX_BLOCK) -> tuple[np.ndarray, np.ndarray]:
    """Source of each slot of a ``block``-sample period (smooth weighted round robin over
    largest-remainder counts), and each slot's rank among its source's slots."""
    w = np.asarray(weights, dtype=np.float64) / float(np.sum(weights))
    counts = np.floor(w * block).astype(np.int64)
    for i in np.argsort(-(w * block - counts), kind="stable")[: block - int(counts.sum())]:
        counts[i] += 1
    pattern = np.empty(block, dtype=np.int64)
    current = np.zeros(len(counts), dtype=np.int64)
    for slot in range(block):  # nginx's smooth weighted round robin: low discrepancy at every prefix
        current += counts
        i = int(np.argmax(current))
        pattern[slot] = i
        current[i] -= block
    rank = np.zeros(block, dtype=np.int64)
    for i in range(len(counts)):
        rank[pattern == i] = np.arange(int(counts[i]))
    return pattern, rank


class Mixture:
    """Several sample orders interleaved by a fixed weighted pattern of the global sample index.

    Global sample ``g`` goes to source ``pattern[g % B]`` as that source's sample
    ``(g // B) * count + rank[g % B]``; every source runs its own epochs. The mapping is a
    pure function of ``g``, so resume and resharding stay exact.
    """

    def __init__(self, orders: list[SampleOrder], weights: list[float], names: list[str]) -> None:
        if len(orders) != len(weights) or not orders:
            raise ConfigError("data.sources needs at least one {path, weight} entry")
        self.orders, self.weights, self.names = orders, list(weights), names
        self.pattern, self.rank = mixture_pattern(weights)
        self.counts = np.bincount(self.pattern, minlength=len(orders))
        if (self.counts == 0).any():
            tiny = [n for n, c in zip(names, self.counts) if c == 0]
            raise ConfigError(f"data.sources {tiny}: weight below 1/{MIX_BLOCK} of the total; raise it")
        self.num_windows = sum(o.num_windows for o in orders)
        self.seq_len = orders[0].windows.seq_len

    def locate(self, samples: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
        """(source, sample index within that source) of each global sample."""
        g = samples.numpy()
        slot = g % MIX_BLOCK
        source = self.pattern[slot]
        return source, (g // MIX_BLOCK) * self.counts[source] + self.rank[slot]

    def realised(self, num_samples: int) -> dict[str, float]:
        """Share of each source among global samples ``[0, num_samples)`` (closed form)."""
        full, rest = divmod(num_samples, MIX_BLOCK)
        per = full * self.counts + np.bincount(self.pattern[:rest], minlength=len(self.orders))
        return {n: float(c) / max(num_samples, 1) for n, c in zip(self.names, per)}

    def gather(self, samples: torch.Tensor) -> Batch:
        source, local = self.locate(samples)
        parts: list[Optional[Batch]] = [None] * len(samples)
        for i in np.unique(source).tolist():
            idx = np.nonzero(source == i)[0]
            batch = self.orders[i].gather(torch.from_numpy(local[idx]))
            for row, j in enumerate(idx.tolist()):
                pos = None if batch.positions is None else batch.positions[row : row + 1]
                parts[j] = Batch(batch.inputs[row : row + 1], batch.labels[row : row + 1], pos)
        return Batch.cat(parts)  # type: ignore[arg-type]


# ------------------------------------------------------------------------------- mixture entries


def mixture_entry(e: Any) -> tuple[str, float]:
    """(path, weight) of a ``data.sources`` entry (a MixtureSource or a plain mapping)."""
    path = e["path"] if isinstance(e, dict) else e.path
    weight = e.get("weight", 1.0) if isinstance(e, dict) else e.weight
    return str(path), float(weight)


def mixture_names(paths: list[str]) -> list[str]:
    """Short unique names of the mixture sources (for logs and metrics)."""
    names = [os.path.basename(os.path.normpath(p)) or p for p in paths]
    return names if len(set(names)) == len(names) else [f"{i}:{n}" for i, n in enumerate(names)]
