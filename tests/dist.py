"""The multi-process test harness is the product's own spawner (``trainer/spawn.py``), which the
benchmarks use too: run a function on N gloo ranks with bounded waits and a report of which
rank died and how."""

from __future__ import annotations

from trainer.spawn import DistributedError, describe_exit, free_port, run_distributed

__all__ = ["DistributedError", "describe_exit", "free_port", "run_distributed"]
