"""What one checkpoint save writes on each rank, found by DCP's own save planning, without writing it.

``save_footprint`` takes the state one save writes (``Checkpointer.save_state``) and runs the steps of
``dcp.save`` (``torch.distributed.checkpoint.state_dict_saver``) up to the writes, on this rank:
the Stateful objects' state dicts, ``DefaultSavePlanner.set_up_planner`` + ``create_local_plan``, the
coordinator's ``create_global_plan`` (its de-duplication of entries that several ranks hold: each goes
to the holder with the least planned storage so far, ``_dedup_save_plans``) with the writer's
``prepare_global_plan``, and ``finish_plan``. What the writes would put on disk follows from the final
plans as ``FileSystemWriter`` lays them out: one file per bucket of its ``thread_count`` (``single_file_
per_rank``, the default) or one per entry, each tensor entry a ``torch.save`` of the chunk, each other
entry a ``torch.save`` of the object, and on the coordinator the pickled ``.metadata``.

The global step needs every rank's local plan, which a rank never has: under a real process group DCP
gathers them; here they are derived from this rank's own (:func:`peer_plan`). A DTensor entry becomes
the chunk the peer holds, computed from the DTensor's mesh and placements at the peer's coordinate on
that mesh's named dims (what DCP's ``compute_local_shape_and_global_offset`` computes at this rank's);
a plain tensor or another object is the same entry on every rank, except where the caller names it
per rank (``peer_path``: the checkpoint's ``rng.rank<R>``). The plans, write results and metadata pass
through ``pickle`` as the gather and scatter of a real save send them, so the ``.metadata`` pickle has
the real one's size.

Nothing touches the disk (``prepare_local_plan``, which only creates the folder and checks for an
existing ``.metadata`` under collectives, is not called). Fake tensors have no storage: a tensor's
bytes come from its chunk's shape and dtype (:func:`saved_tensor_bytes`).

Pipeline stages save other parameters than this rank's: another stage's local plan is known only by
the entries every stage saves (the schedule, loader and train state, the RNG). DCP visits the plans in
rank order and places an entry when it first meets it, so this rank's stage is placed exactly, given
the other stages' loads when it is visited, which are those entries; the first stage's own entries,
placed before the shared ones in rank 0's plan, are unknown on another stage (the shared entries,
a few kB, may fall on other ranks than in the real save). The coordinator's ``.metadata`` lists every
stage's entries: under pp > 1 only this rank's data files are sized (``complete=False``).
"""

from __future__ import annotations

import dataclasses
import functools
import io
import math
import pickle
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional, TypeVar

import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import (
    CURRENT_DCP_VERSION,
    DEFAULT_SUFFIX,
    FileSystemWriter,
    SerializationFormat,
    _split_by_size_and_type,
    _StorageInfo,
)
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.state_dict_saver import _stateful_to_state_dict
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

from trainer.checkpoint.storage import MARKER, json_text

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = [
    "METADATA",
    "SaveFootprint",
    "marker_bytes",
    "peer_plan",
    "save_footprint",
    "saved_object_bytes",
    "saved_tensor_bytes",
]

METADATA = ".metadata"  # the coordinator's file (FileSystemWriter's name for it)

ObjectPath = tuple[object, ...]  # DCP's flatten mapping: a flattened key's path in the nested state dict
PeerPath = Callable[[ObjectPath, int], ObjectPath]
EveryStage = Callable[[ObjectPath], bool]  # the entries every pipeline stage saves
T = TypeVar("T")


# -- what torch.save writes --------------------------------------------------------------------------


def _torch_save_bytes(obj: object) -> int:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getbuffer().nbytes


@functools.cache
def _tensor_archive(dtype: torch.dtype) -> tuple[int, int, int]:
    """(bytes of ``torch.save`` of an empty tensor of ``dtype``, of a one-element one, the alignment)."""
    align = int(torch.utils.serialization.config.save.storage_alignment)
    return (
        _torch_save_bytes(torch.zeros(0, dtype=dtype)),
        _torch_save_bytes(torch.zeros(1, dtype=dtype)),
        align,
    )


def saved_tensor_bytes(numel: int, dtype: torch.dtype) -> int:
    """Bytes ``torch.save`` writes for a contiguous tensor of ``numel`` elements (how ``FileSystemWriter``
    writes each tensor entry): a zip archive of fixed size around the data, which starts and ends on
    torch's storage alignment (``torch.utils.serialization.config.save.storage_alignment``, 64 B).
    Measured on a one-element tensor of the dtype; exact for any ``numel`` (the archive's pickle of the
    shape only grows past that alignment for tensors of millions of dimensions)."""
    empty, one, align = _tensor_archive(dtype)
    if numel == 0:
        return empty
    return one + align * (numel * dtype.itemsize // align)


def saved_object_bytes(obj: object) -> int:
    """Bytes ``torch.save`` writes for a non-tensor entry (DCP's ``BYTE_IO`` items:
    ``DefaultSavePlanner.transform_object``)."""
    return _torch_save_bytes(obj)


def marker_bytes(marker: dict[str, object]) -> int:
    """Bytes of the completion marker as ``storage.write_json_durable`` writes it."""
    return len(json_text(marker).encode())


# -- the other ranks' local plans ---------------------------------------------------------------------


Coordinates = Callable[[int], Mapping[str, int]]  # a rank's index on every named mesh dim and view


@dataclass
class _Derivation:
    """What deriving peers' plans from this rank's needs: this rank, the flattened state dict and its
    object paths, the per-rank naming, every rank's mesh coordinates and a memo of chunks."""

    rank: int
    state_dict: dict[str, object]
    paths: dict[str, ObjectPath]
    peer_path: PeerPath
    coordinates: Coordinates
    chunks: dict[tuple[object, ...], tuple[torch.Size, torch.Size]] = field(default_factory=dict)

    def key_of(self, key: str, peer: int) -> tuple[str, ObjectPath]:
        path = self.paths.get(key, (key,))
        peer_path = self.peer_path(path, peer)
        return (key if peer_path == path else ".".join(str(p) for p in peer_path)), peer_path

    def coordinate(self, mesh: DeviceMesh, peer: int) -> tuple[int, ...]:
        """``peer``'s coordinate on the mesh dims of ``mesh`` (its own copy of that submesh: a DTensor on
        a submesh, say FSDP's dp_shard_cp alone under tp > 1, has a counterpart on every tp rank)."""
        names = mesh.mesh_dim_names
        if names is None:
            raise ValueError(f"a DTensor on an unnamed mesh {mesh}: its chunks on other ranks are unknown")
        mine, theirs = self.coordinates(self.rank), self.coordinates(peer)
        if tuple(mine[n] for n in names) != tuple(mesh.get_coordinate() or ()):
            raise ValueError(f"the coordinates given disagree with the mesh {mesh} on rank {self.rank}")
        return tuple(theirs[n] for n in names)

    def chunk_of(self, t: DTensor, peer: int) -> tuple[torch.Size, torch.Size]:
        mesh = t.device_mesh
        coordinate = self.coordinate(mesh, peer)
        key = (tuple(t.shape), tuple(mesh.shape), coordinate, tuple(t.placements))
        if key not in self.chunks:
            sizes, offsets = _compute_local_shape_and_global_offset(
                t.shape, mesh.shape, list(coordinate), t.placements
            )
            self.chunks[key] = (torch.Size(sizes), torch.Size(offsets))
        return self.chunks[key]


def peer_plan(
    plan: SavePlan, peer: int, how: _Derivation, every_stage: Optional[EveryStage] = None
) -> SavePlan:
    """The local plan ``create_local_plan`` makes on ``peer``, derived from this rank's ``plan``; for a
    peer of another pipeline stage (``every_stage`` given), only the entries every stage saves."""
    items: list[WriteItem] = []
    mappings: dict[str, ObjectPath] = {}
    for item in plan.items:
        if every_stage is not None and not every_stage(how.paths.get(item.index.fqn, (item.index.fqn,))):
            continue
        key, path = how.key_of(item.index.fqn, peer)
        obj = how.state_dict[item.index.fqn]
        if isinstance(obj, DTensor):
            assert item.tensor_data is not None  # a DTensor entry is a tensor write
            # fresh objects per entry, as create_local_plan makes them (the plan's pickle shares none)
            sizes, offsets = (torch.Size(list(x)) for x in how.chunk_of(obj, peer))
            item = WriteItem(
                index=MetadataIndex(key, offsets),
                type=item.type,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=offsets, sizes=sizes),
                    properties=item.tensor_data.properties,
                    size=item.tensor_data.size,
                ),
            )
        elif key != item.index.fqn:
            item = dataclasses.replace(item, index=dataclasses.replace(item.index, fqn=key))
        items.append(item)
    if isinstance(plan.planner_data, dict):
        for k in plan.planner_data:
            if every_stage is None or every_stage(how.paths.get(k, (k,))):
                key, path = how.key_of(k, peer)
                mappings[key] = path
    return dataclasses.replace(plan, items=items, planner_data=mappings or plan.planner_data)


# -- the footprint -------------------------------------------------------------------------------------


@dataclass
class SaveFootprint:
    """What one rank writes in one save: its files of the committed checkpoint and its DCP entries, and
    every rank's files as the same plans lay them out."""

    rank: int
    world_size: int
    files: dict[str, int]  # name -> bytes (data files; on the coordinator also .metadata and the marker)
    entries: int  # DCP write items this rank writes after de-duplication
    checkpoint: dict[str, int]  # every file of the committed checkpoint (all ranks'), name -> bytes
    # False under pipeline parallelism: the other stages' entries are unknown here, so neither their
    # data files nor the coordinator's .metadata and marker (which list every stage's) are sized
    complete: bool = True

    @property
    def bytes(self) -> int:
        return sum(self.files.values())


def _as_sent(obj: T) -> T:
    """``obj`` as another rank receives it (``gather_object`` / ``scatter_object_list`` pickle it)."""
    return pickle.loads(pickle.dumps(obj))


def _entry_bytes(item: WriteItem, objects: Callable[[str], object], memo: dict[str, int]) -> int:
    if item.type == WriteItemType.BYTE_IO:
        if item.index.fqn not in memo:
            memo[item.index.fqn] = saved_object_bytes(objects(item.index.fqn))
        return memo[item.index.fqn]
    assert item.tensor_data is not None
    return saved_tensor_bytes(math.prod(item.tensor_data.chunk.sizes), item.tensor_data.properties.dtype)


def _writes(
    plan: SavePlan, writer: FileSystemWriter, objects: Callable[[str], object], memo: dict[str, int]
) -> tuple[dict[str, int], list[tuple[MetadataIndex, _StorageInfo]]]:
    """``FileSystemWriter.write_data``'s files for ``plan`` (name -> bytes) and its write results, without
    writing: the buckets, then in each file the non-tensor entries before the tensors."""
    prefix = plan.storage_data.prefix
    if writer.single_file_per_rank:
        buckets = _split_by_size_and_type(writer.thread_count, plan.items)
    else:
        buckets = [[item] for item in plan.items]
    files: dict[str, int] = {}
    results: list[tuple[MetadataIndex, _StorageInfo]] = []
    for n, bucket in enumerate(buckets):
        name = f"{prefix}{n}{DEFAULT_SUFFIX}"
        ordered = [i for i in bucket if i.type == WriteItemType.BYTE_IO]
        ordered += [i for i in bucket if i.type != WriteItemType.BYTE_IO]
        offset = 0
        for item in ordered:
            length = _entry_bytes(item, objects, memo)
            results.append((item.index, _StorageInfo(name, offset, length)))
            offset += length
        files[name] = offset
    return files, results


def save_footprint(
    state: dict[str, object],
    *,
    rank: int,
    world_size: int,
    writer: FileSystemWriter,
    peer_path: PeerPath,
    coordinates: Coordinates,
    every_stage: Optional[EveryStage] = None,
    marker: Optional[Callable[[dict[str, int]], dict[str, object]]] = None,
) -> SaveFootprint:
    """What ``dcp.save(state, storage_writer=writer)`` writes on ``rank`` of ``world_size`` (see the module
    docstring). ``peer_path(path, peer)``: the object path ``peer`` saves in place of this rank's
    ``path``; ``coordinates(rank)``: a rank's index on every named mesh dim and view
    (``ParallelDims.coordinates``), which places its chunk of a DTensor. ``every_stage(path)``: whether
    every pipeline stage saves the entry at ``path`` (the others are a stage's own): needed with
    pp > 1, where another stage's plan is known only by those entries (the footprint is then
    ``complete=False``: its files are this rank's data files). ``marker(files)``: the completion marker
    the coordinator writes once the files (name -> bytes) are on disk, counted on rank 0 (None: no
    marker)."""
    if writer.serialization_format != SerializationFormat.TORCH_SAVE:
        raise ValueError(f"the writer's {writer.serialization_format}: only torch.save files are sized")
    stage = coordinates(rank).get("pp", 0)
    elsewhere = {q for q in range(world_size) if coordinates(q).get("pp", 0) != stage}
    if elsewhere and every_stage is None:
        raise ValueError(
            f"rank {min(elsewhere)} is in another pipeline stage than rank {rank}: it saves other "
            "parameters, which this rank's state does not show; say which entries every stage saves "
            "(every_stage)"
        )
    state_dict = _stateful_to_state_dict(state)
    planner = DefaultSavePlanner()
    planner.set_up_planner(state_dict, storage_meta=writer.storage_meta(), is_coordinator=rank == 0)
    writer.set_up_storage_writer(rank == 0, rank=rank, use_collectives=True)
    local = planner.create_local_plan()
    flat = planner.state_dict
    how = _Derivation(rank, flat, dict(planner.mappings), peer_path, coordinates)
    plans = [
        local if q == rank else peer_plan(local, q, how, every_stage if q in elsewhere else None)
        for q in range(world_size)
    ]
    global_plans, metadata = planner.create_global_plan([_as_sent(p) for p in plans])
    global_plans = [_as_sent(p) for p in writer.prepare_global_plan(global_plans)]  # scattered
    final = planner.finish_plan(global_plans[rank])

    # A peer's per-rank key (its RNG) -> this rank's counterpart: the same kind of object, the same size.
    other = (rank + 1) % world_size
    per_rank = [k for k in flat if how.key_of(k, other)[0] != k]
    local_key = {how.key_of(k, q)[0]: k for k in per_rank for q in range(world_size)}

    def objects(key: str) -> object:
        return flat[local_key.get(key, key)]

    memo: dict[str, int] = {}
    every: dict[str, int] = {}  # every rank's files
    storage: dict[MetadataIndex, _StorageInfo] = {}
    for q, p in enumerate(global_plans):
        written, results = _writes(final if q == rank else p, writer, objects, memo)
        storage.update(_as_sent(results))  # gathered to the coordinator
        every.update(written)
    mine = _writes(final, writer, objects, memo)[0]
    if elsewhere:  # the other stages' data files, .metadata and marker: not known here
        every = {
            n: every[n]
            for q in range(world_size)
            if q not in elsewhere
            for n in every
            if n.startswith(f"__{q}_")
        }
        return SaveFootprint(rank, world_size, {n: every[n] for n in mine}, len(final.items), every, False)
    metadata = dataclasses.replace(
        metadata, version=CURRENT_DCP_VERSION, storage_data=storage, storage_meta=writer.storage_meta()
    )
    every[METADATA] = len(pickle.dumps(metadata))
    if marker is not None:
        every[MARKER] = marker_bytes(marker(dict(every)))
    if rank == 0:  # the coordinator writes DCP's .metadata; the commit, the marker
        mine.update({n: 0 for n in (METADATA, MARKER) if n in every})
    return SaveFootprint(rank, world_size, {n: every[n] for n in mine}, len(final.items), every)
