"""The shape of each training step's batch: ``training.batch_ramp`` and ``training.seq_len_warmup``.

One object answers, for the trainer, the three questions both recipes change: how many rows the loader
hands this step (the ramp's stage, read by the loader through :attr:`StepShape.ramp`), how those rows are
cut (the warmup's split of each row into ``k`` shorter ones), and how many micro batches the step
accumulates. With neither recipe on every step has the run's fixed shape and nothing here does work.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

from torch import Tensor

from trainer.data.batch_ramp import BatchRamp, check_ramp_divisible
from trainer.data.seq_warmup import SeqLenWarmup, split_positions, split_rows, validate_seq_len_warmup

if TYPE_CHECKING:
    from trainer.config import TrainingConfig

__all__ = ["StepShape"]


class StepShape:
    """Both recipes' per-step decisions (see the module docstring); checks them before any collective."""

    def __init__(self, t: TrainingConfig, batch_size: int, dp: int, seq_len_divisor: int) -> None:
        # each ramp stage splits into whole micro batches; each warmup length over context / sequence
        # parallelism (exit 2 naming the stage)
        check_ramp_divisible(t.batch_ramp, t.micro_batch_size, dp)
        validate_seq_len_warmup(t.seq_len_warmup, t.seq_len, seq_len_divisor)
        self.ramp: Optional[BatchRamp] = (
            BatchRamp(t.batch_ramp, batch_size, t.seq_len) if t.batch_ramp else None
        )
        self.warmup: Optional[SeqLenWarmup] = (
            SeqLenWarmup(t.seq_len_warmup, t.seq_len) if t.seq_len_warmup else None
        )
        self.micro_batch_size = t.micro_batch_size
        self.seq_len = t.seq_len
        self.split = 1  # this step's seq_len_warmup factor: each row became ``split`` rows

    def steady(self) -> None:
        """Every step at the final shape (the rehearsal traces the steady state)."""
        self.ramp = self.warmup = None
        self.split = 1

    def cut(
        self, step: int, inputs: Tensor, labels: Tensor, positions: Optional[Tensor]
    ) -> tuple[Tensor, Tensor, Optional[Tensor]]:
        """The rows of 1-based ``step``, each split into ``k`` shorter rows during the warmup."""
        self.split = k = self.warmup.factor(step) if self.warmup is not None else 1
        if k == 1:
            return inputs, labels, positions
        return (
            split_rows(inputs, k),
            split_rows(labels, k),
            split_positions(positions, k) if positions is not None else None,
        )

    def micro_batches(self, rows: int, fixed: int) -> int:
        """Micro batches of a step of ``rows`` rows: ``fixed`` (the run's accumulation count) unless a
        ramp changes the step's rows (the rows split by the warmup: ``split`` x the micro batch)."""
        if self.ramp is None:
            return fixed
        return rows // (self.micro_batch_size * self.split)

    def step_tokens(self, last_step_samples: int) -> Optional[int]:
        """Tokens of the step just taken under a ramp (its stage's size); None: the run's fixed size."""
        return last_step_samples * self.seq_len if self.ramp is not None else None
