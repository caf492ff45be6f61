"""Collective timeouts and hang diagnosis.

* Timeouts: the process group starts with ``comm.init_timeout_s`` (rendezvous, compile,
  checkpoint loading and the first step can be slow) and, once the first step of this
  process has ended, every training group is lowered to ``comm.train_timeout_s`` (what
  torchtitan does). A collective that does not complete in time fails on each rank waiting
  in it: gloo raises in the calling thread; NCCL's watchdog aborts the process.
* Flight recorder: each rank keeps its last ``comm.trace_buffer_size`` collectives (op, group,
  sequence number, sizes, state). On NCCL a timeout dumps them to
  ``<dump_folder>/comm_traces/rank_<R>`` (``torchfrtrace <dump_folder>/comm_traces`` compares
  the ranks); on any backend :func:`describe_comm_failure` dumps this rank's as JSON there.
* Where: the trainer marks the step in progress (:meth:`CommMonitor.begin_step`); a failure
  report names that step and the newest collective in the recorder, i.e. the one this rank
  was blocked in. A watchdog thread also warns, before the timeout fires, when a step has run
  for most of it (NCCL's abort leaves no Python traceback to name the step).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
import time
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Optional

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from trainer.config import CommConfig

logger = logging.getLogger("meshwright")

TRACE_DIR = "comm_traces"
EXIT_COMM_FAILURE = 4  # a collective failed or timed out (see the report printed before exiting)

# Environment of the flight recorder, by its current names (torch >= 2.7; we need >= 2.9). The
# older TORCH_NCCL_TRACE_BUFFER_SIZE / TORCH_NCCL_DEBUG_INFO_TEMP_FILE are still read by torch,
# but setting them prints a deprecation warning on every rank of every run.
_FR_BUFFER_ENV = "TORCH_FR_BUFFER_SIZE"
_FR_FILE_ENV = "TORCH_FR_DUMP_TEMP_FILE"
_FR_DUMP_ON_TIMEOUT = "TORCH_NCCL_DUMP_ON_TIMEOUT"

# Text of the exceptions a failed collective raises (gloo: RuntimeError; NCCL/TCPStore: DistError).
_FAILURE_MARKERS = (
    "timed out",
    "timeout",
    "connection closed",
    "connection reset",
    "broken pipe",
    "gloo",
    "nccl",
)


def configure_flight_recorder(dump_folder: str, buffer_size: int) -> None:
    """Turn the flight recorder on before the process group exists (it reads the environment
    when a group is created). Values the user set in the environment win."""
    if buffer_size <= 0:
        return
    os.environ.setdefault(_FR_BUFFER_ENV, str(buffer_size))
    os.environ.setdefault(_FR_FILE_ENV, os.path.join(os.path.abspath(dump_folder), TRACE_DIR, "rank_"))
    os.environ.setdefault(_FR_DUMP_ON_TIMEOUT, "1")


def set_timeout(seconds: float) -> None:
    """Set the collective timeout of every process group of this process (the default group,
    the mesh's, flattened views, the checkpoint and preemption groups)."""
    from torch.distributed import distributed_c10d as c10d  # private API, as torchtitan uses it

    for group in list(c10d._world.pg_map):
        c10d._set_pg_timeout(timedelta(seconds=seconds), group)


class CommMonitor:
    """Per rank: switches init -> train timeout, remembers the step in progress, warns on stalls."""

    def __init__(self, cfg: CommConfig, *, rank: int, world_size: int, dump_folder: str) -> None:
        self.cfg = cfg
        self.rank = rank
        self.world_size = world_size
        self.dump_folder = dump_folder
        self.timeout_s = cfg.init_timeout_s
        self.step: Optional[int] = None  # the step in progress (None: setup)
        self._step_started = time.monotonic()
        self._lowered = False
        self._warned_step: Optional[int] = None
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        if world_size > 1 and cfg.trace_buffer_size > 0 and dist.get_backend() == "nccl":
            os.makedirs(os.path.join(dump_folder, TRACE_DIR), mode=0o750, exist_ok=True)  # NCCL dumps here
        if world_size > 1:
            self._thread = threading.Thread(target=self._watch, name="meshwright-comm-watchdog", daemon=True)
            self._thread.start()

    def begin_step(self, step: int) -> None:
        """Mark ``step`` as in progress (named in a failure report)."""
        self.step = step
        self._step_started = time.monotonic()

    def end_step(self, step: int) -> None:
        """After the first step of this process (every rank has passed it: the step ends with an
        agreement collective), lower the timeout of every training group."""
        if self._lowered or self.world_size == 1:
            return
        self._lowered = True
        try:
            set_timeout(self.cfg.train_timeout_s)
        except Exception as e:  # an older torch without _set_pg_timeout: keep the init timeout
            logger.warning(f"could not lower the collective timeout ({e}); keeping comm.init_timeout_s")
            return
        self.timeout_s = self.cfg.train_timeout_s
        if self.rank == 0:
            logger.info(f"collective timeout now {self.timeout_s:g}s (comm.train_timeout_s)")

    def _watch(self) -> None:
        while not self._stop.wait(min(5.0, max(self.timeout_s / 10, 0.5))):
            step, elapsed = self.step, time.monotonic() - self._step_started
            if step is None or step == self._warned_step or elapsed < 0.8 * self.timeout_s:
                continue
            self._warned_step = step
            last = last_collective()
            print(
                f"[rank{self.rank}] step {step} has run for {elapsed:.0f}s of the {self.timeout_s:g}s "
                "collective "
                f"timeout; newest collective on this rank: {describe_entry(last)}",
                file=sys.stderr,
                flush=True,
            )

    def close(self) -> None:
        self._stop.set()


def last_collective() -> Optional[dict[str, Any]]:
    """The newest entry of this rank's flight recorder (the collective it is in), or None."""
    entries = _fr_entries()
    if not entries:
        return None
    pending = [e for e in entries if e.get("state") != "completed"]
    # gloo records every op as "scheduled" (it does not track completion): the newest is the
    # one the rank is blocked in; NCCL marks completed ones, so the oldest pending is stuck.
    if pending and any(e.get("state") == "completed" for e in entries):
        return pending[0]
    return entries[-1]


def _fr_entries() -> list[dict[str, Any]]:
    try:
        # a private torch API, absent from torch's type stubs
        raw = torch._C._distributed_c10d._dump_fr_trace_json(includeCollectives=True)  # type: ignore[attr-defined]
        return list(json.loads(raw).get("entries", []))
    except Exception:  # recorder off or unavailable
        return []


def describe_entry(entry: Optional[dict[str, Any]]) -> str:
    if entry is None:
        return "unknown (flight recorder off: comm.trace_buffer_size=0)"
    group = entry.get("process_group") or ["?", "?"]
    return (
        f"{entry.get('profiling_name', '?')} on process group {group[1] or group[0]} "
        f"(collective #{entry.get('collective_seq_id', '?')}, input sizes {entry.get('input_sizes')}, "
        f"state {entry.get('state')})"
    )


def is_comm_failure(exc: BaseException) -> bool:
    """Whether ``exc`` comes from a failed or timed-out collective."""
    if isinstance(exc, (getattr(dist, "DistError", ()), getattr(dist, "DistBackendError", ()))):
        return True
    return isinstance(exc, RuntimeError) and any(m in str(exc).lower() for m in _FAILURE_MARKERS)


def describe_comm_failure(exc: BaseException, monitor: Optional[CommMonitor], rank: int) -> str:
    """One paragraph naming the step and the collective that did not complete; also dumps this
    rank's flight recorder to ``<dump_folder>/comm_traces/rank_<R>.json``."""
    where = "during setup" if monitor is None or monitor.step is None else f"at step {monitor.step}"
    timeout = "" if monitor is None else f" (collective timeout {monitor.timeout_s:g}s)"
    entry = last_collective()
    dump = ""
    if monitor is not None:
        path = os.path.join(monitor.dump_folder, TRACE_DIR, f"rank_{rank}.json")
        try:
            os.makedirs(os.path.dirname(path), mode=0o750, exist_ok=True)
            with open(path, "w", encoding="utf-8") as f:
                json.dump(
                    {"rank": rank, "step": monitor.step, "entries": _fr_entries()}, f, indent=1, default=str
                )
            dump = f" Flight recorder of this rank: {path}."
        except OSError:
            pass
    first_line = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else type(exc).__name__
    return (
        f"collective failed {where}{timeout}: {describe_entry(entry)} did not complete "
        f"({type(exc).__name__}: {first_line}). A rank that never entered it is stuck or gone: look "
        f"for the rank whose report names another collective or step.{dump}"
    )
