"""The checkpoint term: the bytes and files each rank writes in one checkpoint save.

What a save holds is read off the run's own objects, unsharded, on the meta device: the model's
state dict (``get_model_state_dict``), the flattened optimizer state dict of the real optimizer and
LR schedule built over it (``get_optimizer_state_dict``: every parameter's ``step``, ``exp_avg``,
``exp_avg_sq``, ... and its ``param_groups`` entries), the schedule's state, the data loader's counters,
the train state and each rank's RNG (``trainer/checkpoint/checkpointer.py``), flattened as DCP flattens
them. The layout then decides who holds what, in closed form:

* a parameter-shaped entry (the weight and its per-parameter optimizer tensors) is split by tensor
  parallel on the dim its module's TP style shards it on (``parallelisms.tensor_parallel.tp_shard_dim``:
  ``colwise`` the output dim, ``rowwise`` the input dim, vocab-sharded ``embedding`` and ``head`` the
  vocabulary, ``shard_params`` dim 0, e.g. a Gated DeltaNet's convolutions and decay vectors), then by
  FSDP on dim 0 over dp_shard x cp
  (torch.chunk sizes; stacked experts under expert parallel: over ep, then the rest of dp_shard x cp),
  and is replicated over dp_replicate (HSDP, DDP) and over every axis that does not split it;
* other tensors (AdamW's scalar ``step``) and objects (``param_groups``) are whole on every rank of a
  pipeline stage; the schedule, loader and train state on every rank; the RNG is per rank;
* under ZeRO-1 (DDP + ``sharded_optimizer``) the optimizer state of a parameter is on its owner only
  (``parallelisms.sharded_optimizer.assign_owners``, the optimizer's own assignment).

An entry several ranks hold is written once: DCP's coordinator keeps it in the plan of the holder with
the least planned storage so far (``torch.distributed.checkpoint._dedup_save_plans``; the storage of
a tensor entry counts the whole tensor's bytes, any other entry 1), visiting the ranks' plans in rank
order and each plan's entries in state-dict order; ties go to the first holder in the iteration order
of DCP's set of plan indices. The planner runs that rule on its own table (visiting only the entries a
rank is the first holder of). On disk every tensor chunk is a ``torch.save`` archive, every other entry the
``torch.save`` of the object (``trainer.checkpoint.footprint``); a rank writes ``thread_count`` files
(``FileSystemWriter``'s default: one), rank 0 also DCP's pickled ``.metadata`` (built here from the
planned entries and pickled) and the completion marker ``checkpoint.json``.
"""

from __future__ import annotations

import dataclasses
import math
import pickle
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Optional, Union

import torch
from torch import nn

from trainer.planner.context import CheckpointPlan, PlanContext

if TYPE_CHECKING:
    from trainer.config import TrainConfig

__all__ = ["checkpoint_plan", "saved_entries"]

# Most entries the .metadata estimate pickles; beyond, a sample of the ranks is built (_metadata_bytes).
METADATA_SAMPLE = 4_000


@dataclass(frozen=True)
class SavedEntry:
    """One flattened entry of the state a save writes, unsharded (as one process would save it)."""

    key: str  # DCP's flattened key, e.g. "optimizer.state.layers.0.attention.wq.weight.exp_avg"
    path: tuple[str, ...]  # its path in the nested state (DCP's flatten mapping)
    param: Optional[str]  # model and optimizer entries: the parameter (or buffer) they belong to
    follows: bool  # parameter-shaped: split and replicated like its parameter; else whole
    shape: tuple[int, ...]  # tensors: the global shape
    dtype: Optional[torch.dtype]  # None: an object, saved with torch.save
    saved: int  # objects: their torch.save bytes (tensors are sized per chunk)
    scope: str  # "stage" (a pipeline stage's parameters), "run" (every rank), "rank" (one per rank)


@dataclass(frozen=True)
class _Split:
    """A tensor dim split (torch.chunk sizes) over mesh dims, flattened outermost first."""

    dim: int
    axes: tuple[str, ...]


@dataclass(frozen=True)
class _Holding:
    """Who holds an entry: the splits that give a rank its chunk, the mesh dims on which the holders of
    one chunk agree (every other dim replicates it), and under ZeRO-1 the one dp_replicate coordinate
    whose ranks hold it."""

    splits: tuple[_Split, ...]
    agree: frozenset[str]
    owner: Optional[int] = None


# -- the state a save writes, unsharded -------------------------------------------------------------


def _loader_state(cfg: TrainConfig) -> dict[str, object]:
    """The training loader's ``state_dict`` entries (``trainer/data/loader.py``; ``stream.py`` when
    streaming, whose per-dp-rank stream position is not counted). Small objects: their ``torch.save``
    size does not depend on the value."""
    d = cfg.data
    if d.streaming:
        return {"samples_seen": 0, "global_batch_size": 0, "stream_dp_size": 0, "stream_sources": ""}
    state: dict[str, object] = {
        "samples_seen": 0,
        "global_batch_size": cfg.training.global_batch_size,
        "seed": cfg.training.seed,
        "shuffle": d.shuffle,
        "num_windows": 0,
    }
    if d.sources:
        state["mixture"] = ""
    return state


def _initialised(optimizer: torch.optim.Optimizer) -> None:
    """Give ``optimizer`` its state as its first step creates it, cheaply on the meta device: one step
    with a gradient on one parameter of each group (the order the step visits the groups), then every
    parameter of a group the state of its group's stepped one (parameter-shaped tensors shaped like the
    parameter). A full meta step costs ~1.4 ms per parameter."""
    stepped = {id(g["params"][0]): g for g in optimizer.param_groups if g["params"]}
    for g in stepped.values():
        g["params"][0].grad = torch.zeros_like(g["params"][0])
    optimizer.step()
    order = [stepped[id(p)] for p in optimizer.state if id(p) in stepped]
    order += [g for g in stepped.values() if all(g is not o for o in order)]
    state: dict[torch.Tensor, dict[str, object]] = {}
    for g in order:
        first = g["params"][0]
        template = optimizer.state.get(first, {})
        first.grad = None
        for p in g["params"]:
            state[p] = {
                k: (torch.empty_like(p) if v.dim() > 0 and v.shape == first.shape else v.clone())
                if isinstance(v, torch.Tensor)
                else v
                for k, v in template.items()
            }
    optimizer.state.clear()
    optimizer.state.update(state)


@dataclass
class SavedState:
    """What one save of a run writes, unsharded (``saved_entries``)."""

    entries: list[SavedEntry]  # in DCP's order
    model: nn.Module  # the model on the meta device
    costs: list[tuple[str, int]]  # the parameters in the optimizer's order, with ZeRO-1's owner cost


def saved_entries(cfg: TrainConfig, model: Optional[nn.Module] = None) -> SavedState:
    """The flattened entries one save of ``cfg``'s run writes, unsharded, in DCP's order: the real model
    (``model``: already built on the meta device), optimizer and schedule on the meta device, read
    through torch's state-dict functions."""
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    from models import get_spec
    from trainer.checkpoint.footprint import saved_object_bytes
    from trainer.optim import build_lr_scheduler, build_optimizer, muon_cost
    from trainer.planner.params import _no_weight_init

    spec = get_spec(cfg.model.family)
    if model is None:
        with torch.device("meta"), _no_weight_init():
            model = spec.build(cfg.model)
    # The implementation switches (foreach, fused) depend on the device; they are saved as small
    # objects of one size whatever their values, so the meta device's (foreach: the fused kernel
    # refuses meta parameters) stands for any device's.
    optimizer = build_optimizer(
        [model], cfg.optimizer, device_type="meta", adamw_modules=spec.first_modules + spec.last_modules
    )
    schedule = build_lr_scheduler(optimizer, cfg.lr_scheduler, cfg.training.steps)
    names = {id(p): n for n, p in model.named_parameters()}
    cost = muon_cost if cfg.optimizer.name == "muon" else (lambda p, g: p.numel() * p.element_size())
    costs = [(names[id(p)], cost(p, g)) for g in optimizer.param_groups for p in g["params"]]
    _initialised(optimizer)
    # every name of a parameter (a tied head's weight is saved under both of its names)
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters(remove_duplicate=False)}
    rng: dict[str, torch.Tensor] = {"cpu": torch.get_rng_state()}
    if cfg.training.device == "cuda":
        rng["cuda"] = torch.zeros(16, dtype=torch.uint8)  # torch.cuda.get_rng_state()'s size
    state = {
        "model": get_model_state_dict(model),
        "optimizer": get_optimizer_state_dict(
            model, optimizer, options=StateDictOptions(flatten_optimizer_state_dict=True)
        ),
        "lr_scheduler": schedule.state_dict(),
        "dataloader": _loader_state(cfg),
        "train_state": {"step": cfg.training.steps, "tokens_seen": 0},
        "rng": {"rank0": rng},
    }
    flat, mappings = flatten_state_dict(state)
    entries = []
    object_bytes: dict[bytes, int] = {}  # by pickle: torch.save's size follows its pickle's
    for key, value in flat.items():
        path = tuple(str(p) for p in mappings[key])
        top, name = path[0], (path[1] if len(path) > 1 else "")
        param: Optional[str] = None
        if top == "model":
            param = name
        elif top == "optimizer":
            param = name.split(".", 1)[1].rpartition(".")[0]  # state.<fqn>.<k>, param_groups.<fqn>.<k>
        tensor = isinstance(value, torch.Tensor)
        follows = tensor and param in shapes and value.dim() > 0 and tuple(value.shape) == shapes[param]
        scope = "rank" if top == "rng" else ("stage" if param is not None else "run")
        if isinstance(value, torch.Tensor):
            entries.append(SavedEntry(key, path, param, follows, tuple(value.shape), value.dtype, 0, scope))
        else:
            pickled = pickle.dumps(value)
            if pickled not in object_bytes:
                object_bytes[pickled] = saved_object_bytes(value)
            entries.append(SavedEntry(key, path, param, False, (), None, object_bytes[pickled], scope))
    return SavedState(entries, model, costs)


# -- who holds what ---------------------------------------------------------------------------------


def _holdings(c: PlanContext, saved: SavedState) -> dict[str, _Holding]:
    """Each parameter's holding under the layout (see the module docstring)."""
    from parallelisms.sharded_optimizer import assign_owners
    from parallelisms.tensor_parallel import tp_kinds, tp_shard_dim

    dims, p, model = c.dims, c.cfg.parallelism, saved.model
    kinds = tp_kinds(model, c.spec) if dims.tp > 1 else {}
    experts = {
        id(q)
        for m in (c.spec.expert_modules(model) if c.spec.expert_modules and dims.ep > 1 else [])
        for q in m.parameters()
    }
    names = dims.mesh_dim_names
    fsdp = dims.flat_views["dp_shard_cp"]
    out: dict[str, _Holding] = {}
    for name, param in model.named_parameters(remove_duplicate=False):  # tied weights under each name
        module_name, _, leaf = name.rpartition(".")
        splits: list[_Split] = []
        tp_dim = tp_shard_dim(kinds.get(module_name), model.get_submodule(module_name), leaf)
        if tp_dim is not None:
            splits.append(_Split(tp_dim, ("tp",)))
        if id(param) in experts:
            splits.append(_Split(0, dims.flat_views["ep"]))
            if dims.fsdp_enabled:
                splits.append(_Split(0, ("dp_shard_mod_ep",)))
        elif dims.fsdp_enabled:
            splits.append(_Split(0, fsdp))
        agree = frozenset({"pp", *(a for s in splits for a in s.axes)})
        out[name] = _Holding(tuple(splits), agree & frozenset(names))
    if dims.ddp_enabled and p.ddp.sharded_optimizer:  # ZeRO-1: optimizer state on the owner only
        owners = assign_owners([cost for _, cost in saved.costs], dims.dp_replicate)
        for (n, _), owner in zip(saved.costs, owners):
            out[f"optimizer:{n}"] = dataclasses.replace(out[n], owner=owner)
    return out


def _holding_of(e: SavedEntry, holdings: dict[str, _Holding], names: tuple[str, ...]) -> _Holding:
    if e.scope == "rank":
        return _Holding((), frozenset(names))
    if e.scope == "run":
        return _Holding((), frozenset())
    base = holdings.get(e.param or "", _Holding((), frozenset({"pp"})))
    if e.key.startswith("optimizer.state.") and f"optimizer:{e.param}" in holdings:
        base = holdings[f"optimizer:{e.param}"]
    return base if e.follows else _Holding((), frozenset({"pp"}), base.owner)


def _stage_params(c: PlanContext, params: list[str]) -> list[set[str]]:
    """The parameter names each pipeline rank holds (its virtual stages' modules)."""
    if c.dims.pp == 1:
        return [set(params)]
    from parallelisms.pipeline_split import stage_ids_of_rank, stage_names

    p = c.cfg.parallelism
    names = stage_names(c.spec, c.cfg.model, p, c.dims.pp * c.stages_per_rank)
    style = "v" if p.pp_schedule.lower() == "zbvzerobubble" else "loop"
    out = []
    for r in range(c.dims.pp):
        mods = [m for i in stage_ids_of_rank(r, c.dims.pp, c.stages_per_rank, style) for m in names[i]]
        out.append({n for n in params if any(n == m or n.startswith(f"{m}.") for m in mods)})
    return out


def _chunk(
    shape: tuple[int, ...], splits: tuple[_Split, ...], coords: dict[str, int], sizes: dict[str, int]
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(sizes, global offsets) of the chunk a rank at ``coords`` holds: each split cuts the rank's part of
    the dim into torch.chunk pieces (a later split cuts what an earlier one left)."""
    local, offset = list(shape), [0] * len(shape)
    empty = [False] * len(shape)
    for s in splits:
        n, i = 1, 0
        for a in s.axes:
            n, i = n * sizes[a], i * sizes[a] + coords[a]
        step = -(-local[s.dim] // n)
        size = max(0, min(step, local[s.dim] - i * step))
        offset[s.dim] += i * step
        local[s.dim] = size
        empty[s.dim] = empty[s.dim] or size == 0
    # DTensor puts an empty chunk at the end of the dim (compute_local_shape_and_global_offset)
    offset = [shape[d] if empty[d] else o for d, o in enumerate(offset)]
    return tuple(local), tuple(offset)


# -- DCP's rule, on the planner's table --------------------------------------------------------------

# What a rank writes of one entry: (sizes, global offsets, bytes on disk); an object: ((), (), bytes).
Chunk = tuple[tuple[int, ...], tuple[int, ...], int]
Written = tuple[SavedEntry, Chunk]  # an entry's chunk in the plan of the rank DCP's rule chose
Kind = tuple[tuple[int, ...], torch.dtype, tuple[_Split, ...]]  # what a tensor entry's chunk depends on


@dataclass(frozen=True)
class _Row:
    """One entry in a pipeline rank's plans, precomputed for the walk over the ranks."""

    entry: SavedEntry
    free: int  # index of its free dims (the dims that replicate it) in the walk's table
    owner: Optional[int]  # ZeRO-1: the dp_replicate coordinate of the ranks that hold it
    holders: tuple[int, ...]  # offsets from the lowest holder's rank to every holder of a chunk
    weight: int  # what DCP's rule counts: the whole tensor's bytes, 1 for an object
    kind: int  # index of its Kind in the walk's table; -1: an object

    @property
    def own(self) -> bool:
        """Only the rank itself holds it: DCP's rule has no choice to make."""
        return len(self.holders) == 1 and self.owner is None


@dataclass
class _StagePlans:
    """The plans of one pipeline rank's ranks: its entries in state-dict order, the ones DCP's rule
    decides (with their positions), the weight of the rank's own entries before each position, and
    the rank's own entries counted by kind."""

    rows: list[_Row]
    decided: list[tuple[int, _Row]]
    own_before: list[int]
    own_kinds: dict[int, int]
    own_objects: int  # bytes
    own_entries: int


@dataclass
class Assignment:
    """Every rank's part of the checkpoint after DCP's de-duplication."""

    rank_bytes: list[int]
    rank_entries: list[int]
    unique: int  # distinct entries of the checkpoint
    stages: list[_StagePlans]
    won: list[list[Written]]  # per rank, the entries DCP's rule gave it among several holders
    chunks_of: Callable[[int], list[Chunk]]  # rank -> its chunk of every Kind

    def written(self, rank: int, pp_rank: int) -> list[Written]:
        """What ``rank`` (of pipeline rank ``pp_rank``) writes: its own entries, then those it won."""
        chunks = self.chunks_of(rank)
        own = [
            (r.entry, chunks[r.kind] if r.kind >= 0 else ((), (), r.entry.saved))
            for r in self.stages[pp_rank].rows
            if r.own
        ]
        return own + self.won[rank]


def _stage_plans(
    c: PlanContext,
    entries: list[SavedEntry],
    holdings: dict[str, _Holding],
    frees: list[frozenset[str]],
    kinds: list[Kind],
) -> list[_StagePlans]:
    """Per pipeline rank, the entries of its ranks' plans in state-dict order."""
    dims = c.dims
    names = tuple(dims.mesh_dim_names)
    sizes = {a: dims.axis_size(a) for a in names}
    stride, acc = {}, 1
    for a in reversed(names):
        stride[a] = acc
        acc *= sizes[a]
    staged = _stage_params(
        c, [e.param for e in entries if e.key.startswith("model.") and e.param is not None]
    )
    stage_of = {n: i for i, members in enumerate(staged) for n in members}
    holders_of: dict[frozenset[str], tuple[int, ...]] = {}
    out = []
    for pp_rank in range(len(staged)):
        plans = _StagePlans([], [], [0], {}, 0, 0)
        for e in entries:
            if e.scope == "stage" and stage_of.get(e.param or "", 0) != pp_rank:
                continue
            h = _holding_of(e, holdings, names)
            free = frozenset(
                a for a in names if a not in h.agree and not (h.owner is not None and a == "dp_replicate")
            )
            if free not in holders_of:
                frees.append(free)
                offsets = [0]
                for a in free:
                    offsets = [o + k * stride[a] for o in offsets for k in range(sizes[a])]
                holders_of[free] = tuple(sorted(offsets))
            holders = holders_of[free]
            kind = -1
            if e.dtype is not None:
                key = (e.shape, e.dtype, h.splits)
                if key not in kinds:
                    kinds.append(key)
                kind = kinds.index(key)
            weight = 1 if e.dtype is None else math.prod(e.shape) * e.dtype.itemsize
            row = _Row(e, frees.index(free), h.owner, holders, weight, kind)
            if row.own:
                plans.own_before.append(plans.own_before[-1] + weight)
                plans.own_entries += 1
                if kind >= 0:
                    plans.own_kinds[kind] = plans.own_kinds.get(kind, 0) + 1
                else:
                    plans.own_objects += e.saved
            else:
                plans.decided.append((len(plans.own_before) - 1, row))
            plans.rows.append(row)
        out.append(plans)
    return out


def _visiting_order(holders: Iterable[int]) -> tuple[int, ...]:
    """The order in which DCP's rule weighs the holders of an entry, which decides its ties: it collects
    them in a ``set`` as it visits their plans (ascending ranks) and takes the first least loaded in that
    set's iteration order (CPython's, for instance {7, 15, 23, 31} iterates 31, 15, 23, 7). The same
    set, built the same way, gives the same order."""
    visited: set[int] = set()
    for rank in sorted(holders):
        visited.add(rank)
    return tuple(visited)


def _assign(c: PlanContext, saved: SavedState) -> Assignment:
    """Every rank's part after DCP's de-duplication (the module docstring): the rule visits the ranks'
    plans in rank order; an entry only the visited rank holds needs no choice, so only the weight of
    those before each decided entry is added as the walk reaches it."""
    from trainer.checkpoint.footprint import saved_tensor_bytes

    dims = c.dims
    names = tuple(dims.mesh_dim_names)
    sizes = {a: dims.axis_size(a) for a in names}
    frees: list[frozenset[str]] = []
    kinds: list[Kind] = []
    stages = _stage_plans(c, saved.entries, _holdings(c, saved), frees, kinds)

    world = dims.world_size
    coordinates = [dims.coordinates(rank) for rank in range(world)]
    reads = [tuple(a for split in splits for a in split.axes) for _, _, splits in kinds]
    memo: dict[tuple[int, tuple[int, ...]], Chunk] = {}  # a chunk follows from the coordinates it reads

    def chunks_of(rank: int) -> list[Chunk]:
        coords = coordinates[rank]
        out = []
        for i, (shape, dtype, splits) in enumerate(kinds):
            key = (i, tuple(coords[a] for a in reads[i]))
            if key not in memo:
                local, at = _chunk(shape, splits, coords, sizes)
                memo[key] = (local, at, saved_tensor_bytes(math.prod(local), dtype))
            out.append(memo[key])
        return out

    load = [0] * world
    won: list[list[Written]] = [[] for _ in range(world)]
    rank_bytes, rank_entries, unique = [0] * world, [0] * world, 0
    visits: dict[tuple[int, tuple[bool, ...]], list[tuple[int, _Row]]] = {}
    order: dict[tuple[int, int], tuple[int, ...]] = {}
    for rank in range(world):
        coords = coordinates[rank]
        nonzero = {a for a in names if coords[a]}
        first = tuple(not (f & nonzero) for f in frees)  # this rank is the lowest holder of such entries
        plans = stages[coords["pp"]]
        if (coords["pp"], first) not in visits:  # the decided entries this rank's plan is the first to hold
            visits[coords["pp"], first] = [(at, r) for at, r in plans.decided if first[r.free]]
        chunks = chunks_of(rank)
        added = 0  # weight of this rank's own entries already on its load
        for at, r in visits[coords["pp"], first]:
            if r.owner is not None and r.owner != coords["dp_replicate"]:
                continue
            load[rank] += plans.own_before[at] - added
            added = plans.own_before[at]
            if (rank, r.free) not in order:
                order[rank, r.free] = _visiting_order(rank + o for o in r.holders)
            winner = min(order[rank, r.free], key=load.__getitem__)
            load[winner] += r.weight
            won[winner].append((r.entry, chunks[r.kind] if r.kind >= 0 else ((), (), r.entry.saved)))
            unique += 1
        load[rank] += plans.own_before[-1] - added
        rank_bytes[rank] += plans.own_objects + sum(n * chunks[k][2] for k, n in plans.own_kinds.items())
        rank_entries[rank] += plans.own_entries
        unique += plans.own_entries
    for rank, ws in enumerate(won):
        rank_bytes[rank] += sum(chunk[2] for _, chunk in ws)
        rank_entries[rank] += len(ws)
    return Assignment(rank_bytes, rank_entries, unique, stages, won, chunks_of)


# -- rank 0's files ------------------------------------------------------------------------------------


def _fresh(s: str) -> str:
    """A copy of ``s`` that is another object: DCP's coordinator receives each rank's names in that rank's
    own pickle, so its ``.metadata`` repeats them instead of referring back (pickle's memo)."""
    return (s + "\0")[:-1]


def _metadata_bytes(plan: Assignment, pp_rank_of: Callable[[int], int], folder: str) -> int:
    """Bytes of the ``.metadata`` the coordinator pickles (``FileSystemWriter.finish``), built from the
    planned chunks with DCP's own classes. Past ``METADATA_SAMPLE`` entries it is built for every m-th
    and every 2m-th rank's entries, and the other ranks counted at the difference's bytes per rank."""
    from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION, DEFAULT_SUFFIX, _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        StorageMeta,
        TensorProperties,
        TensorStorageMetadata,
    )

    from trainer.checkpoint.checkpointer import peer_path

    world = len(plan.rank_entries)
    per_stage = world // len(plan.stages)

    def last_holder(e: SavedEntry, rank: int) -> int:
        if e.scope == "rank":
            return rank
        return world - 1 if e.scope == "run" else (pp_rank_of(rank) + 1) * per_stage - 1

    def pickled(ranks: range) -> int:
        md: dict[str, Union[TensorStorageMetadata, BytesStorageMetadata]] = {}
        tops: dict[str, str] = {}  # a plan's paths share their first name
        tensors: dict[str, TensorStorageMetadata] = {}
        planner_data: dict[str, tuple[str, ...]] = {}
        storage: dict[MetadataIndex, _StorageInfo] = {}
        for rank in ranks:
            ws = plan.written(rank, pp_rank_of(rank))
            name = f"__{rank}_0{DEFAULT_SUFFIX}"
            at_object = 0  # FileSystemWriter writes a file's objects first, then its tensors
            at_tensor = sum(chunk[2] for e, chunk in ws if e.dtype is None)
            for e, (local, offsets, length) in ws:
                path = tuple(str(p) for p in peer_path(e.path, rank)) if e.scope == "rank" else e.path
                key = ".".join(path) if e.scope == "rank" else e.key
                if key not in md:
                    # the metadata names an entry as its first writer's plan does, the merged flatten
                    # mapping as the last holder's: one object (pickled once) only when they coincide
                    named = key if last_holder(e, rank) == rank else _fresh(key)
                    planner_data[named] = (tops.setdefault(path[0], _fresh(path[0])), *map(_fresh, path[1:]))
                    if e.dtype is None:
                        md[key] = BytesStorageMetadata()
                    else:
                        md[key] = tensors[key] = TensorStorageMetadata(
                            TensorProperties(e.dtype), torch.Size(e.shape), []
                        )
                if e.dtype is None:
                    storage[MetadataIndex(_fresh(key))] = _StorageInfo(name, at_object, length)
                    at_object += length
                    continue
                chunks = tensors[key].chunks
                index = MetadataIndex(_fresh(key), torch.Size(offsets), len(chunks))
                chunks.append(ChunkStorageMetadata(torch.Size(offsets), torch.Size(local)))
                storage[index] = _StorageInfo(name, at_tensor, length)
                at_tensor += length
        meta_of_run = StorageMeta(checkpoint_id=Path(folder), save_id=str(uuid.uuid4()))
        return len(pickle.dumps(Metadata(md, planner_data, storage, meta_of_run, CURRENT_DCP_VERSION)))

    every = math.ceil(plan.unique / METADATA_SAMPLE)
    if every <= 1 or world < 4:
        return pickled(range(world))
    m = max(1, min(world // 4, every))
    fewer, more = range(0, world, 2 * m), range(0, world, m)
    size_fewer, size_more = pickled(fewer), pickled(more)
    return size_more + (world - len(more)) * (size_more - size_fewer) // (len(more) - len(fewer))


def checkpoint_plan(c: PlanContext) -> CheckpointPlan:
    """What one save of ``c``'s run writes on every rank (the module docstring)."""
    import os

    from torch.distributed.checkpoint.filesystem import DEFAULT_SUFFIX

    from trainer.checkpoint.checkpointer import completed_marker, describe_layout, marker_of, model_info
    from trainer.checkpoint.footprint import METADATA, marker_bytes
    from trainer.checkpoint.storage import CheckpointWriter, step_dir

    cfg, dims = c.cfg, c.dims
    plan = _assign(c, saved_entries(cfg, c.table.model))
    step = cfg.training.steps
    folder = f"{step_dir(os.path.join(cfg.job.dump_folder, cfg.checkpoint.folder), step)}.tmp-{'0' * 12}"
    writer = CheckpointWriter(folder, step)  # its layout: thread_count files per rank, or one per entry
    files = [writer.thread_count if writer.single_file_per_rank else n for n in plan.rank_entries]
    metadata = _metadata_bytes(plan, lambda rank: dims.coordinates(rank)["pp"], folder)
    rank_bytes = [float(b) for b in plan.rank_bytes]
    sizes = {  # the marker lists every file's size: each rank's data evenly over its files
        f"__{r}_{i}{DEFAULT_SUFFIX}": int(rank_bytes[r] // max(1, files[r]))
        for r in range(dims.world_size)
        for i in range(files[r])
    }
    sizes[METADATA] = metadata
    info = model_info(cfg.model, cfg.data.tokenizer, describe_layout(dims, cfg.parallelism))
    tokens = step * cfg.training.global_batch_size * cfg.training.seq_len
    marker = marker_bytes(
        completed_marker(
            marker_of(info, step=step, tokens_seen=tokens, world_size=dims.world_size, model_only=False),
            sizes,
            {n: f"{0:08x}" for n in sizes},  # CRC32 as file_crc32 writes it
        )
    )
    rank_bytes[0] += metadata + marker
    files[0] += 2  # .metadata and checkpoint.json
    return CheckpointPlan(
        rank_bytes=rank_bytes,
        rank_files=files,
        rank_entries=plan.rank_entries,
        metadata_bytes=float(metadata),
        marker_bytes=float(marker),
        entries=plan.unique,
        files_per_rank=writer.thread_count if writer.single_file_per_rank else 0,
    )
