"""Optimizers and LR schedules, each picked by name from one table (the registry).

``OPTIMIZERS`` maps ``optimizer.name`` to an :class:`OptimizerEntry`: its builder, the layouts it
runs under (:data:`LAYOUTS`) and the checks of its own keys. ``LR_SCHEDULES`` maps
``lr_scheduler.decay_type`` to a factor function. :func:`build_optimizer`,
:func:`build_lr_scheduler` and :func:`validate_optimizer` (called by ``trainer/config.py``) read
only these tables, so a name is known, checked and built in one place.

The package, by concern:

================  ================================================================================
``config.py``     the schemas (``OptimizerConfig``, ``MuonConfig``, ``LRSchedulerConfig``) and Muon's
                  default Newton-Schulz coefficients; imports nothing of the trainer
``adamw.py``      AdamW (matrices decayed, vectors not) and the implementation switches
``muon.py``       Muon in every layout (+ AdamW for the rest), its groups, checks and ZeRO-1 weights
``schedules.py``  the LR factor functions
``qk_clip.py``    QK-clip, a step hook after any optimizer's step (``optimizer.qk_clip_tau``); not
                  imported here: it reads ``TrainConfig``, and ``trainer/config.py`` imports this file
================  ================================================================================

ZeRO-1 is not here: ``parallelisms/sharded_optimizer.py``'s ``ShardedOptimizer`` is the seed's
data-parallel strategy (it wraps any per-parameter optimizer and talks to the ``dp_replicate``
group), so it stays with the other strategies and never imports the trainer; a builder wraps its
optimizer in it when given ``shard_mesh``, and an entry declares ``"zero1"`` when it can be wrapped.
The ZeRO-1 refusals that hold for every optimizer (with cp or tp) are ``parallelisms/validate.py``'s.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional, Protocol

import torch
from torch import nn
from torch.optim.lr_scheduler import LambdaLR

from models.errors import ConfigError, check_choice
from trainer.optim.adamw import (
    IMPLEMENTATIONS,
    LRScale,
    build_adamw,
    build_sgd,
    check_sgd_layout,
    param_groups,
)
from trainer.optim.config import LRSchedulerConfig, OptimizerConfig
from trainer.optim.muon import build_muon, muon_cost, muon_param_groups, validate_muon_config
from trainer.optim.schedules import (
    WSD_SHAPES,
    LRFactor,
    warmup_constant,
    warmup_cosine,
    warmup_linear,
    wsd,
    wsd_decay_start,
)

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from parallelisms.config import ParallelismConfig
    from parallelisms.parallel_dims import ParallelDims

__all__ = [
    "LAYOUTS",
    "LR_SCHEDULES",
    "OPTIMIZERS",
    "OptimizerEntry",
    "ScheduleLR",
    "build_lr_scheduler",
    "build_optimizer",
    "check_optimizer_layout",
    "lr_factor",
    "muon_cost",
    "muon_param_groups",
    "optimizer_entry",
    "optimizer_layout",
    "param_groups",
    "validate_optimizer",
]

# The layouts an optimizer may or may not run under -> what turns each on (for the refusal message).
LAYOUTS: dict[str, str] = {
    "ddp": "parallelism.dp_replicate > 1 with dp_shard=1 (our bucketed DDP)",
    "torch_ddp": "parallelism.ddp.impl=torch",
    "zero1": "parallelism.ddp.sharded_optimizer=true",
    "fsdp": "parallelism.dp_shard > 1 (or cp > 1 without DDP)",
    "tp": "parallelism.tp > 1",
    "ep": "parallelism.ep > 1",
    "pp": "parallelism.pp > 1",
    "cp": "parallelism.cp > 1",
    "fault_tolerance": "parallelism.fault_tolerance.enable=true",
}
EVERY_LAYOUT = frozenset(LAYOUTS)


class OptimizerBuilder(Protocol):
    """Builds the optimizer of ``parts`` (the model parts: each parameter once, in their order);
    with ``shard_mesh`` wrapped in ZeRO-1's ShardedOptimizer over that mesh's group;
    ``adamw_modules``: top-level modules kept on AdamW by optimizers that split the parameters;
    ``layout``: the run's :func:`optimizer_layout` (empty: one process, or not known); ``lr_scale``: the
    model's per-parameter factors of the LR (µP, ``ModelSpec.lr_scale``; None: every factor 1)."""

    def __call__(
        self,
        parts: list[nn.Module],
        cfg: OptimizerConfig,
        *,
        device_type: str,
        shard_mesh: Optional[DeviceMesh],
        adamw_modules: tuple[str, ...],
        layout: frozenset[str] = ...,
        lr_scale: Optional[LRScale] = ...,
    ) -> torch.optim.Optimizer: ...


def _no_keys_of_its_own(cfg: OptimizerConfig) -> None:
    """An optimizer that reads only the shared keys (``validate_optimizer`` checks those)."""


def _no_layout_rules(cfg: OptimizerConfig, layout: frozenset[str]) -> None:
    """An optimizer whose keys mean the same under every layout it runs under."""


def validate_sgd_config(cfg: OptimizerConfig) -> None:
    """SGD's keys: momentum in [0, 1), Nesterov only with momentum."""
    if not (math.isfinite(cfg.momentum) and 0.0 <= cfg.momentum < 1.0):
        raise ConfigError(f"optimizer.momentum={cfg.momentum} must lie in [0, 1) (e.g. 0.9).")
    if cfg.nesterov and cfg.momentum == 0.0:
        raise ConfigError(
            "optimizer.nesterov=true needs optimizer.momentum > 0 (e.g. optimizer.momentum=0.9)."
        )


@dataclass(frozen=True)
class OptimizerEntry:
    """One optimizer: ``build``, the :data:`LAYOUTS` it runs under, and the checks of its own keys."""

    build: OptimizerBuilder
    layouts: frozenset[str]
    validate: Callable[[OptimizerConfig], None] = _no_keys_of_its_own
    # refusals that depend on the keys and the layout together (before any process group)
    check_layout: Callable[[OptimizerConfig, frozenset[str]], None] = _no_layout_rules


OPTIMIZERS: dict[str, OptimizerEntry] = {
    # elementwise: runs on the local piece of any layout; ZeRO-1's default inner optimizer
    "adamw": OptimizerEntry(build_adamw, EVERY_LAYOUT),
    # finds each matrix's pieces from the parameter itself (any placement); see muon.py
    "muon": OptimizerEntry(build_muon, EVERY_LAYOUT, validate=validate_muon_config),
    # elementwise (momentum, optionally Nesterov): DiLoCo's outer optimizer, or an inner one
    "sgd": OptimizerEntry(
        build_sgd, EVERY_LAYOUT, validate=validate_sgd_config, check_layout=check_sgd_layout
    ),
}

LR_SCHEDULES: dict[str, LRFactor] = {
    "cosine": warmup_cosine,
    "linear": warmup_linear,
    "constant": warmup_constant,
    # warmup-stable-decay; lr_scheduler.decay_shape / decay_fraction / decay_steps / decay_start_step
    "wsd": wsd,
}


def optimizer_entry(name: str) -> OptimizerEntry:
    """The registered optimizer ``name``; ConfigError naming the registered ones otherwise."""
    check_choice(name, tuple(OPTIMIZERS), "optimizer.name")
    return OPTIMIZERS[name]


def optimizer_layout(dims: ParallelDims, p: ParallelismConfig) -> frozenset[str]:
    """The :data:`LAYOUTS` a run with these degrees and options uses."""
    on = {
        "ddp": dims.ddp_enabled and p.ddp.impl == "custom",
        "torch_ddp": dims.ddp_enabled and p.ddp.impl == "torch",
        "zero1": dims.ddp_enabled and p.ddp.sharded_optimizer,
        "fsdp": dims.fsdp_enabled,
        "tp": dims.tp > 1,
        "ep": dims.ep > 1,
        "pp": dims.pp > 1,
        "cp": dims.cp > 1,
        "fault_tolerance": p.fault_tolerance.enable,
    }
    return frozenset(name for name, used in on.items() if used)


def check_optimizer_layout(name: str, layout: Collection[str], cfg: Optional[OptimizerConfig] = None) -> None:
    """ConfigError when the optimizer ``name`` does not run under every layout in ``layout`` (and, with
    its config ``cfg``, when the entry refuses those keys under that layout)."""
    entry = optimizer_entry(name)
    missing = [x for x in LAYOUTS if x in layout and x not in entry.layouts]
    if missing:
        able = [n for n, e in OPTIMIZERS.items() if set(layout) <= e.layouts]
        raise ConfigError(
            f"optimizer.name={name} does not run under {', '.join(f'{x} ({LAYOUTS[x]})' for x in missing)}; "
            f"choose an optimizer that does ({able or 'none is registered'}) or another layout."
        )
    if cfg is not None:
        entry.check_layout(cfg, frozenset(layout))


def validate_optimizer(o: OptimizerConfig, s: LRSchedulerConfig, total_steps: Optional[int] = None) -> None:
    """The ``optimizer`` and ``lr_scheduler`` groups' checks (no layout needed); with ``total_steps``
    (``training.steps``) also that WSD's phases fit in the run."""
    optimizer_entry(o.name).validate(o)
    if not (math.isfinite(o.qk_clip_tau) and o.qk_clip_tau >= 0):
        raise ConfigError(f"optimizer.qk_clip_tau={o.qk_clip_tau} must be >= 0 (0 = off; Kimi K2 used 100).")
    check_choice(o.implementation, IMPLEMENTATIONS, "optimizer.implementation")
    for key in ("lr", "eps"):
        value = getattr(o, key)
        if not (math.isfinite(value) and value > 0):
            raise ConfigError(
                f"optimizer.{key}={value} must be a finite number > 0 (e.g. optimizer.{key}=3e-4)."
            )
    if not math.isfinite(o.weight_decay) or o.weight_decay < 0:
        raise ConfigError(f"optimizer.weight_decay={o.weight_decay} must be a finite number >= 0.")
    if not all(0.0 <= b < 1.0 for b in o.betas):
        raise ConfigError(f"optimizer.betas={list(o.betas)} must lie in [0, 1).")
    check_choice(s.decay_type, tuple(LR_SCHEDULES), "lr_scheduler.decay_type")
    if s.warmup_steps < 0:
        raise ConfigError(f"lr_scheduler.warmup_steps={s.warmup_steps} must be >= 0.")
    if not 0.0 <= s.min_lr_ratio <= 1.0:
        raise ConfigError(f"lr_scheduler.min_lr_ratio={s.min_lr_ratio} must lie in [0, 1].")
    _validate_wsd(s, total_steps)


def _validate_wsd(s: LRSchedulerConfig, total_steps: Optional[int]) -> None:
    """WSD's keys: only with decay_type=wsd, one way of placing the decay, and phases that fit."""
    if s.decay_type != "wsd":
        for key in ("decay_steps", "decay_start_step"):
            if getattr(s, key) is not None:
                raise ConfigError(
                    f"lr_scheduler.{key}={getattr(s, key)} places the decay of the WSD schedule, but "
                    f"lr_scheduler.decay_type={s.decay_type}; use lr_scheduler=wsd (or drop {key})."
                )
        return
    check_choice(s.decay_shape, tuple(WSD_SHAPES), "lr_scheduler.decay_shape")
    if s.decay_steps is not None and s.decay_start_step is not None:
        raise ConfigError(
            f"lr_scheduler.decay_steps={s.decay_steps} and "
            f"lr_scheduler.decay_start_step={s.decay_start_step} both place the WSD decay; set one of "
            "them (decay_start_step=N with training.steps=N+L decays over the last L steps)."
        )
    if not 0.0 <= s.decay_fraction <= 1.0:
        raise ConfigError(f"lr_scheduler.decay_fraction={s.decay_fraction} must lie in [0, 1].")
    if s.decay_steps is not None and s.decay_steps < 1:
        raise ConfigError(f"lr_scheduler.decay_steps={s.decay_steps} must be >= 1 (or null: decay_fraction).")
    if total_steps is None:
        return
    start = wsd_decay_start(s, total_steps)
    where = (
        f"lr_scheduler.decay_start_step={s.decay_start_step}"
        if s.decay_start_step is not None
        else f"the decay start {start} (training.steps={total_steps} minus the decay length)"
    )
    if not s.warmup_steps <= start <= total_steps:
        raise ConfigError(
            f"{where} must lie in [lr_scheduler.warmup_steps={s.warmup_steps}, "
            f"training.steps={total_steps}]: "
            "the decay starts after the warmup, at the latest when the run ends (then there is no decay: a "
            "stable run to branch from). Raise training.steps, or shorten the decay "
            "(lr_scheduler.decay_steps / decay_fraction) or the warmup."
        )


def build_optimizer(
    model: nn.Module | list[nn.Module],
    cfg: OptimizerConfig,
    *,
    device_type: str,
    shard_mesh: DeviceMesh | None = None,
    adamw_modules: tuple[str, ...] = ("tok_embeddings", "norm", "output"),
    layout: Collection[str] = (),
    lr_scale: Optional[LRScale] = None,
) -> torch.optim.Optimizer:
    """The registered optimizer ``cfg.name`` over ``model`` (a module or the model parts); with
    ``shard_mesh`` it becomes the ZeRO-1 ShardedOptimizer on that mesh. ``layout``: the run's
    :func:`optimizer_layout` (empty: one process), refused unless the entry runs under it. ``lr_scale``:
    per-parameter factors of ``cfg.lr`` (µP: ``ModelSpec.lr_scale``; an optimizer without them refuses)."""
    entry = optimizer_entry(cfg.name)
    check_optimizer_layout(cfg.name, {*layout, *(("zero1",) if shard_mesh is not None else ())})
    parts = model if isinstance(model, list) else [model]
    return entry.build(
        parts,
        cfg,
        device_type=device_type,
        shard_mesh=shard_mesh,
        adamw_modules=adamw_modules,
        layout=frozenset(layout),
        lr_scale=lr_scale,
    )


def lr_factor(
    step: int,
    *,
    warmup_steps: int,
    total_steps: int,
    decay_type: str,
    min_lr_ratio: float,
    decay_shape: str = "linear",
    decay_fraction: float = 0.2,
    decay_steps: Optional[int] = None,
    decay_start_step: Optional[int] = None,
) -> float:
    """Multiplier of the peak LR for the ``step``-th optimizer step (0-based) under the schedule
    ``decay_type`` (a name in :data:`LR_SCHEDULES`; ``trainer/optim/schedules.py``); the ``decay_*``
    keys are WSD's (``LRSchedulerConfig``)."""
    check_choice(decay_type, tuple(LR_SCHEDULES), "lr_scheduler.decay_type")
    cfg = LRSchedulerConfig(
        warmup_steps=warmup_steps,
        decay_type=decay_type,
        min_lr_ratio=min_lr_ratio,
        decay_shape=decay_shape,
        decay_fraction=decay_fraction,
        decay_steps=decay_steps,
        decay_start_step=decay_start_step,
    )
    return LR_SCHEDULES[decay_type](step, cfg, total_steps)


class ScheduleLR(LambdaLR):
    """``LambdaLR`` with :meth:`sync_lr`, which the Trainer calls after loading a checkpoint: it sets
    each group's LR to the schedule's value at the restored step. The optimizer's state holds the LR
    the saving run would have used next (DCP loads it after the scheduler: keys in sorted order), so a
    run that resumes under another schedule (WSD's ``lr_scheduler.decay_start_step`` from a stable
    checkpoint) would take one step at the old LR. Under the same schedule the value is the saved one,
    bit for bit (``base_lr * factor(step)``, as ``LambdaLR.get_lr`` computes it)."""

    def sync_lr(self) -> None:
        for group, base_lr, fn in zip(
            self.optimizer.param_groups, self.base_lrs, self.lr_lambdas, strict=True
        ):
            lr = base_lr * fn(self.last_epoch)
            if isinstance(group["lr"], torch.Tensor):
                group["lr"].fill_(lr)
            else:
                group["lr"] = lr
        self._last_lr = [group["lr"] for group in self.optimizer.param_groups]


def build_lr_scheduler(
    optimizer: torch.optim.Optimizer, cfg: LRSchedulerConfig, total_steps: int
) -> ScheduleLR:
    """The schedule ``cfg.decay_type`` from :data:`LR_SCHEDULES` (a :class:`ScheduleLR`);
    ``scheduler.step()`` once per optimizer step."""
    check_choice(cfg.decay_type, tuple(LR_SCHEDULES), "lr_scheduler.decay_type")
    factor = LR_SCHEDULES[cfg.decay_type]

    def fn(step: int) -> float:
        return factor(step, cfg, total_steps)

    return ScheduleLR(optimizer, fn)
