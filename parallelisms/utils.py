"""Small layout-aware helpers shared by the strategies and the trainer."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Optional, TypeVar, Union, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from models.errors import ConfigError

if TYPE_CHECKING:
    from torch.distributed.tensor import Placement

# Config dtype name -> torch dtype: the one map (configs, export, FSDP mixed precision).
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

Positions = Union[slice, torch.Tensor]  # flat element positions: a contiguous range, or int64 indices
# What one rank holds of a tensor, per dimension: the global indices it holds along it, in local order
# (a ``range`` when contiguous and ascending). The local tensor is their product, row-major.
Index = Union[range, tuple[int, ...]]
Piece = tuple[Index, ...]


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
def complete_partial_grads(parameters: Iterable[nn.Parameter]) -> None:
    """Finish the sums that tensor parallelism leaves pending in gradients, once per step after the
    last backward: a replicated weight applied to this rank's share of the work (a norm on the
    sequence shard under SP, a per-head norm on the local heads) gets a ``Partial`` gradient, which
    FSDP reduces itself and our DDP on its copy into the bucket. Without either, each later reader
    (the clip's norm, every optimizer op that reads it) would all-reduce it again; here it becomes
    the parameter's own placement with one all-reduce per tensor (what the planner counts)."""
    from torch.distributed.tensor import DTensor, Partial

    for p in parameters:
        g = p.grad
        if isinstance(g, DTensor) and isinstance(p, DTensor) and g.placements != p.placements:
            if any(isinstance(pl, Partial) for pl in g.placements):
                p.grad = g.redistribute(p.device_mesh, p.placements)


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


# -- what every rank holds of a tensor, from its mesh and placements (no communication) --------------


def _as_index(values: Sequence[int]) -> Index:
    """``values`` as a ``range`` when contiguous and ascending, else as a tuple."""
    if not values or list(values) == list(range(values[0], values[0] + len(values))):
        return range(values[0], values[0] + len(values)) if values else range(0)
    return tuple(values)


def shard_piece(
    shape: Sequence[int],
    mesh_shape: Sequence[int],
    coordinate: Sequence[int],
    placements: Sequence[Placement],
) -> Piece:
    """The piece of a tensor of ``shape`` that the rank at ``coordinate`` of a mesh of ``mesh_shape``
    holds under ``placements``: the shards applied mesh dimension by mesh dimension, as
    ``distribute_tensor`` does (``Shard``: ``torch.chunk``'s split; ``_StridedShard``, FSDP over TP:
    its own split). Pure host arithmetic, valid for any rank, also under ``FakeTensorMode``."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    idx: list[Index] = [range(n) for n in shape]
    for mesh_dim, placement in enumerate(placements):
        chunks, at = mesh_shape[mesh_dim], coordinate[mesh_dim]
        if isinstance(placement, _StridedShard):
            from torch._subclasses.fake_tensor import unset_fake_temporarily

            d = placement.dim
            view = [1] * len(shape)
            view[d] = len(idx[d])
            with unset_fake_temporarily():  # a few host integers, real even inside a traced step
                held = torch.tensor(list(idx[d]), dtype=torch.int64).view(view)
                parts, _ = placement._split_tensor(held, chunks, with_padding=False)
                values = parts[at].reshape(-1).tolist() if at < len(parts) else []
            idx[d] = _as_index(values)
        elif isinstance(placement, Shard):
            d = placement.dim
            size, offset = Shard.local_shard_size_and_offset(len(idx[d]), chunks, at)
            held_d = idx[d][offset : offset + size]
            idx[d] = held_d if isinstance(held_d, range) else _as_index(held_d)
        # Replicate (and Partial, which parameters never carry): the whole extent
    return tuple(idx)


def rank_coordinates(mesh: DeviceMesh) -> dict[int, tuple[int, ...]]:
    """Every global rank's coordinate in its own copy of ``mesh``: a sliced or flattened mesh
    (``tp``, ``dp_shard_cp``...) exists once per combination of the other dimensions, and every
    rank of the root mesh sits in exactly one copy."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily():  # the rank table is host metadata: real even inside a traced step
        copies = mesh._layout.remap_to_tensor(mesh._rank_map).tolist()  # (copies, *mesh.shape)
    out: dict[int, tuple[int, ...]] = {}

    def walk(node: object, coord: tuple[int, ...]) -> None:
        if isinstance(node, list):
            for i, child in enumerate(node):
                walk(child, (*coord, i))
        else:
            out[cast(int, node)] = coord

    for copy in copies:
        walk(copy, ())
    return out


def piece_of(p: torch.Tensor, coordinate: Optional[Sequence[int]] = None) -> Piece:
    """What the rank at ``coordinate`` of ``p``'s mesh (default: this rank) holds of ``p``; a plain
    tensor is held whole."""
    if not hasattr(p, "placements"):
        return tuple(range(n) for n in p.shape)
    from torch.distributed.tensor import DTensor

    dp = cast(DTensor, p)  # only a DTensor has placements
    mesh = dp.device_mesh
    at = mesh.get_coordinate() if coordinate is None else coordinate
    if at is None:
        raise ValueError(f"this rank is not in the mesh {mesh} of a DTensor of shape {tuple(dp.shape)}")
    return shard_piece(tuple(dp.shape), tuple(mesh.shape), at, dp.placements)


def piece_numel(piece: Piece) -> int:
    return math.prod(len(i) for i in piece)


def piece_positions(piece: Piece, shape: Sequence[int]) -> Positions:
    """Flat positions, in a tensor of ``shape``, of ``piece``'s elements in local (row-major) order:
    a slice when they are contiguous, else int64 indices."""
    if piece_numel(piece) == 0:
        return slice(0, 0)
    # contiguous: the dimensions after the last partial one whole, that one a range, those before single
    whole = [i == range(n) for i, n in zip(piece, shape)]
    last = max((d for d, w in enumerate(whole) if not w), default=0)
    if isinstance(piece[last], range) and all(len(piece[d]) == 1 for d in range(last)):
        start = sum(piece[d][0] * math.prod(shape[d + 1 :]) for d in range(last + 1))
        return slice(start, start + piece_numel(piece))
    flat = torch.zeros((), dtype=torch.int64)
    for d, i in enumerate(piece):
        flat = flat.unsqueeze(-1) * shape[d] + torch.as_tensor(list(i), dtype=torch.int64)
    return flat.reshape(-1)


def _wrapped(t: torch.Tensor) -> Optional[torch.Tensor]:
    """The plain tensor inside a weight-wrapper subclass (one inner tensor of its own shape and dtype:
    torchao's MXFP8 training weight, its float8 all-gather weight), or None for any other tensor."""
    flatten = getattr(type(t), "__tensor_flatten__", None)
    if flatten is None:
        return None
    names, _ = flatten(t)
    inner = [getattr(t, n) for n in names]
    same = [x for x in inner if x.shape == t.shape and x.dtype == t.dtype]
    if len(same) != 1:
        return None
    return same[0] if type(same[0]) is torch.Tensor else _wrapped(same[0])


_T = TypeVar("_T")


@torch.no_grad()
def plain_tensor(t: _T) -> _T:
    """``t`` with a weight wrapper (``_wrapped``; a DTensor's local one too) replaced by the plain
    tensor it holds, sharing its storage; anything else unchanged. Checkpoints save this: the same
    high-precision values under the same names, loadable without the wrapper's library (and loading
    into it writes the parameter in place)."""
    if not isinstance(t, torch.Tensor):
        return t
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        local = _wrapped(t._local_tensor)
        if local is None:
            return t
        return cast(
            _T,
            DTensor.from_local(
                local, t.device_mesh, t.placements, run_check=False, shape=t.shape, stride=t.stride()
            ),
        )
    inner = _wrapped(t)
    return t if inner is None else cast(_T, inner)
