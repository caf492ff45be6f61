"""Small layout-aware helpers shared by the strategies and the trainer."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Union, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from models.errors import ConfigError

# Config dtype name -> torch dtype: the one map (configs, export, FSDP mixed precision).
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

Positions = Union[slice, torch.Tensor]  # flat element positions: a contiguous range, or int64 indices


def to_dtype(name: str) -> torch.dtype:
    """Map a config dtype name to a torch dtype."""
    if name not in DTYPES:
        raise ConfigError(f"dtype {name!r} is not one of {sorted(DTYPES)}.")
    return DTYPES[name]


@torch.no_grad()
def copy_full_into(param: torch.Tensor, full: torch.Tensor) -> None:
    """Write the part of a full (unsharded) tensor that this rank holds into ``param``.

    For a DTensor parameter (FSDP shard, TP shard, or both) only the local slice of
    ``full`` is copied, so every layout gets exactly the single-process values.
    """
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if isinstance(param, DTensor):
        local_shape, offset = compute_local_shape_and_global_offset(
            full.shape, param.device_mesh, param.placements
        )
        index = tuple(slice(o, o + s) for o, s in zip(offset, local_shape))
        local = param.to_local()
        local.copy_(full[index].to(local.device, local.dtype))
    else:
        param.copy_(full.to(param.device, param.dtype))


@torch.no_grad()
def clip_grad_norm_(
    parameters: Iterable[nn.Parameter],
    max_norm: float,
    *,
    foreach: bool | None = None,
    pp_mesh: DeviceMesh | None = None,
) -> torch.Tensor:
    """Clip gradients by their global 2-norm; return the norm (same value on every rank).

    Works for plain tensors (replicated by DDP), DTensors (FSDP/TP shards: the per-tensor
    norms come back as Partial DTensors and ``full_tensor()`` reduces them over the mesh),
    parameters on different meshes (expert parallel: experts on (efsdp, ep), dense ones on
    (dp_shard_cp[, tp])) -- one norm per mesh, combined as the root of the sum of squares --
    and pipeline stages (squared norms of the stages are summed over ``pp_mesh``).
    ``max_norm <= 0`` only measures.
    """
    from torch.distributed.tensor import DTensor

    params = [p for p in parameters if p.grad is not None]
    groups: dict[tuple[str, ...], list[nn.Parameter]] = {}
    for p in params:  # grouped by mesh dim names: the same groups, in the same order, on every rank
        key = tuple(p.grad.device_mesh.mesh_dim_names or ("?",)) if isinstance(p.grad, DTensor) else ()
        groups.setdefault(key, []).append(p)
    norms = []
    for key in sorted(groups, key=str):
        norm = torch.nn.utils.get_total_norm(
            [p.grad for p in groups[key] if p.grad is not None], 2.0, False, foreach
        )
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    if not norms:
        total_norm = torch.zeros(())
    elif len(norms) == 1:
        total_norm = norms[0]
    else:
        total_norm = torch.stack([n.float() for n in norms]).pow(2).sum().sqrt()
    if pp_mesh is not None and pp_mesh.size() > 1:
        total_norm = total_norm**2
        dist.all_reduce(total_norm, group=pp_mesh.get_group())
        total_norm = total_norm.sqrt()
    if max_norm > 0 and params:
        for key in sorted(groups, key=str):
            torch.nn.utils.clip_grads_with_norm_(groups[key], max_norm, total_norm, foreach)
    return total_norm


def is_finite(x: torch.Tensor) -> bool:
    """Host-side finiteness check (one device sync)."""
    return math.isfinite(float(x))


def local_positions(p: torch.Tensor) -> Positions:
    """Flat indices into the full tensor ``p`` of this rank's local elements, in local order.

    A plain tensor holds everything; a DTensor holds exactly what ``distribute_tensor`` of an
    ``arange`` over the same mesh and placements keeps locally (any placement: Shard, Replicate,
    the strided shards of FSDP over TP). Muon finds its pieces with it, QK-clip its q/k rows."""
    if not hasattr(p, "placements"):
        return slice(0, p.numel())
    from torch.distributed.tensor import DTensor, distribute_tensor

    dp = cast(DTensor, p)  # only a DTensor has placements
    full = torch.arange(math.prod(dp.shape), dtype=torch.int64, device=dp.to_local().device).view(dp.shape)
    idx = distribute_tensor(full, dp.device_mesh, dp.placements, src_data_rank=None).to_local().reshape(-1)
    return compress_positions(idx.cpu())


def compress_positions(idx: torch.Tensor) -> Positions:
    """``idx`` (int64 positions) as a slice when contiguous, else unchanged."""
    if idx.numel() == 0:
        return slice(0, 0)
    start = int(idx[0])
    if torch.equal(idx, torch.arange(start, start + idx.numel(), dtype=idx.dtype)):
        return slice(start, start + idx.numel())
    return idx
