"""Preemption: SIGTERM or SIGUSR1 -> every rank agrees at a step boundary -> checkpoint -> exit 75.

A scheduler warns before it kills: Slurm sends ``--signal=USR1@<seconds>`` before the time
limit and SIGTERM on preemption or ``scancel``/``scontrol requeue``; torchrun forwards SIGTERM
(and SIGUSR1 once it is in ``TORCHELASTIC_SIGNALS_TO_HANDLE``, as ``launch.sh`` and the Slurm
script set) to its workers. The signal may reach only some ranks, at different points of a
step, so the handler only sets a flag; at every step boundary all ranks OR their flags with
one all-reduce of a single integer (on a gloo group of its own: CPU only, it never waits for
the GPU and never interleaves with the step's collectives). When any rank was signalled,
all of them write a checkpoint of that step together and leave with :data:`EXIT_PREEMPTED`;
the next start (a requeued job, or the same command again) resumes from it exactly.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from datetime import timedelta
from typing import Any, Optional

import torch
import torch.distributed as dist

logger = logging.getLogger("meshwright")

# Exit status of a preempted rank: EX_TEMPFAIL from sysexits.h ("temporary failure, try again").
# Distinct from 1 (crash), 2 (config error), 3 (training stopped, e.g. non-finite loss) and
# 4 (collective failure): a wrapper can tell "checkpointed, run me again" from a failure.
EXIT_PREEMPTED = 75
SIGNALS = (signal.SIGTERM, signal.SIGUSR1)

# Test-only hook: "<rank>@<step>" makes that rank leave out the stop-flag all-reduce at that
# step, so the others wait in a collective it never enters (the hang test). Never set it in runs.
SKIP_ENV = "MESHWRIGHT_TEST_SKIP_COLLECTIVE_AT"


class Preempted(Exception):
    """Raised on every rank after the preemption checkpoint; ``trainer/main.py`` exits 75."""

    def __init__(self, step: int, signame: str, saved: bool) -> None:
        what = (
            f"checkpoint of step {step} written"
            if saved
            else "checkpoints are off (checkpoint.enable=false): nothing saved"
        )
        super().__init__(
            f"preempted by {signame} after step {step}: {what}; run the same command again to resume"
        )
        self.step = step


class PreemptionHandler:
    """Installs the signal handlers (main thread only) and runs the per-step agreement."""

    def __init__(self, *, rank: int, world_size: int, timeout_s: float) -> None:
        self.rank = rank
        self.world_size = world_size
        self._signum: Optional[int] = None
        self._previous: dict[int, Any] = {}
        self._flag = torch.zeros(1, dtype=torch.int32)
        self._group: Optional[dist.ProcessGroup] = None
        if world_size > 1:
            self._group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
        if threading.current_thread() is threading.main_thread():
            for sig in SIGNALS:
                self._previous[sig] = signal.signal(sig, self._on_signal)
        skip = os.environ.get(SKIP_ENV, "")
        self._skip_step = int(skip.split("@")[1]) if skip and int(skip.split("@")[0]) == rank else None

    @property
    def group(self) -> Optional[dist.ProcessGroup]:
        """The group of the agreement (its timeout follows comm.train_timeout_s)."""
        return self._group

    def _on_signal(self, signum: int, frame: Any) -> None:
        if self._signum is None:
            self._signum = signum
            # Printed from the handler: the step may take a while to reach its boundary.
            os.write(
                2,
                f"[rank{self.rank}] got {signal.Signals(signum).name}: checkpoint and exit at the end of "
                "this step\n".encode(),
            )

    def should_stop(self, step: int) -> bool:
        """Collective: True on every rank if any rank has been signalled."""
        self._flag.fill_(0 if self._signum is None else 1)
        if self._group is not None:
            if step == self._skip_step:
                logger.warning(
                    f"{SKIP_ENV}: rank {self.rank} leaves out the stop-flag all-reduce of step {step} (test "
                    "hook)"
                )
            else:
                dist.all_reduce(self._flag, op=dist.ReduceOp.MAX, group=self._group)
        return bool(self._flag.item())

    def stop(self, step: int, checkpointer: Any, checkpoint_enabled: bool) -> None:
        """Write the checkpoint of ``step`` on every rank, then raise :class:`Preempted`."""
        name = signal.Signals(self._signum).name if self._signum is not None else "a signal on another rank"
        if checkpoint_enabled:
            checkpointer.save(step, final=True)  # synchronous; a no-op if this step is already saved
        checkpointer.wait()
        raise Preempted(step, name, saved=checkpoint_enabled)

    def close(self) -> None:
        """Restore the previous handlers and release the group."""
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
        if self._group is not None:
            dist.destroy_process_group(self._group)
            self._group = None
