"""Learning-rate schedules: the multiplier of the peak LR at each optimizer step.

Every schedule warms up linearly, reaching the peak at step ``warmup_steps - 1``; then it decays
(``lr_scheduler.decay_type``, a name in ``trainer.optim.LR_SCHEDULES``): cosine or linear to
``min_lr_ratio`` at the last step and stays there, or constant at the peak.
"""

from __future__ import annotations

import math
from typing import Protocol


class LRFactor(Protocol):
    """A schedule: the multiplier of the peak LR for the ``step``-th optimizer step (0-based)."""

    def __call__(self, step: int, *, warmup_steps: int, total_steps: int, min_lr_ratio: float) -> float: ...


def _progress(step: int, warmup_steps: int, total_steps: int) -> float:
    """Fraction of the decay done after warmup: 0 at step ``warmup_steps``, 1 at the last step."""
    decay_steps = max(1, total_steps - warmup_steps - 1)
    return min(1.0, (step - warmup_steps) / decay_steps)


def warmup_cosine(step: int, *, warmup_steps: int, total_steps: int, min_lr_ratio: float) -> float:
    """Linear warmup, then half a cosine from 1 down to ``min_lr_ratio``."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    shape = 0.5 * (1.0 + math.cos(math.pi * _progress(step, warmup_steps, total_steps)))
    return min_lr_ratio + (1.0 - min_lr_ratio) * shape


def warmup_linear(step: int, *, warmup_steps: int, total_steps: int, min_lr_ratio: float) -> float:
    """Linear warmup, then a straight line from 1 down to ``min_lr_ratio``."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    shape = 1.0 - _progress(step, warmup_steps, total_steps)
    return min_lr_ratio + (1.0 - min_lr_ratio) * shape


def warmup_constant(step: int, *, warmup_steps: int, total_steps: int, min_lr_ratio: float) -> float:
    """Linear warmup, then the peak LR to the end (``total_steps`` and ``min_lr_ratio`` unused)."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    return 1.0
