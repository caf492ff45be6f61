"""Disk space for checkpoints: how big one is, whether it fits, and a full disk as an operational error.

* Size: a complete checkpoint in the folder is the measure of the next one (the sizes its marker
  records); before the first, the estimate is the model's global parameter bytes times
  (1 + the optimizer's parameter-shaped state tensors: 2 for AdamW), plus a small margin for
  the other entries (scheduler, data loader, RNG, ``.metadata``).
* At start (``Checkpointer`` construction) a folder that cannot hold even one checkpoint is a
  ``ConfigError`` on every rank; before each save, too little room is a warning.
* During a save, a write that fails on a full disk (``ENOSPC``/``EDQUOT``, or any write error
  while almost nothing is free: torch's zip writer reports a full disk as ``unexpected pos``)
  is raised as :class:`DiskFullError` by the rank that saw it; DCP gathers it to every rank, so
  every rank stops with the same :class:`CheckpointDiskFull` after the partial folder is removed.
  ``trainer/main.py`` exits with :data:`EXIT_DISK_FULL`.
"""

from __future__ import annotations

import errno
import os
import shutil
from collections.abc import Iterable
from typing import Any, Optional

import torch

# Exit status of a run stopped by a full checkpoint disk: EX_IOERR from sysexits.h.
EXIT_DISK_FULL = 74
# A write error with less than this free on the checkpoint's filesystem is taken for a full disk.
NEARLY_FULL_BYTES = 1 << 20
_MARGIN = 1.02  # scheduler, loader, RNG, step counters and .metadata on top of the tensors
_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)

__all__ = [
    "EXIT_DISK_FULL",
    "CheckpointDiskFull",
    "DiskFullError",
    "as_disk_full",
    "checkpoint_bytes",
    "disk_full_message",
    "find_disk_full",
    "free_bytes",
    "human_bytes",
    "optimizer_states_per_param",
]


class DiskFullError(OSError):
    """A checkpoint write failed because its filesystem is full; raised by the rank that saw it."""

    def __init__(self, path: str, free: int, cause: str) -> None:
        super().__init__(errno.ENOSPC, f"no space left on the device of {path} ({free} bytes free): {cause}")
        self.path, self.free, self.cause = path, free, cause

    def __reduce__(self) -> Any:  # crosses ranks inside DCP's gathered CheckpointException
        return (DiskFullError, (self.path, self.free, self.cause))


class CheckpointDiskFull(Exception):
    """Raised on every rank when a checkpoint could not be written for lack of space.

    ``in_lockstep``: every rank raised it at the same point (a sync save), so a normal teardown
    with collectives is safe; False for an async save, whose failure each rank sees when it polls.
    """

    in_lockstep = True


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def free_bytes(path: str) -> int:
    """Bytes available to this user on the filesystem that holds (or will hold) ``path``."""
    probe = os.path.abspath(path)
    while not os.path.exists(probe):
        parent = os.path.dirname(probe)
        if parent == probe:
            break
        probe = parent
    return shutil.disk_usage(probe).free


def optimizer_states_per_param(optimizer: Any) -> int:
    """How many parameter-shaped tensors the optimizer keeps per parameter, counted in its state;
    2 (AdamW's moments) while the state is still empty, before the first step."""
    for state in getattr(optimizer, "state", {}).values():
        if isinstance(state, dict) and state:
            return sum(1 for v in state.values() if isinstance(v, torch.Tensor) and v.dim() > 0)
    return 2


def checkpoint_bytes(
    shapes: dict[str, torch.Size], dtypes: dict[str, torch.dtype], default_dtype: torch.dtype, states: int
) -> int:
    """Estimated bytes of one full checkpoint (all ranks together) of a model with these global
    ``shapes`` whose optimizer keeps ``states`` parameter-shaped tensors per parameter."""
    total = 0
    for name, shape in shapes.items():
        numel = 1
        for d in shape:
            numel *= int(d)
        total += numel * dtypes.get(name, default_dtype).itemsize
    return int(total * (1 + states) * _MARGIN)


def _exceptions(exc: BaseException) -> Iterable[BaseException]:
    """``exc``, its causes and contexts, and the per-rank failures of a DCP CheckpointException."""
    seen: set[int] = set()
    todo: list[Optional[BaseException]] = [exc]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        failures = getattr(e, "failures", None)
        if isinstance(failures, dict):
            todo.extend(f[0] if isinstance(f, tuple) else f for f in failures.values())
        todo.extend([e.__cause__, e.__context__])


def find_disk_full(exc: BaseException) -> Optional[DiskFullError]:
    """The :class:`DiskFullError` inside ``exc`` (gathered from any rank), if any."""
    for e in _exceptions(exc):
        if isinstance(e, DiskFullError):
            return e
    return None


def as_disk_full(exc: BaseException, path: str) -> Optional[DiskFullError]:
    """Classify a write error on ``path``: a :class:`DiskFullError` if the disk is full, else None."""
    found = find_disk_full(exc)
    if found is not None:
        return found
    free = free_bytes(path)
    for e in _exceptions(exc):
        if isinstance(e, OSError) and e.errno in _FULL_ERRNOS:
            return DiskFullError(path, free, f"{type(e).__name__}: {e}")
    if free < NEARLY_FULL_BYTES:
        return DiskFullError(path, free, f"{type(exc).__name__}: {str(exc).strip()[:200]}")
    return None


def disk_full_message(
    step: int, folder: str, needed: int, free: int, intact: Optional[str], *, removed: bool
) -> str:
    """The report of a full disk; ``removed``: ``free`` was measured after removing the partial
    folder (rank 0 removes it), else when the write failed."""
    resume = (
        f"The newest intact checkpoint is {intact}: the same command resumes from it once there is room."
        if intact
        else "No checkpoint of this run is complete yet."
    )
    when = f"after removing the partial step-{step} folder" if removed else "when the write failed"
    return (
        f"checkpoint step {step} could not be written: the disk holding {folder} is full (a checkpoint "
        f"needs about {human_bytes(needed)}, {human_bytes(free)} are free {when}). {resume} Free space "
        "there, or set checkpoint.folder / job.dump_folder to "
        "a larger disk, or lower checkpoint.keep_latest."
    )
