"""Learning-rate schedules: the multiplier of the peak LR at each optimizer step.

Every schedule warms up linearly, reaching the peak at step ``warmup_steps - 1``; then
(``lr_scheduler.decay_type``, a name in ``trainer.optim.LR_SCHEDULES``) it decays cosine or linear to
``min_lr_ratio`` at the last step and stays there, stays constant at the peak, or follows WSD
(warmup-stable-decay, :func:`wsd`): the peak until the decay starts, then a decay of
``lr_scheduler.decay_shape`` (linear, cosine, 1-sqrt) that reaches ``min_lr_ratio`` at the last step.
"""

from __future__ import annotations

import math
from typing import Protocol

from trainer.optim.config import LRSchedulerConfig

# lr_scheduler.decay_shape -> the fraction of the (peak - floor) span left at decay progress p in (0, 1]
WSD_SHAPES: dict[str, str] = {
    "linear": "1 - p",
    "cosine": "(1 + cos(pi p)) / 2",
    "1-sqrt": "1 - sqrt(p)",
}


class LRFactor(Protocol):
    """A schedule: the multiplier of the peak LR for the ``step``-th optimizer step (0-based) of a
    run of ``total_steps`` steps under the options ``cfg``."""

    def __call__(self, step: int, cfg: LRSchedulerConfig, total_steps: int) -> float: ...


def _warmup(step: int, warmup_steps: int) -> float:
    return (step + 1) / warmup_steps


def _progress(step: int, warmup_steps: int, total_steps: int) -> float:
    """Fraction of the decay done after warmup: 0 at step ``warmup_steps``, 1 at the last step."""
    decay_steps = max(1, total_steps - warmup_steps - 1)
    return min(1.0, (step - warmup_steps) / decay_steps)


def warmup_cosine(step: int, cfg: LRSchedulerConfig, total_steps: int) -> float:
    """Linear warmup, then half a cosine from 1 down to ``min_lr_ratio``."""
    if step < cfg.warmup_steps:
        return _warmup(step, cfg.warmup_steps)
    shape = 0.5 * (1.0 + math.cos(math.pi * _progress(step, cfg.warmup_steps, total_steps)))
    return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * shape


def warmup_linear(step: int, cfg: LRSchedulerConfig, total_steps: int) -> float:
    """Linear warmup, then a straight line from 1 down to ``min_lr_ratio``."""
    if step < cfg.warmup_steps:
        return _warmup(step, cfg.warmup_steps)
    shape = 1.0 - _progress(step, cfg.warmup_steps, total_steps)
    return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * shape


def warmup_constant(step: int, cfg: LRSchedulerConfig, total_steps: int) -> float:
    """Linear warmup, then the peak LR to the end (``total_steps`` and ``min_lr_ratio`` unused)."""
    if step < cfg.warmup_steps:
        return _warmup(step, cfg.warmup_steps)
    return 1.0


def wsd_decay_start(cfg: LRSchedulerConfig, total_steps: int) -> int:
    """The first step of WSD's decay: ``decay_start_step`` when set (decay from a stable checkpoint),
    else ``total_steps - decay_steps`` when set, else ``total_steps - round(decay_fraction * total_steps)``.
    Steps before it are warmup or stable (the peak); it and the steps after are decayed."""
    if cfg.decay_start_step is not None:
        return cfg.decay_start_step
    if cfg.decay_steps is not None:
        return total_steps - cfg.decay_steps
    return total_steps - round(cfg.decay_fraction * total_steps)


def wsd(step: int, cfg: LRSchedulerConfig, total_steps: int) -> float:
    """Warmup-stable-decay: linear warmup, the peak until :func:`wsd_decay_start` ``D``, then the
    ``decay_shape`` decay over the ``L = total_steps - D`` last steps: step ``s >= D`` has progress
    ``p = (s - D + 1) / L`` and factor ``min_lr_ratio + (1 - min_lr_ratio) * shape(p)``, so step ``D``
    is the first lowered one and the last step is at the floor (where later steps stay). With
    ``D == total_steps`` (``decay_fraction=0``) the run has no decay: the peak to the end and beyond.

    The factor of a step before ``D`` depends on neither ``D`` nor ``total_steps``: a run that decays
    from step ``D`` (``lr_scheduler.decay_start_step=D``, resumed from the stable run's ``step-D``
    checkpoint) has the stable run's LRs up to there."""
    if step < cfg.warmup_steps:
        return _warmup(step, cfg.warmup_steps)
    start = wsd_decay_start(cfg, total_steps)
    if step < start or start >= total_steps:  # stable (start == total_steps: a run without decay)
        return 1.0
    p = min(1.0, (step - start + 1) / max(1, total_steps - start))
    if cfg.decay_shape == "linear":
        shape = 1.0 - p
    elif cfg.decay_shape == "cosine":
        shape = 0.5 * (1.0 + math.cos(math.pi * p))
    else:  # 1-sqrt (validate_optimizer checks the name against WSD_SHAPES)
        shape = 1.0 - math.sqrt(p)
    return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * shape
