"""The per-rank loader over a global sample order, and ``build_dataloader`` for every source.

Global step ``t`` consumes global samples ``[t*G, (t+1)*G)``; data-parallel rank ``r`` takes
the ``r``-th contiguous slice of ``G / dp_size`` of them. The loader state is one integer
(global samples seen), so a run resumes under any data-parallel degree without repeating
or skipping a sample. Batches are computed ahead in a background thread (``data.prefetch``)
and the time the step waited for them is reported by :meth:`DataLoader.pop_metrics`.
"""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Optional, Union

import numpy as np
import torch

from models.errors import ConfigError
from trainer.data.batch_ramp import BatchRamp
from trainer.data.prefetch import Prefetcher
from trainer.data.tokenizer import Tokenizer, encode_documents
from trainer.data.windows import (
    Batch,
    Mixture,
    SampleOrder,
    Windows,
)

logger = logging.getLogger("meshwright")

_ENCODE_CHUNK = 1024  # documents per encode call: parallel in Rust for HF, bounded memory


def tokenize_with_starts(docs: Sequence[str], tokenizer: Tokenizer) -> tuple[torch.Tensor, np.ndarray]:
    """``[bos] + encode(doc) + [eos]`` for every doc, concatenated, and each document's start.

    The dtype is int16 when the vocabulary fits (the byte tokenizer: half the memory of
    int32), int32 otherwise.
    """
    dtype = np.dtype(np.int16) if tokenizer.vocab_size <= 2**15 else np.dtype(np.int32)
    flats, lengths = [], []
    for start in range(0, len(docs), _ENCODE_CHUNK):
        flat, lens = encode_documents(tokenizer, docs[start : start + _ENCODE_CHUNK], dtype)
        flats.append(flat)
        lengths.append(lens)
    if not flats:
        return torch.empty(0, dtype=torch.from_numpy(np.empty(0, dtype)).dtype), np.empty(0, dtype=np.int64)
    lens = np.concatenate(lengths)
    starts = np.concatenate([[0], np.cumsum(lens[:-1])]).astype(np.int64)
    return torch.from_numpy(np.concatenate(flats)), starts


def tokenize_documents(docs: Sequence[str], tokenizer: Tokenizer) -> torch.Tensor:
    """The flat token tensor of :func:`tokenize_with_starts`."""
    return tokenize_with_starts(docs, tokenizer)[0]


def check_enough_windows(windows: Any, global_batch_size: int, what: str) -> None:
    if windows.num_windows < global_batch_size:
        raise ConfigError(
            f"{what} has {windows.num_tokens} tokens = {windows.num_windows} windows of seq_len="
            f"{windows.seq_len}, fewer than training.global_batch_size={global_batch_size} needs for one "
            "batch; add data, or lower training.seq_len / training.global_batch_size"
        )


def _produce(
    order: Any, start: int, shape_at: Callable[[int], tuple[int, int]], rank: int
) -> Iterator[tuple[Batch, int]]:
    """Batches of global steps starting at sample ``start``, each with the sample count after it; the
    step that starts at sample ``n`` advances by ``size`` samples and reads ``local`` of them on each
    rank, ``(size, local) = shape_at(n)``."""
    while True:
        size, local = shape_at(start)
        first = start + rank * local
        yield order.gather(torch.arange(first, first + local)), start + size
        start += size


def check_dp_shard(dp_rank: int, dp_size: int, global_batch_size: int) -> None:
    """A data-parallel rank and a global batch that split evenly over the dp degree."""
    if dp_size < 1 or not 0 <= dp_rank < dp_size:
        raise ConfigError(f"dp_rank={dp_rank} must be in [0, dp_size={dp_size}) and dp_size >= 1")
    if global_batch_size < 1 or global_batch_size % dp_size:
        raise ConfigError(
            f"training.global_batch_size={global_batch_size} must be a positive multiple of the "
            f"data-parallel degree {dp_size}; change one of them"
        )


class DataLoader:
    """Per data-parallel rank view of the global sample order; state = global samples seen."""

    def __init__(
        self,
        windows: Union[Windows, Mixture],
        *,
        global_batch_size: int,
        dp_rank: int,
        dp_size: int,
        seed: int,
        shuffle: bool,
        prefetch: int = 0,
        pin_memory: bool = False,
        ramp: Optional[BatchRamp] = None,
    ) -> None:
        check_dp_shard(dp_rank, dp_size, global_batch_size)
        self.ramp = ramp  # training.batch_ramp: the step's global batch follows the samples seen
        self.mixture = windows if isinstance(windows, Mixture) else None
        if self.mixture is None:
            check_enough_windows(windows, ramp.max_size if ramp else global_batch_size, "the data")
        self.windows = windows
        self.order = self.mixture or SampleOrder(windows, seed, shuffle)  # type: ignore[arg-type]
        self.global_batch_size = global_batch_size
        self.local_batch_size = global_batch_size // dp_size
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.seed = seed
        self.shuffle = shuffle
        self.prefetch = prefetch
        self.pin_memory = pin_memory
        self.samples_seen = 0  # global, across all dp ranks
        self.last_step_samples = global_batch_size
        self.stride = global_batch_size  # samples from one batch to the next (see seek)
        self._prefetcher: Optional[Prefetcher] = None
        self._prefetch_pos = -1  # global sample count the prefetcher's next batch starts at
        self._prefetch_stride = global_batch_size
        self._wait_s = 0.0
        self._waits = 0

    @property
    def epoch(self) -> int:
        """Epoch of the next sample (for logging; mixtures count all sources' windows)."""
        return self.samples_seen // self.windows.num_windows

    def window_indices(self, global_samples: torch.Tensor) -> torch.Tensor:
        """Window index of each global sample index (single source)."""
        if self.mixture is not None:
            raise TypeError("a mixture maps samples per source: use DataLoader.mixture.locate")
        return self.order.window_indices(global_samples)

    def _close_prefetcher(self) -> None:
        if self._prefetcher is not None:
            self._prefetcher.close()
            self._prefetcher = None

    def seek(self, samples: int, *, stride: Optional[int] = None) -> None:
        """Read the next batch at global sample ``samples`` and the following ones every ``stride``
        samples (default ``global_batch_size``). Fault tolerance: a replica group's share of a step
        moves with the number of groups taking part (trainer/resilience/fault_tolerance.py)."""
        if self.ramp is not None and stride is not None:
            raise ValueError("a batch ramp sets each step's size; seek(stride=) is fault tolerance's")
        self.samples_seen = samples
        self.stride = stride or self.global_batch_size

    def step_shape(self) -> Callable[[int], tuple[int, int]]:
        """(global samples, this rank's rows) of the step that starts at a sample count: the ramp's
        size over the dp degree, else the current stride and ``local_batch_size`` (bound now, so a
        prefetch thread keeps the values it was started with)."""
        ramp, dp_size, stride, local = self.ramp, self.dp_size, self.stride, self.local_batch_size
        if ramp is not None:
            return lambda samples: (ramp.size_at(samples), ramp.size_at(samples) // dp_size)
        return lambda samples: (stride, local)

    def next_batch(self) -> Batch:
        """This rank's ``global_batch_size // dp_size`` rows of the next global step."""
        size = self.step_shape()(self.samples_seen)[0]
        if self.prefetch <= 0:
            start = time.perf_counter()
            batch, _ = next(_produce(self.order, self.samples_seen, self.step_shape(), self.dp_rank))
            waited = time.perf_counter() - start
        else:
            if (
                self._prefetcher is None
                or self._prefetch_pos != self.samples_seen
                or self._prefetch_stride != self.stride
            ):
                self._close_prefetcher()  # the position was moved (resume, reset, seek): start over
                self._prefetch_stride = self.stride
                args = (
                    self.order,
                    self.samples_seen,
                    self.step_shape(),
                    self.dp_rank,
                )
                self._prefetcher = Prefetcher(lambda: _produce(*args), self.prefetch, self.pin_memory)
                weakref.finalize(self, self._prefetcher.close)  # the thread never outlives the loader
            batch, self._prefetch_pos, waited = self._prefetcher.get()
        self.samples_seen += size
        self.last_step_samples = size  # the global batch of the step just read
        self._wait_s += waited
        self._waits += 1
        return batch

    def pop_metrics(self) -> dict[str, float]:
        """Mean seconds ``next_batch`` blocked per call since the last pop (``data_wait_s``) and,
        for a mixture, each source's realised share of the global samples so far."""
        out = {"data_wait_s": self._wait_s / max(self._waits, 1)}
        self._wait_s, self._waits = 0.0, 0
        if self.mixture is not None:
            out.update({f"data_mix/{k}": v for k, v in self.mixture.realised(self.samples_seen).items()})
        return out

    def reset(self) -> None:
        """Back to global sample 0 (validation restarts before each evaluation)."""
        self.samples_seen = 0

    def close(self) -> None:
        """Stop the background thread (also happens when the loader is garbage collected)."""
        self._close_prefetcher()

    def _mixture_id(self) -> str:
        assert self.mixture is not None
        return ";".join(
            f"{n}:{w:g}:{o.num_windows}"
            for n, w, o in zip(self.mixture.names, self.mixture.weights, self.mixture.orders)
        )

    def state_dict(self) -> dict[str, Any]:
        """Position plus what identifies the sample order, to catch resuming on other data."""
        sd = {
            "samples_seen": self.samples_seen,
            "global_batch_size": self.global_batch_size,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "num_windows": self.windows.num_windows,
        }
        if self.mixture is not None:
            sd["mixture"] = self._mixture_id()
        return sd

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """Resume at the saved global sample; works for any dp_size since the state is global."""
        missing = {"samples_seen", "global_batch_size", "seed", "shuffle", "num_windows"} - set(sd)
        if missing:
            raise ConfigError(
                f"data loader state is missing {sorted(missing)}; the checkpoint is not from this trainer"
            )
        # These define the sample order; resuming with other values would silently change the data.
        current: dict[str, Any] = {
            "num_windows": self.windows.num_windows,
            "seed": self.seed,
            "shuffle": self.shuffle,
        }
        if self.mixture is not None:
            current["mixture"] = self._mixture_id()
        for key, value in current.items():
            if key not in sd or type(value)(sd[key]) != value:
                raise ConfigError(
                    f"checkpoint data loader has {key}={sd.get(key)}, this run has {key}={value} (data, "
                    "tokenizer, training.seq_len, training.seed, data.shuffle or data.sources changed); "
                    "resume "
                    "with the same settings or start a new run in a fresh job.dump_folder"
                )
        samples_seen = int(sd["samples_seen"])
        if self.ramp is not None:
            if not self.ramp.is_step_start(samples_seen):
                raise ConfigError(
                    f"checkpoint has seen {samples_seen} samples, which is not where a step of this run's "
                    "training.batch_ramp starts (the ramp or training.seq_len changed); resume with the "
                    "ramp the checkpoint was trained with"
                )
        elif samples_seen % self.global_batch_size:
            raise ConfigError(
                f"checkpoint has seen {samples_seen} samples (global_batch_size={sd['global_batch_size']}), "
                f"not a multiple of the new training.global_batch_size={self.global_batch_size}; "
                "pick a global batch size that divides it or keep the old one"
            )
        self.samples_seen = samples_seen
