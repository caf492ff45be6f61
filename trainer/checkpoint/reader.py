"""Reading a DCP checkpoint without running code from it.

A ``torch.distributed.checkpoint`` folder holds two kinds of pickle:

* ``.metadata``: the ``Metadata`` dataclass (keys, shapes, dtypes, where each chunk lives).
  torch's ``FileSystemReader.read_metadata`` reads it with plain ``pickle.load``, which calls
  whatever the pickle names (``os.system``, ``builtins.exec``, ...).
* BYTES entries inside the ``__R_I.distcp`` files: every non-tensor value of the state dict
  (optimizer param groups, the lr scheduler, the data loader position, the step). torch's
  ``DefaultLoadPlanner.load_bytes`` reads them with ``torch.load(weights_only=False)``.

So a step folder with a crafted ``.metadata`` or bytes entry (and a ``checkpoint.json`` whose
sizes and CRC32s were updated to match: those catch damage, not tampering) would run code on
``checkpoint.initial_load_path``, on resume, in ``trainer.generate`` and ``trainer.export_hf``.
Every load here goes through :class:`CheckpointReader` and :class:`SafeLoadPlanner` instead:

* ``.metadata`` is unpickled by an ``Unpickler`` whose ``find_class`` returns only the globals
  DCP metadata is made of (:func:`metadata_globals`); any other global is refused with
  :class:`UnsafeCheckpointError` when the pickle names it, before anything is constructed.
* BYTES entries load with ``torch.load(weights_only=True)`` (torch's allow-list of plain
  containers, numbers, strings and tensors); a refusal also becomes UnsafeCheckpointError.

Both errors are ``ConfigError`` s: the CLIs print them and exit with status 2, like any other
bad checkpoint.
"""

from __future__ import annotations

import functools
import io
import os
import pathlib
import pickle
import re
from typing import Any, Optional

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import ReadItem

from models.errors import ConfigError

__all__ = [
    "CheckpointReader",
    "SafeLoadPlanner",
    "UnsafeCheckpointError",
    "dcp_load",
    "find_refusal",
    "metadata_globals",
]

_METADATA_MODULE = "torch.distributed.checkpoint.metadata"
# The classes of torch.distributed.checkpoint.metadata a .metadata pickle names. Derived by
# recording every ``find_class`` call while unpickling the .metadata of real checkpoints of this
# repo under torch 2.13 (one process sync and async, a seed checkpoint, FSDP x2 sync and async,
# DDP x2 (ours and torch's), ZeRO-1 x2, TP x2, PP x2, MoE with EP x2 over FSDP x2): every layout
# names exactly these, plus ``_StorageInfo``, ``torch.Size``, ``torch.serialization._get_layout``
# (how a ``torch.layout`` pickles), ``pathlib.PosixPath`` (``StorageMeta.checkpoint_id``) and the
# dtypes of the saved tensors (``torch.float32``; ``torch.uint8`` for the RNG states). No builtins:
# dicts, lists, tuples, strings, numbers and None have opcodes of their own.
_METADATA_CLASSES = (
    "Metadata",
    "TensorStorageMetadata",
    "BytesStorageMetadata",
    "ChunkStorageMetadata",
    "TensorProperties",
    "_MEM_FORMAT_ENCODING",  # TensorProperties pickles its memory format as this Enum
    "MetadataIndex",
    "StorageMeta",
)
_MESSAGE_TAIL = (
    "this checkpoint was not written by torch.distributed.checkpoint (or was altered after saving); "
    "nothing in it was run and the load stopped. Only load checkpoints you trust; exchange weights as "
    "Hugging Face safetensors (python -m trainer.export_hf)."
)


class UnsafeCheckpointError(ConfigError):
    """A checkpoint file names something a DCP checkpoint never holds; it was not unpickled."""


@functools.cache
def metadata_globals() -> dict[tuple[str, str], Any]:
    """(module, name) -> object: every global a DCP ``.metadata`` pickle may name (torch >= 2.9).

    Each is a plain value class or lookup: constructing one runs no code that touches the
    system. Names are matched exactly, so a dotted name (``pathlib``, ``PosixPath.touch``) that
    pickle would resolve attribute by attribute is refused too.
    """
    from torch.distributed.checkpoint import filesystem, metadata

    allowed: dict[tuple[str, str], Any] = {
        (_METADATA_MODULE, name): getattr(metadata, name)
        for name in _METADATA_CLASSES
        if hasattr(metadata, name)
    }
    allowed[("torch.distributed.checkpoint.filesystem", "_StorageInfo")] = filesystem._StorageInfo
    allowed[("torch", "Size")] = torch.Size
    allowed[("torch.serialization", "_get_layout")] = torch.serialization._get_layout  # a dict lookup
    # StorageMeta.checkpoint_id: the folder the writer was given, a Path (``pathlib._local`` is
    # its module from Python 3.13). Building a path touches no file.
    allowed[("pathlib", "PosixPath")] = pathlib.PosixPath
    allowed[("pathlib._local", "PosixPath")] = pathlib.PosixPath
    # A dtype pickles as a reference to its torch attribute (``torch.float32``); vars(), not
    # getattr(), so no lazily imported torch submodule is ever loaded by a name in the file.
    for name, value in vars(torch).items():
        if isinstance(value, torch.dtype):
            allowed[("torch", name)] = value
    return allowed


def refusal_message(file: str, what: str, why: str) -> str:
    return f"{file}: refusing to unpickle {what}: {why}; {_MESSAGE_TAIL}"


class _MetadataUnpickler(pickle.Unpickler):
    """``pickle.Unpickler`` that resolves only :func:`metadata_globals`."""

    def __init__(self, file: Any, source: str) -> None:
        super().__init__(file)
        self._source = source
        self._allowed = metadata_globals()

    def find_class(self, module: str, name: str) -> Any:
        found = self._allowed.get((module, name))
        if found is None:
            raise UnsafeCheckpointError(
                refusal_message(self._source, f"'{module}.{name}'", "not a DCP metadata class")
            )
        return found


def _check_metadata(metadata: Any, source: str) -> None:
    """The unpickled object is DCP metadata whose data files lie inside the checkpoint folder."""
    if not isinstance(metadata, Metadata) or not isinstance(metadata.state_dict_metadata, dict):
        raise ValueError(f"it holds a {type(metadata).__name__}, not DCP Metadata")
    storage = metadata.storage_data
    if not isinstance(storage, dict):
        raise ValueError(f"its storage_data is a {type(storage).__name__}, not a dict")
    for info in storage.values():
        name = getattr(info, "relative_path", None)
        if (
            not isinstance(name, str)
            or name in ("", ".", "..")
            or os.path.basename(name) != name
            or "\\" in name
        ):
            raise UnsafeCheckpointError(
                f"{source}: names data file {name!r}, which is not a file of the checkpoint folder; "
                f"{_MESSAGE_TAIL}"
            )


class CheckpointReader(FileSystemReader):
    """torch's ``FileSystemReader`` with the ``.metadata`` pickle read through the allow-list, and
    BYTES entries only through :class:`SafeLoadPlanner` (``torch.load(weights_only=True)``)."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")  # recent torch: per-rank metadata of a save without collectives
        name = ".metadata" if rank is None else f"__{rank}.metadata"
        path = self.fs.concat_path(self.path, name)
        with self.fs.create_stream(path, "rb") as f:
            metadata = _MetadataUnpickler(f, str(path)).load()
        _check_metadata(metadata, str(path))
        # What FileSystemReader.read_metadata does after unpickling (the same code in torch 2.13 and
        # older releases): checkpoints of older torch versions have no storage_meta.
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def read_data(self, plan: Any, planner: Any) -> torch.futures.Future:
        if not isinstance(planner, SafeLoadPlanner):
            raise TypeError(
                "CheckpointReader needs planner=SafeLoadPlanner(reader): DCP's default planner unpickles "
                "bytes entries with torch.load(weights_only=False). Use trainer.checkpoint.reader.dcp_load."
            )
        return super().read_data(plan, planner)

    def load_bytes_entry(self, read_item: ReadItem, value: io.BytesIO) -> Any:
        """A BYTES entry (a ``torch.save`` of a non-tensor value), through torch's weights-only
        unpickler; a refused global becomes UnsafeCheckpointError naming the file and entry."""
        try:
            return torch.load(value, weights_only=True)
        except pickle.UnpicklingError as e:
            info = self.storage_data.get(read_item.storage_index)
            file = self.fs.concat_path(self.path, info.relative_path) if info is not None else self.path
            found = re.search(r"GLOBAL (\S+)", str(e))
            what = f"'{found.group(1)}'" if found else "it"
            raise UnsafeCheckpointError(
                refusal_message(
                    str(file),
                    f"bytes entry {read_item.storage_index.fqn!r}",
                    f"{what} is not an allowed global of torch.load(weights_only=True)",
                )
            ) from None


class SafeLoadPlanner(DefaultLoadPlanner):
    """``DefaultLoadPlanner`` whose BYTES entries load through ``reader.load_bytes_entry``
    (weights-only), then land where the default planner puts them."""

    def __init__(self, reader: CheckpointReader, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.reader = reader

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        obj = self.reader.load_bytes_entry(read_item, value)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


def find_refusal(exc: BaseException) -> Optional[UnsafeCheckpointError]:
    """The UnsafeCheckpointError inside ``exc`` (DCP wraps each rank's failure in a
    CheckpointException), or None."""
    seen: set[int] = set()
    todo: list[Optional[BaseException]] = [exc]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, UnsafeCheckpointError):
            return e
        if isinstance(e, CheckpointException):
            todo.extend(
                failure[0] if isinstance(failure, tuple) else failure for failure in e.failures.values()
            )
        todo.extend((e.__cause__, e.__context__))
    return None


def dcp_load(state: dict[str, Any], path: str, **kwargs: Any) -> None:
    """``dcp.load`` of checkpoint folder ``path`` through :class:`CheckpointReader` and
    :class:`SafeLoadPlanner`; a refusal on any rank is raised as itself (the same on every rank)."""
    reader = CheckpointReader(path)
    try:
        dcp.load(state, storage_reader=reader, planner=SafeLoadPlanner(reader), **kwargs)
    except CheckpointException as e:
        refusal = find_refusal(e)
        if refusal is not None:
            raise refusal from None
        raise
