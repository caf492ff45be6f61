"""The terms that differ between the ranks of one pipeline stage because an optimizer assigns
owners, computed for one global rank with the optimizers' own assignment functions:

* ZeRO-1 (``parallelisms/sharded_optimizer.py``): each parameter's optimizer state lives on one
  owner of ``dp_replicate`` (balanced by bytes, or by Newton-Schulz FLOPs under Muon:
  ``muon_cost``), and the parameters are re-replicated from one flat storage grouped by owner
  (NCCL: one all-gather of segments padded to the largest owner's; gloo: one broadcast per owner).
* Muon (``trainer/optim/muon.py``): each matrix is orthogonalised on one owner rank of the world and
  each piece's momentum kept by one primary among its replicas; what a rank sends in the two
  all_to_alls follows from which units it owns and which pieces it is the primary of.

The parameters come from the model built on meta (``ParamTable.model``), grouped by the optimizer's
own group builders; the piece of each Muon matrix a rank holds follows from the layout's placements
(FSDP ``Shard(0)`` over ``dp_shard x cp``, TP ``Shard`` on the dim its module's style shards over ``tp``
(``parallelisms.tensor_parallel.tp_shard_dim``: ``Shard(0)`` colwise, ``Shard(1)`` rowwise),
experts ``Shard(0)`` over ``ep`` and their FSDP over ``dp_shard x cp / ep``), evaluated by
``parallelisms.utils.shard_piece`` at each rank's mesh coordinate: the same function the optimizer's
own derivation uses on the real DTensors.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, Union

import torch

if TYPE_CHECKING:
    from torch.distributed.tensor import Placement

    from parallelisms.utils import Piece
    from trainer.optim.muon_plan import _Unit
    from trainer.planner.context import PlanContext

__all__ = ["MuonRank", "muon_ns_flops", "muon_rank", "zero1_optimizer_bytes", "zero1_segments"]

# How the layout splits a Muon matrix: "expert" (a stacked experts' weight) or the dim tensor parallel
# shards it on (``tp_shard_dim``; None: replicated over tp)
_Split = Union[Literal["expert"], int, None]


def _stage_names(c: PlanContext, pp_rank: int) -> set[str]:
    """The (unwrapped) names of the parameters the stages of ``pp_rank`` hold."""
    model = c.table.model
    assert model is not None
    keys = [key for key, _ in c.spec.block_items(model)]
    prefixes = []
    for st in c.ranks[pp_rank]:
        prefixes += [f"{c.spec.blocks}.{keys[b]}." for b in st.blocks]
        prefixes += [f"{m}." for m in (c.spec.first_modules if st.first else ())]
        prefixes += [f"{m}." for m in (c.spec.last_modules if st.last else ())]
    return {name for name, _ in model.named_parameters() if name.startswith(tuple(prefixes))}


# One parameter group: whether Muon steps it, and its (name, parameter) in order
_Group = tuple[bool, list[tuple[str, torch.Tensor]]]


def _optimizer_groups(c: PlanContext, pp_rank: int) -> list[_Group]:
    """The optimizer's parameter groups over the stage's parameters, in the order the run builds them
    (``trainer/optim``'s group builders on the meta model, restricted to the stage)."""
    from trainer.optim.adamw import param_groups
    from trainer.optim.muon import muon_param_groups

    model = c.table.model
    assert model is not None
    o = c.cfg.optimizer
    if o.name == "muon":
        groups = muon_param_groups(model, o, c.spec.first_modules + c.spec.last_modules)
    else:
        groups = param_groups(model, o.weight_decay)
    names = {id(p): n for n, p in model.named_parameters()}
    held = _stage_names(c, pp_rank)
    return [
        (bool(g.get("use_muon")), [(names[id(p)], p) for p in g["params"] if names[id(p)] in held])
        for g in groups
    ]


def _zero1(c: PlanContext, pp_rank: int) -> list[tuple[torch.Tensor, bool, int]]:
    """(parameter, Muon's or not, owner) in ZeRO-1's flat order, owners assigned as the
    ShardedOptimizer does (``assign_owners`` over every group's parameters in one pass)."""
    from parallelisms.sharded_optimizer import assign_owners
    from trainer.optim.muon import muon_cost

    flat = [(p, muon) for muon, named in _optimizer_groups(c, pp_rank) for _, p in named]
    if c.cfg.optimizer.name == "muon":
        costs = [muon_cost(p, {"use_muon": muon}) for p, muon in flat]
    else:
        costs = [p.numel() * p.element_size() for p, _ in flat]
    owners = assign_owners(costs, c.dims.dp_replicate, "balanced")
    return [(p, muon, owner) for (p, muon), owner in zip(flat, owners)]


def zero1_segments(c: PlanContext, pp_rank: int) -> list[int]:
    """Parameter elements each ``dp_replicate`` rank owns under ZeRO-1 (its segment of the storage)."""
    out = [0] * c.dims.dp_replicate
    for p, _, owner in _zero1(c, pp_rank):
        out[owner] += p.numel()
    return out


def zero1_optimizer_bytes(c: PlanContext, pp_rank: int, replica: int) -> float:
    """Optimizer-state bytes of the ``dp_replicate`` rank ``replica``: AdamW's two fp32 moments of
    each parameter it owns; under Muon its matrices' fp32 momentum (Muon runs whole on the owner)."""
    from trainer.planner.cluster import ADAM_BYTES

    total = 0.0
    for p, muon, owner in _zero1(c, pp_rank):
        if owner == replica:
            total += p.numel() * (4 if muon else ADAM_BYTES)
    return total


def _coordinates(c: PlanContext, rank: int) -> tuple[int, int, int, int, int]:
    """(pp, dp_replicate, dp_shard, cp, tp) coordinates of a global rank (the mesh order)."""
    d = c.dims
    rank, tp = divmod(rank, d.tp)
    rank, cp = divmod(rank, d.cp)
    rank, shard = divmod(rank, d.dp_shard)
    pp, replicate = divmod(rank, d.dp_replicate)
    return pp, replicate, shard, cp, tp


def _placements(c: PlanContext, rank: int, split: _Split) -> tuple[list[int], list[int], list[Placement]]:
    """(mesh shape, the rank's coordinate, placements) of a Muon matrix split as ``split``; replicated
    mesh dims are left out (they do not change the piece)."""
    from torch.distributed.tensor import Replicate, Shard

    d = c.dims
    _, _, shard, cp, tp = _coordinates(c, rank)
    fsdp = shard * d.cp + cp  # index on dp_shard_cp
    shape: list[int] = []
    at: list[int] = []
    placements: list[Placement] = []
    if split == "expert":
        if d.fsdp_enabled and d.dp_shard * d.cp // d.ep > 1:  # FSDP over dp_shard_mod_ep
            shape.append(d.dp_shard * d.cp // d.ep)
            at.append(fsdp // d.ep)
            placements.append(Shard(0))
        if d.ep > 1:
            shape.append(d.ep)
            at.append(fsdp % d.ep)
            placements.append(Shard(0))
        return shape, at, placements
    if d.fsdp_enabled:
        shape.append(d.dp_shard * d.cp)
        at.append(fsdp)
        placements.append(Shard(0))
    if d.tp > 1:
        shape.append(d.tp)
        at.append(tp)
        placements.append(Replicate() if split is None else Shard(split))
    return shape, at, placements


@dataclass(frozen=True)
class MuonRank:
    """Elements one rank hands to Muon's two all_to_alls per step (and keeps as momentum)."""

    momentum: int  # its primary pieces: the momentum it keeps, and what it sends to the owners
    to_owners: int
    to_holders: int  # as an owner: the orthogonalised pieces of its units, for every holder


def _muon_units(c: PlanContext) -> list[_Unit]:
    """Muon's units over the world group, with their owners and primaries (Muon's own
    ``plan_units``), from the pieces the layout gives every rank."""
    from models.common import unwrapped_name
    from parallelisms.tensor_parallel import tp_kinds, tp_shard_dim
    from parallelisms.utils import shard_piece
    from trainer.optim.muon_plan import plan_units

    model = c.table.model
    assert model is not None
    kinds = tp_kinds(model, c.spec)
    experts = {
        id(p) for m in (c.spec.expert_modules(model) if c.spec.expert_modules else []) for p in m.parameters()
    }
    per_stage = []
    for pp_rank in range(c.dims.pp):
        entries = []
        for muon, named in _optimizer_groups(c, pp_rank):
            for name, p in named if muon else []:
                module, _, leaf = name.rpartition(".")
                split: _Split = "expert"
                if id(p) not in experts:
                    split = tp_shard_dim(kinds.get(module), model.get_submodule(module), leaf)
                entries.append((unwrapped_name(name), tuple(p.shape), split))
        per_stage.append(entries)
    cache: dict[tuple[object, ...], Piece] = {}
    layouts = []
    for r in range(c.dims.world_size):
        layout = []
        for name, shape, split in per_stage[_coordinates(c, r)[0]]:
            mesh_shape, at, placements = _placements(c, r, split)
            key = (shape, split, tuple(at))
            if key not in cache:
                cache[key] = shard_piece(shape, mesh_shape, at, placements)
            layout.append((name, shape, cache[key]))
        layouts.append(layout)
    units, _ = plan_units(layouts, c.dims.world_size)
    return units


def muon_rank(c: PlanContext, rank: int) -> MuonRank:
    """Muon's per-rank figures for global ``rank`` (every rank of the world group holds the pieces
    the layout gives it)."""
    from trainer.optim.muon_plan import exchange_elements

    to_owners, to_holders = exchange_elements(_muon_units(c), rank)
    return MuonRank(momentum=to_owners, to_owners=to_owners, to_holders=to_holders)


def muon_ns_flops(c: PlanContext, rank: int) -> float:
    """Newton-Schulz FLOPs global ``rank`` runs per step: the matrices it owns (ZeRO-1: every matrix
    of the parameters it owns, each expert of a stack on its own), ``ns_steps`` iterations each."""
    from trainer.optim.muon import ns_step_flops

    steps = c.cfg.optimizer.muon.ns_steps
    d = c.dims
    if d.ddp_enabled and c.cfg.parallelism.ddp.sharded_optimizer:
        pp_rank = rank // (d.world_size // d.pp)
        replica = replica_of(c, rank)
        owned = [p for p, muon, owner in _zero1(c, pp_rank) if muon and owner == replica]
        return float(
            steps * sum((p.shape[0] if p.ndim == 3 else 1) * ns_step_flops(*p.shape[-2:]) for p in owned)
        )
    return float(steps * sum(ns_step_flops(u.rows, u.cols) for u in _muon_units(c) if u.owner == rank))


def replica_of(c: PlanContext, rank: int) -> int:
    """The dp_replicate coordinate of a global rank (mesh order pp, dp_replicate, dp_shard, cp, tp)."""
    d = c.dims
    return rank // (d.dp_shard * d.cp * d.tp) % d.dp_replicate
