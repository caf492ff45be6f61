"""Optimizer and learning-rate schedule built from the config."""

from __future__ import annotations

import functools
import math
from typing import Any

import torch
import torch.distributed as dist
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


def _clean_name(name: str) -> str:
    """A parameter's name as the model names it (without compile / checkpoint wrapper prefixes)."""
    return name.replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", "")


def muon_param_groups(
    model: nn.Module | list[nn.Module], cfg: OptimizerConfig, adamw_modules: tuple[str, ...]
) -> list[dict[str, Any]]:
    """Muon for every >=2-D weight outside ``adamw_modules`` (the embedding and the output head,
    e.g. ``spec.first_modules + spec.last_modules``); AdamW for those and every 1-D parameter.
    Each group carries its own hyperparameters and the parameters' names (they key Muon's units)."""
    parts = model if isinstance(model, list) else [model]
    named: dict[torch.Tensor, str] = {}
    for part in parts:
        for name, p in part.named_parameters():
            if p.requires_grad:
                named.setdefault(p, _clean_name(name))
    muon, decay, no_decay = [], [], []
    for p, name in named.items():
        if p.ndim < 2:
            no_decay.append((name, p))
        elif name.split(".", 1)[0] in adamw_modules:
            decay.append((name, p))
        else:
            muon.append((name, p))
    m = cfg.muon
    groups = [
        {
            "params": [p for _, p in muon],
            "names": [n for n, _ in muon],
            "use_muon": True,
            "lr": m.lr,
            "weight_decay": m.weight_decay,
            "momentum": m.momentum,
            "nesterov": m.nesterov,
            "ns_steps": m.ns_steps,
            "ns_coefficients": tuple(m.ns_coefficients),
            "eps": m.eps,
            "adjust_lr_fn": m.adjust_lr_fn,
        },
        {
            "params": [p for _, p in decay],
            "names": [n for n, _ in decay],
            "use_muon": False,
            "lr": cfg.lr,
            "betas": tuple(cfg.betas),
            "eps": cfg.eps,
            "weight_decay": cfg.weight_decay,
        },
        {
            "params": [p for _, p in no_decay],
            "names": [n for n, _ in no_decay],
            "use_muon": False,
            "lr": cfg.lr,
            "betas": tuple(cfg.betas),
            "eps": cfg.eps,
            "weight_decay": 0.0,
        },
    ]
    return [g for g in groups if g["params"]]


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
    adamw_modules: tuple[str, ...] = ("tok_embeddings", "norm", "output"),
) -> torch.optim.Optimizer:
    """AdamW (or ``name=muon``: Muon + AdamW, see :func:`muon_param_groups`) over ``model`` (a
    module or the model parts); with ``shard_mesh`` it becomes the ZeRO-1 ShardedOptimizer on that
    mesh (Muon: each owner orthogonalises its whole matrices). Without it, Muon spreads its
    matrices over the world group's ranks (``parallelisms.muon``)."""
    if cfg.name == "muon":
        return _build_muon(model, cfg, device_type, shard_mesh, adamw_modules)
    kwargs: dict[str, Any] = {"lr": cfg.lr, "betas": tuple(cfg.betas), "eps": cfg.eps}
    kwargs.update(_impl_kwargs(cfg, device_type))
    groups = param_groups(model, cfg.weight_decay)
    if shard_mesh is not None:
        from parallelisms.sharded_optimizer import ShardedOptimizer

        return ShardedOptimizer(groups, torch.optim.AdamW, shard_mesh.get_group(), **kwargs)
    return torch.optim.AdamW(groups, **kwargs)


def _build_muon(
    model: nn.Module | list[nn.Module],
    cfg: OptimizerConfig,
    device_type: str,
    shard_mesh: DeviceMesh | None,
    adamw_modules: tuple[str, ...],
) -> torch.optim.Optimizer:
    from parallelisms.muon import NS_DTYPES, Muon

    groups = muon_param_groups(model, cfg, adamw_modules)
    kwargs: dict[str, Any] = {
        "ns_dtype": NS_DTYPES[cfg.muon.ns_dtype],
        "adamw_kwargs": _impl_kwargs(cfg, device_type),
    }
    if shard_mesh is not None:
        from parallelisms.sharded_optimizer import ShardedOptimizer

        # ns_dtype / adamw_kwargs configure the inner optimizer, they are no group hyperparameters
        inner = functools.partial(Muon, **kwargs)
        return ShardedOptimizer(groups, inner, shard_mesh.get_group(), cost=muon_cost)  # type: ignore[arg-type]
    group = dist.group.WORLD if dist.is_available() and dist.is_initialized() else None
    return Muon(groups, group, **kwargs)


def muon_cost(p: torch.Tensor, group: dict[str, Any]) -> int:
    """ZeRO-1 owner balance under Muon: Newton-Schulz FLOPs for Muon matrices, bytes otherwise."""
    from parallelisms.muon import ns_flops

    if group.get("use_muon"):
        stack = p.shape[0] if p.ndim == 3 else 1
        return stack * ns_flops(p.shape[-2], p.shape[-1])
    return p.numel() * p.element_size()


def build_qk_clip(parts: list[nn.Module], spec: Any, cfg: Any, dims: Any) -> Any:
    """QK-clip over this rank's attention modules (``parallelisms/qk_clip.py``), or None when
    ``optimizer.qk_clip_tau`` is 0."""
    tau = cfg.optimizer.qk_clip_tau
    if tau <= 0:
        return None
    from parallelisms.qk_clip import QKClip

    prefix = f"{spec.blocks}."
    attentions = []
    for part in parts:
        for name, module in part.named_modules():
            name = _clean_name(name)
            if hasattr(module, "record_max_logit") and name.startswith(prefix):
                attentions.append((int(name[len(prefix) :].split(".", 1)[0]), module))
    tp_rank = dims.get_mesh("tp").get_local_rank() if dims.tp > 1 else 0
    return QKClip(
        attentions,
        num_layers=cfg.model.n_layers,
        n_heads=cfg.model.n_heads,
        n_kv_heads=cfg.model.kv_heads,
        tau=tau,
        tp_rank=tp_rank,
        tp_size=dims.tp,
    )


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
