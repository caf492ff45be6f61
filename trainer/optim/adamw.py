"""AdamW: matrices decayed, vectors not; under ZeRO-1 the ShardedOptimizer's inner optimizer.

Also the AdamW implementation switches (``optimizer.implementation``), which Muon's inner AdamW
shares.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Optional

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from models.common import unwrapped_name
from models.errors import ConfigError
from parallelisms.sharded_optimizer import ShardedOptimizer

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from trainer.optim.config import OptimizerConfig

# optimizer.implementation: auto = fused where torch has the fused kernel (CUDA and the CPU), else foreach
IMPLEMENTATIONS = ("auto", "fused", "foreach", "for-loop")
# Devices with torch.optim.AdamW(fused=True) kernels that ``auto`` picks. On the CPU the fused kernel
# is one vectorised pass per tensor (about 6x faster than foreach there, which falls back to one
# kernel per tensor and op); it differs from foreach by rounding only (~1 ulp per step).
FUSED_DEVICES = ("cuda", "cpu")


# (parameter name as the model names it, its ndim) -> factor of optimizer.lr (µP: ModelSpec.lr_scale)
LRScale = Callable[[str, int], float]


def param_groups(
    model: nn.Module | list[nn.Module],
    weight_decay: float,
    *,
    lr: Optional[float] = None,
    lr_scale: Optional[LRScale] = None,
) -> list[dict[str, Any]]:
    """Decay matrices (linear and embedding weights); never decay norms or other vectors. ``model``:
    a module or the model parts (each parameter once, in the parts' order). With ``lr_scale`` (µP)
    each (decay, factor) pair is a group of its own with ``lr * factor`` as its LR, in order of first
    appearance; without, the two groups take the optimizer's LR."""
    decay: list[nn.Parameter] = []
    no_decay: list[nn.Parameter] = []
    parts = model if isinstance(model, list) else [model]
    if lr_scale is not None:
        if lr is None:
            raise ValueError("param_groups: lr_scale needs the peak lr")
        scaled: dict[tuple[bool, float], list[nn.Parameter]] = {}
        seen: set[int] = set()
        for part in parts:
            for name, p in part.named_parameters():
                if not p.requires_grad or id(p) in seen:
                    continue
                seen.add(id(p))
                scaled.setdefault((p.ndim >= 2, lr_scale(unwrapped_name(name), p.ndim)), []).append(p)
        return [
            {"params": ps, "weight_decay": weight_decay if is_matrix else 0.0, "lr": lr * factor}
            for (is_matrix, factor), ps in scaled.items()
        ]
    for p in dict.fromkeys(p for part in parts for p in part.parameters()):
        if not p.requires_grad:
            continue
        (decay if p.ndim >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}]
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    return groups


def impl_kwargs(cfg: OptimizerConfig, device_type: str) -> dict[str, bool]:
    """torch.optim.AdamW's ``fused`` / ``foreach`` switches for ``optimizer.implementation``."""
    impl = cfg.implementation
    if impl == "auto":
        impl = "fused" if device_type in FUSED_DEVICES else "foreach"
    return {"fused": impl == "fused", "foreach": impl == "foreach"}


def build_adamw(
    parts: list[nn.Module],
    cfg: OptimizerConfig,
    *,
    device_type: str,
    shard_mesh: Optional[DeviceMesh],
    adamw_modules: tuple[str, ...],
    layout: frozenset[str] = frozenset(),
    lr_scale: Optional[LRScale] = None,
) -> torch.optim.Optimizer:
    """torch.optim.AdamW over :func:`param_groups` (``adamw_modules`` and ``layout`` unused: every
    parameter is AdamW's, elementwise on its local piece; ``lr_scale``: µP's per-parameter LR factors);
    with ``shard_mesh`` the ZeRO-1 ShardedOptimizer over that mesh's group wraps it."""
    kwargs: dict[str, Any] = {"lr": cfg.lr, "betas": tuple(cfg.betas), "eps": cfg.eps}
    kwargs.update(impl_kwargs(cfg, device_type))
    return _elementwise(torch.optim.AdamW, parts, cfg, shard_mesh, lr_scale, kwargs)


def _elementwise(
    cls: type[torch.optim.Optimizer],
    parts: list[nn.Module],
    cfg: OptimizerConfig,
    shard_mesh: Optional[DeviceMesh],
    lr_scale: Optional[LRScale],
    kwargs: dict[str, Any],
) -> torch.optim.Optimizer:
    """An elementwise torch optimizer over :func:`param_groups`, wrapped by the ZeRO-1
    ShardedOptimizer over ``shard_mesh``'s group when there is one."""
    groups = param_groups(parts, cfg.weight_decay, lr=cfg.lr, lr_scale=lr_scale)
    if shard_mesh is not None:
        return ShardedOptimizer(groups, cls, shard_mesh.get_group(), **kwargs)
    return cls(groups, **kwargs)


# the layouts (trainer.optim.optimizer_layout) whose parameters are DTensors
_DTENSOR_LAYOUTS = frozenset({"fsdp", "tp", "ep"})


def check_sgd_layout(cfg: OptimizerConfig, layout: frozenset[str]) -> None:
    """``optimizer.implementation=fused`` with SGD under a layout of DTensor parameters is refused:
    torch's fused SGD kernel has no sharding rule for them (``auto`` takes foreach there)."""
    sharded = sorted(layout & _DTENSOR_LAYOUTS)
    if cfg.implementation == "fused" and sharded:
        raise ConfigError(
            f"optimizer.implementation=fused with optimizer=sgd under {', '.join(sharded)}: torch's fused "
            "SGD kernel cannot take sharded (DTensor) parameters; set optimizer.implementation=auto or "
            "foreach."
        )


def build_sgd(
    parts: list[nn.Module],
    cfg: OptimizerConfig,
    *,
    device_type: str,
    shard_mesh: Optional[DeviceMesh],
    adamw_modules: tuple[str, ...],
    layout: frozenset[str] = frozenset(),
    lr_scale: Optional[LRScale] = None,
) -> torch.optim.Optimizer:
    """torch.optim.SGD (``optimizer.momentum``, ``optimizer.nesterov``) over :func:`param_groups` (matrices
    decayed, vectors not; elementwise like AdamW, so any layout); DiLoCo's outer optimizer is one.
    ``auto`` takes foreach where the parameters are DTensors (torch's fused SGD has no sharding rule)."""
    impl = impl_kwargs(cfg, device_type)
    if impl["fused"] and any(isinstance(p, DTensor) for part in parts for p in part.parameters()):
        # torch's fused SGD has no DTensor sharding rule (FSDP / TP / EP parameters; fused AdamW has one)
        check_sgd_layout(cfg, _DTENSOR_LAYOUTS)  # the trainer refused a forced fused before any process group
        impl = {"fused": False, "foreach": True}
    kwargs = {"lr": cfg.lr, "momentum": cfg.momentum, "nesterov": cfg.nesterov, **impl}
    return _elementwise(torch.optim.SGD, parts, cfg, shard_mesh, lr_scale, kwargs)
