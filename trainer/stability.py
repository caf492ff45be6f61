"""Loss-spike skipping (``training.spike.*``): a step whose loss or pre-clip gradient norm is an
outlier against the last accepted steps is not applied.

The rule. The window holds the global loss and the global pre-clip gradient norm of the last
``window`` *accepted* steps. Once it holds at least ``warmup`` of them, a step is skipped when, for
the loss or for the gradient norm, ``z = (value - mean) / std > z_threshold`` (mean and population
std over the window; the std is floored at 0.1 % of the mean, so that a window of near-identical
values does not judge noise). Only upward outliers count: a loss that falls fast is training, not a
spike. A non-finite loss or norm is skipped as well (warm-up or not), where without spike skipping
the run stops. Skipped steps never enter the window.

The decision is taken at the step's ``after_clip`` point from two numbers every rank holds alike (the
loss summed over the data/context-parallel ranks, and under fault tolerance over the replica groups;
the pre-clip norm, global over every mesh axis), so every rank of every layout skips the same step.
A skipped step sets ``state.discard``: the trainer drops the gradients and applies nothing -- no
optimizer step (AdamW's and Muon's moments and step counts stay), no LR-schedule step, no MoE
expert-bias update (``before_optimizer_step``), no QK-clip (``after_optimizer_step``) -- and the step
number is not counted toward ``training.steps``: the next batch is trained as the same step number.
The skipped batch is consumed, not repeated (the loader moves on; ``tokens_seen``, the data position,
counts it). After ``max_consecutive`` skips in a row the run stops (:func:`stop_message`).

The window is checkpointed (``spike.*`` keys), so a resumed run judges exactly as an uninterrupted one.
"""

from __future__ import annotations

import logging
import math
import os
from collections import deque
from collections.abc import Mapping
from typing import TYPE_CHECKING, Union, cast

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensor

if TYPE_CHECKING:
    from parallelisms.parallel_dims import ParallelDims
    from trainer.config import SpikeConfig, TrainConfig
    from trainer.step import StepState, TokenLoss

__all__ = ["Figure", "SpikeSkipHook", "SpikeWindow", "ZLossStats", "stop_message"]

Figure = Union[float, int, str, bool]  # a value of a skipped step's record

logger = logging.getLogger("meshwright")

STD_FLOOR = 1e-3  # the window's std is at least this fraction of its mean


def _z(value: float, history: deque[float]) -> float:
    """How many (floored) standard deviations ``value`` lies above the mean of ``history``."""
    n = len(history)
    mean = sum(history) / n
    std = math.sqrt(sum((v - mean) ** 2 for v in history) / n)
    return (value - mean) / max(std, STD_FLOOR * abs(mean), 1e-30)


class SpikeWindow:
    """The running window of accepted steps and the skip counters (a DCP ``Stateful``)."""

    def __init__(self, cfg: SpikeConfig) -> None:
        self.cfg = cfg
        self.losses: deque[float] = deque(maxlen=cfg.window)
        self.grad_norms: deque[float] = deque(maxlen=cfg.window)
        self.consecutive = 0  # skips in a row up to the last judged step
        self.skipped_total = 0

    def judge(self, loss: float, grad_norm: float) -> dict[str, Figure]:
        """The figures of a step and, under ``"spike/reason"``, why it is skipped ("" = accepted)."""
        out: dict[str, Figure] = {"spike/loss": loss, "spike/grad_norm": grad_norm}
        if not (math.isfinite(loss) and math.isfinite(grad_norm)):
            out["spike/reason"] = "non-finite loss or gradient norm"
            return out
        reasons = []
        if len(self.losses) >= self.cfg.warmup:
            for name, value, history in (
                ("loss", loss, self.losses),
                ("grad_norm", grad_norm, self.grad_norms),
            ):
                z = _z(value, history)
                out[f"spike/z_{name}"] = z
                if z > self.cfg.z_threshold:
                    reasons.append(f"{name} {value:.4g} is {z:.1f} std above the window mean")
        out["spike/reason"] = "; ".join(reasons)
        return out

    def accept(self, loss: float, grad_norm: float) -> None:
        self.losses.append(loss)
        self.grad_norms.append(grad_norm)
        self.consecutive = 0

    def reject(self) -> None:
        self.consecutive += 1
        self.skipped_total += 1

    def state_dict(self) -> dict[str, object]:
        return {
            "losses": list(self.losses),
            "grad_norms": list(self.grad_norms),
            "consecutive": self.consecutive,
            "skipped_total": self.skipped_total,
        }

    def load_state_dict(self, state_dict: Mapping[str, object]) -> None:
        losses, norms = (
            cast("list[float]", state_dict["losses"]),
            cast("list[float]", state_dict["grad_norms"]),
        )
        self.losses = deque(map(float, losses), maxlen=self.cfg.window)
        self.grad_norms = deque(map(float, norms), maxlen=self.cfg.window)
        self.consecutive = int(cast(int, state_dict["consecutive"]))
        self.skipped_total = int(cast(int, state_dict["skipped_total"]))


def stop_message(step: int, consecutive: int, checkpoint_folder: str, checkpoints_on: bool) -> str:
    """Why the run stops after ``consecutive`` skips in a row ending at ``step``, naming the newest
    complete checkpoint to resume from."""
    from trainer.checkpoint.storage import complete_steps, step_dir

    steps = complete_steps(checkpoint_folder) if checkpoints_on and os.path.isdir(checkpoint_folder) else []
    newest = (
        f"the newest checkpoint is {step_dir(checkpoint_folder, steps[-1])}" if steps else "no checkpoint"
    )
    return (
        f"{consecutive} consecutive steps were skipped as loss spikes (training.spike), the last at step "
        f"{step}: the run stopped ({newest}). Inspect the data around this position, lower optimizer.lr "
        "or resume from an earlier checkpoint; raise training.spike.z_threshold or "
        "training.spike.max_consecutive if these steps are sound."
    )


class SpikeSkipHook:
    """Spike skipping at the step's ``after_clip`` point (``trainer/hooks.py``); runs after fault
    tolerance's hook (a step it discarded is not judged; the loss is summed over the groups first)."""

    def __init__(self, window: SpikeWindow, dims: ParallelDims, cfg: TrainConfig) -> None:
        self.window = window
        self.dims = dims
        self.max_consecutive = cfg.training.spike.max_consecutive
        self.checkpoint_folder = os.path.join(cfg.job.dump_folder, cfg.checkpoint.folder)
        self.checkpoints_on = cfg.checkpoint.enable
        self._z: dict[str, float] = {}  # the z-scores of the step being taken (once warmed up)

    def _global_loss(self, state: StepState) -> torch.Tensor:
        """The step's mean token loss over the data/context-parallel ranks (one all-reduce)."""
        assert state.loss_sum is not None and state.num_tokens is not None
        loss = (state.loss_sum / state.num_tokens).detach().float().reshape(1)
        if self.dims.dp_cp > 1:
            dist.all_reduce(loss, group=self.dims.loss_mesh.get_group())
        return loss

    def after_clip(self, state: StepState) -> None:
        if state.discard:  # fault tolerance dropped the step; it is retried, not judged
            return
        assert state.grad_norm is not None
        loss = self._global_loss(state)
        if isinstance(loss, FakeTensor):  # a rehearsal (trainer/rehearse.py): no values, the step is taken
            return
        loss_value, norm_value = torch.cat([loss, state.grad_norm.detach().float().reshape(1)]).tolist()
        verdict = self.window.judge(loss_value, norm_value)
        self._z = {k: float(v) for k, v in verdict.items() if k.startswith("spike/z_")}
        if not verdict["spike/reason"]:
            self.window.accept(loss_value, norm_value)
            return
        self.window.reject()
        state.discard = True
        verdict.update(
            {
                "skipped": True,
                "spike/consecutive": self.window.consecutive,
                "spike/skipped_total": self.window.skipped_total,
            }
        )
        logger.warning(
            f"step {state.step} skipped (loss spike: {verdict['spike/reason']}); its batch is consumed, "
            f"nothing is applied ({self.window.consecutive} in a row, {self.window.skipped_total} in all)"
        )
        if self.window.consecutive >= self.max_consecutive:
            verdict["spike/stop"] = stop_message(
                state.step, self.window.consecutive, self.checkpoint_folder, self.checkpoints_on
            )
        state.skipped = verdict

    def metrics(self, state: StepState, device: torch.device) -> dict[str, float]:
        """``spike/skipped_total`` and the step's ``spike/z_loss``, ``spike/z_grad_norm`` (after the
        warm-up: how far from a skip it was) on logged steps (no collective)."""
        return {"spike/skipped_total": self.window.skipped_total, **self._z}


class ZLossStats:
    """The z-loss of a step (``training.z_loss_weight``), logged apart from the loss as ``z_loss``:
    weight x mean over the step's target tokens of log Z^2. The loss function keeps this rank's sums
    (``TokenLoss.z_sums``; under a pipeline only the last stage computes the loss); on logged steps they
    are summed over the data/context-parallel ranks and the pipeline stages (tensor-parallel ranks hold
    the same sum). Under fault tolerance it is this replica group's own z-loss: the mean over the
    group's target tokens (counted at ``count_tokens``, before fault tolerance widens the count to every
    group)."""

    def __init__(self, loss: TokenLoss, dims: ParallelDims) -> None:
        self.loss = loss
        self.dims = dims
        self._tokens = torch.ones(())

    def begin_step(self, state: StepState) -> None:
        self.loss.z_sums.clear()

    def count_tokens(self, state: StepState) -> None:
        assert state.num_tokens is not None
        self._tokens = state.num_tokens.clone()  # this group's target tokens over its dp x cp ranks

    def metrics(self, state: StepState, device: torch.device) -> dict[str, float]:
        total = torch.stack(self.loss.z_sums).sum() if self.loss.z_sums else torch.zeros((), device=device)
        total = total.reshape(1)
        if self.dims.dp_cp > 1:
            dist.all_reduce(total, group=self.dims.loss_mesh.get_group())
        if self.dims.pp > 1:
            dist.all_reduce(total, group=self.dims.get_mesh("pp").get_group())
        return {"z_loss": (total / self._tokens.clamp(min=1)).item()}
