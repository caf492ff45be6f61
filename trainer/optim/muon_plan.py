"""Muon's distribution plan (``muon.py``'s ``Muon`` steps by it): every Muon parameter cut into units
(a 2-D weight is one, a 3-D expert stack ``(E, m, n)`` is E), the piece of each unit every rank holds
(from the parameters' meshes and placements, or exchanged once under pipeline stages), one owner rank
per unit balanced by Newton-Schulz FLOPs (:func:`ns_flops`), one primary per set of identical pieces,
and the element counts of the step's two ``all_to_all_single``. Computed once, identically on every
rank; the planner (``trainer/planner/owners.py``) replays :func:`plan_units` and
:func:`exchange_elements` without a process group. Split from ``muon.py`` (the optimizer, the
Newton-Schulz iteration and the config side)."""

from __future__ import annotations

import array
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional, cast

import torch.distributed as dist
from torch import Tensor

from models.errors import ConfigError
from parallelisms.utils import (
    Piece,
    Positions,
    piece_numel,
    piece_of,
    piece_positions,
    rank_coordinates,
    shard_piece,
)

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor


def ns_flops(rows: int, cols: int) -> int:
    """Cost proxy of one Newton-Schulz orthogonalisation of an (rows, cols) matrix."""
    return rows * cols * min(rows, cols)


def _signature(piece: Piece) -> str:
    """A piece's identity: equal for the ranks holding the same elements (replicas)."""
    parts = []
    for index in piece:
        if isinstance(index, range):
            parts.append(f"{index.start}:{index.stop}")
        else:
            parts.append(hashlib.sha1(array.array("q", index).tobytes()).hexdigest())
    return ",".join(parts)


def _piece_units(shape: Sequence[int], piece: Piece) -> list[tuple[int, slice, Piece]]:
    """(unit, local positions, the piece within the unit) of each unit the piece touches: a 2-D
    weight is one unit; a 3-D stack ``(E, m, n)`` is E units, the experts held along dimension 0."""
    if len(shape) == 2:
        n = piece_numel(piece)
        return [(0, slice(0, n), piece)] if n else []
    per_unit = len(piece[1]) * len(piece[2])
    if not per_unit:
        return []
    held = [(e, slice(i * per_unit, (i + 1) * per_unit), piece[1:]) for i, e in enumerate(piece[0])]
    return sorted(held, key=lambda unit: unit[0])


def _count(pos: Positions) -> int:
    return pos.stop - pos.start if isinstance(pos, slice) else pos.numel()


@dataclass
class _Unit:
    """One matrix: ``key`` = (parameter name, expert index or 0); its owner and holders."""

    key: tuple[str, int]
    rows: int
    cols: int
    owner: int = -1
    holders: dict[int, str] = field(default_factory=dict)  # rank -> signature of its piece
    counts: dict[str, int] = field(default_factory=dict)  # signature -> elements in the unit
    primaries: dict[str, int] = field(default_factory=dict)  # signature -> the rank that sends it


def assign_owners(costs: Sequence[int], candidates: Sequence[Sequence[int]], world_size: int) -> list[int]:
    """Owner of each unit: largest cost first, onto its least-loaded candidate rank (ties: lowest rank)."""
    loads = [0] * world_size
    owners = [-1] * len(costs)
    for i in sorted(range(len(costs)), key=lambda j: (-costs[j], j)):
        rank = min(candidates[i], key=lambda r: (loads[r], r))
        owners[i] = rank
        loads[rank] += costs[i]
    return owners


@dataclass
class _LocalParam:
    """This rank's view of one Muon parameter."""

    param: Tensor
    name: str
    units: list[tuple[int, Positions, Positions]]  # (unit index, local positions, unit positions)
    signature: str
    primary: bool = False  # keeps the momentum and sends the update pieces


# One rank's Muon parameters: (name, full shape, the piece it holds)
_Layout = list[tuple[str, tuple[int, ...], Piece]]


def derive_layouts(named: Sequence[tuple[str, Tensor]], group: dist.ProcessGroup) -> list[_Layout]:
    """Every rank's :data:`_Layout` of ``group``, derived from each parameter's mesh and placements
    (``parallelisms.utils``): valid when every rank of ``group`` holds the same parameters, the
    pieces of a DTensor differing only by the rank's coordinate in its copy of the mesh."""
    world = dist.get_world_size(group)
    ranks = [dist.get_global_rank(group, r) for r in range(world)]
    out: list[_Layout] = [[] for _ in range(world)]
    by_rank: dict[tuple[object, ...], list[Piece]] = {}  # (mesh, placements, shape) -> piece per rank
    coordinates: dict[DeviceMesh, dict[int, tuple[int, ...]]] = {}
    for name, p in named:
        shape = tuple(p.shape)
        if not hasattr(p, "placements"):
            pieces = [piece_of(p)] * world
        else:
            dp = cast("DTensor", p)
            mesh = dp.device_mesh
            key = (mesh, tuple(dp.placements), shape)
            if key not in by_rank:
                if mesh not in coordinates:
                    coordinates[mesh] = rank_coordinates(mesh)
                where = coordinates[mesh]
                missing = [r for r in ranks if r not in where]
                if missing:
                    raise RuntimeError(
                        f"Muon: rank {missing[0]} of the group holds no copy of {name}'s mesh {mesh}; a "
                        "group whose ranks hold different parameters must exchange its layouts"
                    )
                by_rank[key] = [shard_piece(shape, mesh.shape, where[r], dp.placements) for r in ranks]
            pieces = by_rank[key]
        for r in range(world):
            out[r].append((name, shape, pieces[r]))
    return out


def plan_units(
    everyone: Sequence[_Layout], world: int
) -> tuple[list[_Unit], dict[tuple[str, int, str], Piece]]:
    """The units of every rank's pieces (``everyone[r]``: rank r's layout) in the canonical order,
    each with its owner, holders and the primary of each piece, the same on every rank; and
    (name, unit, signature) -> that piece within its unit."""
    found: dict[tuple[str, int], _Unit] = {}
    signatures: dict[int, str] = {}  # id(piece) -> its signature (ranks share piece objects)
    pieces: dict[tuple[str, int, str], Piece] = {}
    for rank, entries in enumerate(everyone):
        for name, shape, piece in entries:
            if id(piece) not in signatures:
                signatures[id(piece)] = _signature(piece)
            sig = signatures[id(piece)]
            for unit_id, _, unit_piece in _piece_units(shape, piece):
                unit = found.setdefault((name, unit_id), _Unit((name, unit_id), shape[-2], shape[-1]))
                unit.holders[rank] = sig
                unit.counts[sig] = piece_numel(unit_piece)
                pieces.setdefault((name, unit_id, sig), unit_piece)
    units = [found[k] for k in sorted(found)]  # the canonical order, the same on every rank
    owners = assign_owners(
        [ns_flops(u.rows, u.cols) for u in units], [sorted(u.holders) for u in units], world
    )
    for unit, owner in zip(units, owners):
        unit.owner = owner
    # The primary of a piece (per parameter, so one rank keeps its whole momentum): the owner of
    # the parameter's first unit it touches when that rank holds the piece, else the lowest holder.
    by_param: dict[str, list[_Unit]] = {}
    for u in units:
        by_param.setdefault(u.key[0], []).append(u)
    for param_units in by_param.values():
        for sig in {s for u in param_units for s in u.holders.values()}:
            holders = sorted({r for u in param_units for r, s in u.holders.items() if s == sig})
            first = next(u for u in param_units if sig in u.counts)
            primary = first.owner if first.owner in holders else holders[0]
            for u in param_units:
                if sig in u.counts:
                    u.primaries[sig] = primary
    return units, pieces


def exchange_elements(units: Sequence[_Unit], rank: int) -> tuple[int, int]:
    """Elements ``rank`` hands to each of Muon's two all_to_alls per step: its primary pieces (to
    their owners; also the momentum it keeps) and, as an owner, the orthogonalised pieces of its
    units for every holder."""
    to_owners = sum(
        u.counts[u.holders[rank]] for u in units if rank in u.holders and u.primaries[u.holders[rank]] == rank
    )
    to_holders = sum(u.counts[sig] for u in units if u.owner == rank for sig in u.holders.values())
    return to_owners, to_holders


class _Plan:
    """Units, owners, primaries and the exchange layout of every Muon parameter, for all ranks."""

    def __init__(
        self, named: Sequence[tuple[str, Tensor]], group: Optional[dist.ProcessGroup], exchange: bool = False
    ) -> None:
        self.group = group
        self.rank = dist.get_rank(group) if group is not None else 0
        self.world = dist.get_world_size(group) if group is not None else 1
        self.local: list[_LocalParam] = []
        mine: _Layout = []
        for name, p in named:
            shape = tuple(p.shape)
            if len(shape) not in (2, 3):
                raise ConfigError(f"Muon takes 2-D matrices and 3-D expert stacks; {name} has shape {shape}")
            piece = piece_of(p)
            if tuple(len(i) for i in piece) != tuple(_local(p).shape):
                raise RuntimeError(
                    f"Muon: {name}'s local shape {tuple(_local(p).shape)} is not the piece its placements "
                    f"give ({tuple(len(i) for i in piece)}): this torch shards otherwise than assumed"
                )
            units: list[tuple[int, Positions, Positions]] = [
                (u, local_pos, piece_positions(unit_piece, shape[-2:]))
                for u, local_pos, unit_piece in _piece_units(shape, piece)
            ]
            self.local.append(_LocalParam(p, name, units, _signature(piece)))
            mine.append((name, shape, piece))
        if self.world == 1:
            everyone = [mine]
        elif exchange:  # pipeline stages: the other ranks' parameters are not this rank's to derive
            gathered: list[object] = [None] * self.world
            dist.all_gather_object(gathered, mine, group=group)
            everyone = cast("list[_Layout]", gathered)  # every rank's ``mine``
        else:
            assert group is not None
            everyone = derive_layouts(named, group)
            if everyone[self.rank] != mine:
                raise RuntimeError("Muon: the layout derived for this rank is not the one it holds")
        self._build_units(everyone)

    def _build_units(self, everyone: list[_Layout]) -> None:
        self.units, pieces = plan_units(everyone, self.world)
        self.index = {u.key: i for i, u in enumerate(self.units)}
        for lp in self.local:
            lp.primary = (
                bool(lp.units) and self.unit(lp.name, lp.units[0][0]).primaries[lp.signature] == self.rank
            )
        # This rank's pieces in the canonical unit order: the order of every packed buffer.
        self.pieces = sorted(
            (
                (self.index[(lp.name, u)], lp, local_pos, unit_pos)
                for lp in self.local
                for u, local_pos, unit_pos in lp.units
            ),
            key=lambda piece: piece[0],
        )
        self.flops_per_rank = [0] * self.world
        for u in self.units:
            self.flops_per_rank[u.owner] += ns_flops(u.rows, u.cols)
        # Owner side: where each piece it receives sits in its unit.
        self.positions: dict[tuple[tuple[str, int], str], Positions] = {
            (unit.key, sig): piece_positions(pieces[(unit.key[0], unit.key[1], sig)], (unit.rows, unit.cols))
            for unit in self.owned()
            for sig in unit.primaries
        }

    def unit(self, name: str, u: int) -> _Unit:
        return self.units[self.index[(name, u)]]

    # -- what moves where (element counts per peer, in the canonical order) --------------------

    def send_counts(self) -> list[int]:
        """Elements this rank sends to each owner (its primary pieces)."""
        counts = [0] * self.world
        for i, lp, _, unit_pos in self.pieces:
            if lp.primary:
                counts[self.units[i].owner] += _count(unit_pos)
        return counts

    def recv_counts(self) -> list[int]:
        """Elements this rank (as owner) receives from each primary."""
        counts = [0] * self.world
        for unit in self.owned():
            for sig, primary in unit.primaries.items():
                counts[primary] += unit.counts[sig]
        return counts

    def owned(self) -> list[_Unit]:
        return [u for u in self.units if u.owner == self.rank]

    def return_counts(self) -> list[int]:
        """Elements of the orthogonalised update this rank (as owner) sends to each holder."""
        counts = [0] * self.world
        for unit in self.owned():
            for rank, sig in unit.holders.items():
                counts[rank] += unit.counts[sig]
        return counts

    def update_counts(self) -> list[int]:
        """Elements of the orthogonalised update this rank receives from each owner."""
        counts = [0] * self.world
        for i, _, _, unit_pos in self.pieces:
            counts[self.units[i].owner] += _count(unit_pos)
        return counts


def _local(t: Tensor) -> Tensor:
    return t.to_local() if hasattr(t, "to_local") else t
