"""Batch-size warmup (``training.batch_ramp``): the global batch grows in stages.

Stage ``i`` (``training.batch_ramp[i]``) has its ``global_batch_size`` and ends before step
``until_step`` (1-based optimizer steps: ``until_step: 100`` means steps 1-99), or once
``until_tokens`` tokens have been trained; after the last stage the batch is
``training.global_batch_size``. Every stage uses the same kind of bound.

The loader's state stays one integer, the global samples seen ``n``: the size of the step that
starts at sample ``n`` is a function of ``n`` alone (:meth:`BatchRamp.size_at`), so a resume under
any data-parallel degree reads exactly the samples after the last step (none twice, none skipped),
and the stages convert to sample boundaries once: step bounds cumulate the earlier stages' sizes,
token bounds are ``ceil(until_tokens / seq_len)`` samples (a step that starts before the bound takes
that stage's size). Each stage's accumulation count is its local batch over the micro batch
(:func:`check_ramp_divisible`, at start-up, naming the stage); the loss stays normalised by the
step's global target tokens.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

from models.errors import ConfigError

__all__ = ["BatchRamp", "BatchStage", "check_ramp_divisible", "validate_batch_ramp"]


@dataclass
class BatchStage:
    """One stage of ``training.batch_ramp``: its global batch and where it ends (one of the two)."""

    global_batch_size: int = 0
    until_step: Optional[int] = None  # the stage's last step is until_step - 1 (1-based steps)
    until_tokens: Optional[int] = None  # the stage ends once this many tokens were trained


def validate_batch_ramp(stages: Sequence[BatchStage], final_batch_size: int) -> None:
    """``ConfigError`` naming the stage: sizes > 0, one kind of bound, bounds increasing."""
    kinds = set()
    last = 0
    for i, s in enumerate(stages):
        key = f"training.batch_ramp[{i}]"
        if isinstance(s.global_batch_size, bool) or s.global_batch_size < 1:
            raise ConfigError(f"{key}.global_batch_size={s.global_batch_size} must be a positive integer.")
        if (s.until_step is None) == (s.until_tokens is None):
            raise ConfigError(
                f"{key} must set exactly one of until_step and until_tokens (e.g. "
                f"{{until_step: 100, global_batch_size: {s.global_batch_size}}})."
            )
        bound = s.until_step if s.until_step is not None else s.until_tokens
        kinds.add("until_step" if s.until_step is not None else "until_tokens")
        if len(kinds) > 1:
            raise ConfigError(
                f"{key}: every stage of training.batch_ramp ends by steps, or every stage by tokens."
            )
        assert bound is not None
        if bound <= last or (s.until_step is not None and bound < 2):
            raise ConfigError(
                f"{key}.{kinds.pop()}={bound} must be greater than the previous stage's bound ({last}) "
                "(and a step bound >= 2: the stage's last step is bound - 1)."
            )
        last = bound
    if stages and final_batch_size < 1:
        raise ConfigError(f"training.global_batch_size={final_batch_size} must be a positive integer.")


def check_ramp_divisible(stages: Sequence[BatchStage], micro_batch_size: int, dp: int) -> None:
    """Each stage's global batch splits into whole micro batches on every data-parallel rank."""
    for i, s in enumerate(stages):
        if s.global_batch_size % (micro_batch_size * dp):
            raise ConfigError(
                f"training.batch_ramp[{i}].global_batch_size={s.global_batch_size} is not a multiple of "
                f"training.micro_batch_size x data-parallel degree = {micro_batch_size} x {dp} = "
                f"{micro_batch_size * dp}; change the stage's size (e.g. "
                f"{max(1, s.global_batch_size // (micro_batch_size * dp)) * micro_batch_size * dp})."
            )


class BatchRamp:
    """The global batch of the step that starts at each global sample count (see the module docstring)."""

    def __init__(self, stages: Sequence[BatchStage], final_batch_size: int, seq_len: int) -> None:
        validate_batch_ramp(stages, final_batch_size)
        self.sizes = [s.global_batch_size for s in stages]
        self.final = final_batch_size
        self.bounds: list[int] = []  # the stage's first sample count that no longer belongs to it
        samples, step = 0, 1
        for s in stages:
            if s.until_step is not None:
                samples += (s.until_step - step) * s.global_batch_size
                step = s.until_step
                self.bounds.append(samples)
            else:
                assert s.until_tokens is not None
                self.bounds.append(math.ceil(s.until_tokens / seq_len))

    @property
    def max_size(self) -> int:
        return max([*self.sizes, self.final])

    def size_at(self, samples: int) -> int:
        """The global batch of the step that starts after ``samples`` global samples."""
        i = bisect.bisect_right(self.bounds, samples)
        return self.sizes[i] if i < len(self.sizes) else self.final

    def _ramp_end(self) -> tuple[int, int]:
        """(steps, samples) when the last stage's steps are done: the first step at the final size."""
        steps, samples = 0, 0
        end = self.bounds[-1] if self.bounds else 0
        while samples < end:
            samples += self.size_at(samples)
            steps += 1
        return steps, samples

    def samples_after(self, steps: int) -> int:
        """Global samples the first ``steps`` steps consume."""
        ramp_steps, ramp_samples = self._ramp_end()
        if steps >= ramp_steps:
            return ramp_samples + (steps - ramp_steps) * self.final
        samples = 0
        for _ in range(steps):
            samples += self.size_at(samples)
        return samples

    def is_step_start(self, samples: int) -> bool:
        """Whether a step of this ramp starts at ``samples`` (a resumable loader position)."""
        _, ramp_samples = self._ramp_end()
        if samples >= ramp_samples:
            return (samples - ramp_samples) % self.final == 0
        position = 0
        while position < samples:
            position += self.size_at(position)
        return position == samples
