"""The ``eval`` config group's schema (``configs/eval/default.yaml`` documents every key)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from models.errors import ConfigError

__all__ = ["EvalConfig", "validate_eval"]


@dataclass
class EvalConfig:
    tasks: list[str] = field(default_factory=list)  # shipped task names or JSONL task files
    freq: int = 0  # steps between task evaluations (and at the last step); 0 = training.eval_freq
    batch_size: int = 8  # rows (one per choice) per forward per data-parallel rank
    limit: Optional[int] = None  # score only the first N examples of each task; null = all


def validate_eval(e: EvalConfig) -> None:
    """Checks that need no file and no process group (task files are read by the Trainer, on every rank)."""
    if e.freq < 0:
        raise ConfigError(f"eval.freq={e.freq} must be >= 0 (0 = every training.eval_freq steps).")
    if e.batch_size < 1:
        raise ConfigError(f"eval.batch_size={e.batch_size} must be >= 1 (rows per forward per data-parallel rank).")
    if e.limit is not None and e.limit < 1:
        raise ConfigError(f"eval.limit={e.limit} must be >= 1, or null to score every example.")
    duplicates = sorted({t for t in e.tasks if e.tasks.count(t) > 1})
    if duplicates:
        raise ConfigError(f"eval.tasks={list(e.tasks)} lists {duplicates} twice; list each task once.")
