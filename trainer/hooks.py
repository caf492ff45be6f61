"""Step hooks: the per-step extras of a run, run by the trainer from one ordered list.

A hook is any object with some of the methods below (each takes the step's :class:`StepState`); the
trainer calls every hook that has a point, in list order, at that point of ``Trainer.train_step``:

==========================  ===================================================================
``begin_step``              before the batch is read (fault tolerance's quorum and heal; the MoE
                            load balancer, QK-clip and MTP statistics reset their per-step records)
``count_tokens``            the step's target tokens over this group's dp x cp ranks are in
                            ``state.num_tokens``; a hook may widen them (fault tolerance: over the
                            replica groups, setting ``state.replicas``)
``after_backward``          this group's gradients are complete (fault tolerance: mean over groups)
``after_clip``              ``state.grad_norm`` (pre-clip) and ``state.loss_sum`` are known; a hook
                            may set ``state.discard`` (fault tolerance: a group failed in the step;
                            spike skipping, which also sets ``state.skipped``: an outlier step)
``before_optimizer_step``   the step will be applied (finite, not discarded): the gradients are
                            final (the MoE expert-bias update; the ledgers measure gradients)
``after_optimizer_step``    the weights are updated (QK-clip scales the q/k rows of hot heads)
``metrics``                 on logged steps only: ``metrics(state, device) -> dict`` of entries for
                            ``metrics.jsonl``; may be a collective (every rank calls it)
==========================  ===================================================================

Hooks come from :func:`build_step_hooks`: one table of builders, each given a :class:`HookContext`
and returning a hook or None (a dense family has no load balancer; QK-clip is off unless
``optimizer.qk_clip_tau > 0``). What a family needs is declared on its ``ModelSpec``
(``has_experts``, ``mtp_depth``, ``qk_clip``); the builders read the spec, never the model's args.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional, Union

import torch
from torch import nn

from trainer.step import StepState, TokenLoss

if TYPE_CHECKING:
    from models.spec import ModelSpec
    from parallelisms.parallel_dims import ParallelDims
    from parallelisms.pipeline_parallel import Pipeline
    from trainer.config import TrainConfig
    from trainer.observe.comm_ledger import CommLedger
    from trainer.observe.memory_ledger import MemoryLedger
    from trainer.resilience.fault_tolerance import FaultTolerance
    from trainer.stability import SpikeWindow

# A hook is any object with some of the points' methods (structural: hooks in parallelisms/ cannot
# import this module); ``Hook`` names that role in signatures.
Hook = object

__all__ = [
    "HOOK_BUILDERS",
    "HOOK_POINTS",
    "HookContext",
    "LedgerHook",
    "StepHooks",
    "StepState",
    "build_step_hooks",
]

HOOK_POINTS = (
    "begin_step",
    "count_tokens",
    "after_backward",
    "after_clip",
    "before_optimizer_step",
    "after_optimizer_step",
)


@dataclass
class HookContext:
    """What a hook builder may use: the run's config and spec, this rank's model parts and mesh."""

    cfg: TrainConfig
    spec: ModelSpec
    dims: ParallelDims
    model: Union[nn.Module, Pipeline]  # what runs the step: the (DDP-wrapped) module or the Pipeline
    model_parts: list[nn.Module]
    parameters: list[nn.Parameter]
    optimizer: torch.optim.Optimizer
    device: torch.device
    tokens_per_step: int  # the global batch's tokens (every replica group)
    forwards_per_step: int  # forward calls per step: microbatches (pipeline) or accumulation steps
    ft: Optional[FaultTolerance] = None  # torchft replica groups (parallelism.fault_tolerance)
    spike: Optional[SpikeWindow] = None  # training.spike: the checkpointed window of accepted steps
    loss: Optional[TokenLoss] = None  # the step's loss function (its z-loss sums: training.z_loss_weight)


class StepHooks:
    """The ordered hooks of a run; ``run(point, state)`` calls every hook that has ``point``."""

    def __init__(self, hooks: Sequence[Hook]) -> None:
        self.hooks = list(hooks)
        self._at = {p: [getattr(h, p) for h in self.hooks if hasattr(h, p)] for p in HOOK_POINTS}
        self._metrics = [h.metrics for h in self.hooks if hasattr(h, "metrics")]

    def run(self, point: str, state: StepState) -> None:
        for fn in self._at[point]:
            fn(state)

    def measuring(self) -> contextlib.ExitStack:
        """The hooks that measure a whole step (the ledgers) entered around it: for logged steps."""
        stack = contextlib.ExitStack()
        for hook in self.hooks:
            if hasattr(hook, "measuring"):
                stack.enter_context(hook.measuring())
        return stack

    def metrics(self, state: StepState, device: torch.device) -> dict[str, Any]:
        """Every hook's entries for this logged step, in list order (collective: every rank calls it)."""
        out: dict[str, Any] = {}
        for fn in self._metrics:
            out.update(fn(state, device))
        return out

    def of_type(self, cls: type) -> Optional[Hook]:
        """The hook of class ``cls``, if the run has one (tests and benchmarks inspect hooks)."""
        return next((h for h in self.hooks if isinstance(h, cls)), None)


HookBuilder = Callable[[HookContext], Optional[Hook]]


class LedgerHook:
    """A ledger (``metrics.comm_ledger`` / ``metrics.memory_ledger``) as a step hook: it measures the
    logged steps it is entered around, reads the gradients once they exist, and reports under ``key``."""

    def __init__(
        self,
        ledger: Union[CommLedger, MemoryLedger],
        key: str,
        collect: Callable[[], dict[str, Any]],
        parameters: list[nn.Parameter],
    ) -> None:
        self.ledger, self.key, self._collect, self.parameters = ledger, key, collect, parameters

    def measuring(self) -> Union[CommLedger, MemoryLedger]:
        return self.ledger

    def before_optimizer_step(self, state: StepState) -> None:
        if self.ledger.active:  # the gradients exist only now
            self.ledger.measure_gradients(self.parameters)

    def metrics(self, state: StepState, device: torch.device) -> dict[str, Any]:
        return {self.key: self._collect()}  # every rank's figures (a collective)


def _load_balance(c: HookContext) -> Optional[Hook]:
    """MoE families: per-step expert statistics, aux-loss weight and expert-bias update."""
    from parallelisms.expert_parallel import LoadBalancer

    return LoadBalancer.build(
        c.model_parts,
        c.spec,
        c.dims,
        c.cfg.model,
        tokens_per_step=c.tokens_per_step,
        forwards_per_step=c.forwards_per_step,
    )


def _qk_clip(c: HookContext) -> Optional[Hook]:
    """``optimizer.qk_clip_tau > 0``: scale the q/k rows of heads whose max logit exceeded tau."""
    from trainer.optim.qk_clip import build_qk_clip

    return build_qk_clip(c.model_parts, c.spec, c.cfg, c.dims)


def _mtp(c: HookContext) -> Optional[Hook]:
    """Multi-token prediction (DeepSeek-V3): its gradient weight per step and its logged mtp_loss."""
    from trainer.observe.mtp import MTPStats

    return MTPStats.build(
        c.model_parts, c.spec, c.cfg.model, c.dims, tokens_per_step=c.tokens_per_step, loss=c.loss
    )


def _comm_ledger(c: HookContext) -> Optional[LedgerHook]:
    """``metrics.comm_ledger``: bytes and calls of every collective of each logged step."""
    if not c.cfg.metrics.comm_ledger:
        return None
    from parallelisms.parallel_dims import DP_REPLICATE_CP
    from trainer.observe.comm_ledger import CommLedger, axis_names_of_groups

    names = (*c.dims.mesh_dim_names, *c.dims.flat_views, DP_REPLICATE_CP)
    ledger = CommLedger(axis_names_of_groups(c.dims.mesh, names))
    return LedgerHook(ledger, "comm", lambda: ledger.collect(c.parameters, c.optimizer), c.parameters)


def _fault_tolerance(c: HookContext) -> Optional[Hook]:
    """torchft replica groups: quorum, token count and gradients over the groups, commit."""
    if c.ft is None:
        return None
    from trainer.resilience.fault_tolerance import FaultToleranceHook

    if c.ft.semi is not None:  # semi_sync: DiLoCo's schedule after the inner step, no per-step exchange
        return c.ft.semi
    return FaultToleranceHook(c.ft, c.model, c.parameters)


def _spike_skip(c: HookContext) -> Optional[Hook]:
    """``training.spike.enable``: a step whose loss or grad norm is an outlier is not applied."""
    if c.spike is None:
        return None
    from trainer.stability import SpikeSkipHook

    return SpikeSkipHook(c.spike, c.dims, c.cfg)


def _z_loss(c: HookContext) -> Optional[Hook]:
    """``training.z_loss_weight > 0``: the step's z-loss, logged apart from the loss (``z_loss``)."""
    if c.loss is None or c.loss.z_loss_weight == 0.0:
        return None
    from trainer.stability import ZLossStats

    return ZLossStats(c.loss, c.dims)


def _semi_sync_skipped(c: HookContext) -> Optional[Hook]:
    """semi_sync with spike skipping: a skipped step still counts toward torchft's sync schedule."""
    if c.ft is None or c.ft.semi is None or c.spike is None:
        return None
    from trainer.resilience.semi_sync import SkippedStepCounter

    return SkippedStepCounter(c.ft.semi)


def _layer_stats(c: HookContext) -> Optional[Hook]:
    """``metrics.layer_stats_freq > 0``: per block, embedding and head gradient/parameter/update norms."""
    if c.cfg.metrics.layer_stats_freq <= 0:
        return None
    from trainer.observe.layer_stats import LayerStats

    return LayerStats(c.model_parts, c.spec, c.dims, c.cfg.metrics.layer_stats_freq)


def _memory_ledger(c: HookContext) -> Optional[LedgerHook]:
    """``metrics.memory_ledger``: saved tensors, model states and buffers of each logged step."""
    if not c.cfg.metrics.memory_ledger:
        return None
    from trainer.observe.memory_ledger import MemoryLedger

    ledger = MemoryLedger(c.model_parts, c.spec, model=c.model, optimizer=c.optimizer, device=c.device)
    return LedgerHook(ledger, "memory", lambda: ledger.collect(c.parameters), c.parameters)


def _float8_scales(c: HookContext) -> Optional[Hook]:
    """``training.float8.fsdp_float8_all_gather``: the float8 weights' dynamic scales after each step."""
    f8 = c.cfg.training.float8
    if not (f8.enable and f8.fsdp_float8_all_gather):
        return None
    from parallelisms.float8 import Float8ScaleHook

    return Float8ScaleHook(c.model_parts)


# The hooks of a run, in the order they run at every point (and their metrics appear in a record).
HOOK_BUILDERS: tuple[HookBuilder, ...] = (
    _load_balance,
    _qk_clip,
    _mtp,
    _comm_ledger,
    _z_loss,  # before fault tolerance: counts this replica group's own target tokens
    _fault_tolerance,
    _spike_skip,  # after fault tolerance: judges the loss summed over the replica groups
    _semi_sync_skipped,  # after spike skipping: its skipped steps count toward DiLoCo's syncs
    _layer_stats,  # after fault tolerance: the gradients averaged over the replica groups
    _float8_scales,  # after QK-clip's and fault tolerance's weight changes (row scaling, healing)
    _memory_ledger,
)


def build_step_hooks(context: HookContext, builders: Sequence[HookBuilder] = HOOK_BUILDERS) -> StepHooks:
    """The run's hooks: every builder's hook that applies (a builder returns None when it does not)."""
    return StepHooks([h for build in builders if (h := build(context)) is not None])
