"""Optimizer and learning-rate schedule built from the config."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.optim.lr_scheduler import LambdaLR

from trainer.config import LRSchedulerConfig, OptimizerConfig


def param_groups(model: nn.Module | list[nn.Module], weight_decay: float) -> list[dict[str, Any]]:
    """Decay matrices (linear and embedding weights); never decay norms or other vectors. ``model``:
    a module or the model parts (each parameter once, in the parts' order)."""
    decay, no_decay = [], []
    parts = model if isinstance(model, list) else [model]
    for p in dict.fromkeys(p for part in parts for p in part.parameters()):
        if not p.requires_grad:
            continue
        (decay if p.ndim >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}]
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    return groups


def _impl_kwargs(cfg: OptimizerConfig, device_type: str) -> dict[str, bool]:
    impl = cfg.implementation
    if impl == "auto":
        impl = "fused" if device_type == "cuda" else "foreach"
    return {"fused": impl == "fused", "foreach": impl == "foreach"}


def build_optimizer(
    model: nn.Module | list[nn.Module],
    cfg: OptimizerConfig,
    *,
    device_type: str,
    shard_mesh: DeviceMesh | None = None,
) -> torch.optim.Optimizer:
    """AdamW over ``model`` (a module or the model parts); with ``shard_mesh`` it becomes the ZeRO-1 ShardedOptimizer on that mesh."""
    kwargs: dict[str, Any] = {"lr": cfg.lr, "betas": tuple(cfg.betas), "eps": cfg.eps}
    kwargs.update(_impl_kwargs(cfg, device_type))
    groups = param_groups(model, cfg.weight_decay)
    if shard_mesh is not None:
        from parallelisms.sharded_optimizer import ShardedOptimizer

        return ShardedOptimizer(groups, torch.optim.AdamW, shard_mesh.get_group(), **kwargs)
    return torch.optim.AdamW(groups, **kwargs)


def lr_factor(
    step: int, *, warmup_steps: int, total_steps: int, decay_type: str, min_lr_ratio: float
) -> float:
    """Multiplier of the peak LR for the ``step``-th optimizer step (0-based).

    Linear warmup reaches the peak at step ``warmup_steps - 1``; then cosine or linear
    decay reaches ``min_lr_ratio`` at the last step and stays there.
    """
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if decay_type == "constant":
        return 1.0
    decay_steps = max(1, total_steps - warmup_steps - 1)
    progress = min(1.0, (step - warmup_steps) / decay_steps)
    if decay_type == "linear":
        shape = 1.0 - progress
    else:
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    return min_lr_ratio + (1.0 - min_lr_ratio) * shape


def build_lr_scheduler(
    optimizer: torch.optim.Optimizer, cfg: LRSchedulerConfig, total_steps: int
) -> LambdaLR:
    """Warmup + decay schedule; ``scheduler.step()`` once per optimizer step."""

    def fn(step: int) -> float:
        return lr_factor(
            step,
            warmup_steps=cfg.warmup_steps,
            total_steps=total_steps,
            decay_type=cfg.decay_type,
            min_lr_ratio=cfg.min_lr_ratio,
        )

    return LambdaLR(optimizer, fn)
