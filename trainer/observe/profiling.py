"""``profiling.enable``: torch.profiler traces of chosen steps, per rank.

For each step N in ``profiling.steps`` every rank writes into ``<dump_folder>/profile/step-N/``:

* ``rank<R>.trace.json``: Chrome trace (open in https://ui.perfetto.dev or chrome://tracing);
* ``rank<R>.top_ops.txt``: the ops that took the most time (self time, CPU and device);
* on CUDA with ``profiling.memory_snapshot``: ``rank<R>.memory_snapshot.pickle``, the allocator's
  history during the step (drag it into https://pytorch.org/memory_viz).

Each chosen step is profiled on its own (the profiler starts right before it and stops right
after it), so the other steps run at full speed.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Optional

import torch
from torch.profiler import ProfilerActivity, profile

if TYPE_CHECKING:
    from trainer.config import ProfilingConfig

logger = logging.getLogger("meshwright")


class StepProfiler:
    """Call :meth:`begin` before and :meth:`end` after each step; only chosen steps are profiled."""

    def __init__(self, cfg: ProfilingConfig, *, dump_folder: str, rank: int, device: torch.device) -> None:
        self.steps = set(cfg.steps) if cfg.enable else set()
        self.cfg = cfg
        self.folder = os.path.join(dump_folder, "profile")
        self.rank = rank
        self.device = device
        self._prof: Optional[profile] = None
        self._memory = cfg.memory_snapshot and device.type == "cuda"

    def begin(self, step: int) -> None:
        if step not in self.steps:
            return
        activities = [ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(ProfilerActivity.CUDA)
        if self._memory:
            torch.cuda.memory._record_memory_history(max_entries=100_000)
        self._prof = profile(activities=activities, record_shapes=True, profile_memory=True, with_stack=False)
        self._prof.__enter__()

    def end(self, step: int) -> None:
        if self._prof is None:
            return
        prof, self._prof = self._prof, None
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        prof.__exit__(None, None, None)
        out = os.path.join(self.folder, f"step-{step}")
        os.makedirs(out, mode=0o750, exist_ok=True)
        prof.export_chrome_trace(os.path.join(out, f"rank{self.rank}.trace.json"))
        sort_by = "self_cuda_time_total" if self.device.type == "cuda" else "self_cpu_time_total"
        table = prof.key_averages().table(sort_by=sort_by, row_limit=self.cfg.top_ops)
        with open(os.path.join(out, f"rank{self.rank}.top_ops.txt"), "w", encoding="utf-8") as f:
            f.write(f"step {step}, rank {self.rank}, sorted by {sort_by}\n{table}\n")
        if self._memory:
            torch.cuda.memory._dump_snapshot(os.path.join(out, f"rank{self.rank}.memory_snapshot.pickle"))
            torch.cuda.memory._record_memory_history(enabled=None)
        if self.rank == 0:
            logger.info(f"profile of step {step} written to {out}")

    def close(self) -> None:
        """Stop a profiler left running by an exception."""
        if self._prof is not None:
            self._prof.__exit__(None, None, None)
            self._prof = None
