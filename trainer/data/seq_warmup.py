"""Sequence-length warmup (``training.seq_len_warmup``): short sequences first, cut from the final windows.

Stage ``i`` has its ``seq_len`` ``s`` (a divisor of ``training.seq_len`` ``S``) and ends before step
``until_step`` (1-based); later steps use ``S``. The loader is unchanged -- it reads the same windows of
``S`` tokens at the same sample positions as a run without warmup, so a resume mid-warmup is exact and
the data order does not depend on the warmup -- and a step of a stage splits each of its rows into
``k = S / s`` consecutive rows of ``s`` tokens (inputs, labels and positions alike): every token is
trained once per epoch, a step keeps its tokens (``k`` times the rows), and a micro batch becomes
``k x training.micro_batch_size`` rows of ``s`` tokens (the accumulation count is unchanged). A
position restarts at each shorter window's start, as the loader's rule does at a window's start: the
split positions are ``min(position, offset in the shorter window)``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from models.errors import ConfigError

__all__ = ["SeqLenStage", "SeqLenWarmup", "split_positions", "split_rows", "validate_seq_len_warmup"]


@dataclass
class SeqLenStage:
    """One stage of ``training.seq_len_warmup``: its sequence length, until (before) ``until_step``."""

    seq_len: int = 0
    until_step: int = 0


def validate_seq_len_warmup(stages: Sequence[SeqLenStage], final_seq_len: int, divisor: int = 1) -> None:
    """``ConfigError`` naming the stage: lengths dividing ``training.seq_len`` (and the layout's
    ``divisor``: context / sequence parallel chunks), shorter than it, bounds increasing."""
    last = 1
    for i, s in enumerate(stages):
        key = f"training.seq_len_warmup[{i}]"
        if not (0 < s.seq_len < final_seq_len and final_seq_len % s.seq_len == 0):
            raise ConfigError(
                f"{key}.seq_len={s.seq_len} must divide training.seq_len={final_seq_len} and be shorter "
                f"(the windows are cut at {final_seq_len} and split), e.g. {final_seq_len // 2}."
            )
        if s.seq_len % divisor:
            raise ConfigError(
                f"{key}.seq_len={s.seq_len} is not a multiple of {divisor}, which context / sequence "
                "parallelism split every sequence into; choose a multiple of it."
            )
        if s.until_step <= last:
            raise ConfigError(
                f"{key}.until_step={s.until_step} must be greater than {last} (the previous stage's bound; "
                "a stage's last step is until_step - 1)."
            )
        last = s.until_step


class SeqLenWarmup:
    """The split factor of each step (see the module docstring)."""

    def __init__(self, stages: Sequence[SeqLenStage], final_seq_len: int) -> None:
        validate_seq_len_warmup(stages, final_seq_len)
        self.stages = [(s.until_step, final_seq_len // s.seq_len) for s in stages]

    def factor(self, step: int) -> int:
        """``k``: each row of 1-based step ``step`` becomes ``k`` rows (1 after the warmup)."""
        for until, k in self.stages:
            if step < until:
                return k
        return 1


def split_rows(t: Tensor, k: int) -> Tensor:
    """(B, S, ...) -> (B*k, S/k, ...): each row's ``k`` consecutive pieces, in order."""
    return t.reshape(t.shape[0] * k, t.shape[1] // k, *t.shape[2:])


def split_positions(positions: Tensor, k: int) -> Tensor:
    """Positions (B, S) of the rows split by :func:`split_rows`, restarting at each piece's start."""
    pieces = split_rows(positions, k)  # (B*k, S/k)
    offset = torch.arange(pieces.shape[1], device=pieces.device, dtype=pieces.dtype)
    return torch.minimum(pieces, offset.expand_as(pieces))
