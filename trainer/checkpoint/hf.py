"""Hugging Face interop for every model family: ``config.json`` and safetensors, read and written.

The family-specific parts -- config conversion and tensor names -- are each family's HF adapter
(``ModelSpec.hf``, e.g. ``models.llama.LlamaHF``); this module only does the file work:

- ``save_hf``: full tensors (our names) -> ``model.safetensors`` or shards + index, ``config.json``.
- ``save_hf_distributed``: the same files from a live, possibly sharded model (collective; one
  tensor gathered at a time), for ``checkpoint.last_save_in_hf``.
- ``read_hf``: a HF folder -> (spec, args, full tensors in our names), for one process.
- ``load_hf_into``: a HF folder -> an already parallelized module, where each rank reads only
  the byte ranges of the slices it owns (positioned reads, no memory map), so a rank's
  resident memory grows by one slice at a time, never by the whole model.

State a family keeps but HF does not store (the adapter names no HF tensor for it: the MoE
routing bias ``expert_bias``) starts at zero on import, as in a fresh model; on export the
adapter refuses a value HF cannot represent (a non-zero bias), before any file is written.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import re
from collections.abc import Iterable, Iterator
from typing import Any, Optional, cast

import torch
from torch import nn

from models import MODEL_SPECS
from models.common import unwrapped_name
from models.errors import ConfigError
from models.spec import HFAdapter, ModelArgs, ModelSpec
from parallelisms.utils import plain_tensor

CONFIG_FILE = "config.json"
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
MESHWRIGHT_FILE = "meshwright.json"  # our tokenizer choice and model args, for generation

logger = logging.getLogger("meshwright")


def spec_for_hf_config(cfg: dict[str, Any]) -> ModelSpec:
    """The family whose HF adapter reads this ``config.json`` (by ``model_type``)."""
    model_type = cfg.get("model_type")
    for spec in MODEL_SPECS.values():
        if spec.hf is not None and model_type in getattr(spec.hf, "model_types", (spec.hf.model_type,)):
            return spec
    known = sorted(
        t
        for spec in MODEL_SPECS.values()
        if spec.hf is not None
        for t in getattr(spec.hf, "model_types", (spec.hf.model_type,))
    )
    raise ConfigError(f"config.json has model_type={model_type!r}; meshwright reads {known}.")


def parse_size(text: str) -> int:
    """``"5GB"``, ``"500MB"``, ``"123"`` (bytes) -> bytes (powers of 1000, as HF's max_shard_size)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?B?)\s*", text.upper())
    if not m:
        raise ConfigError(f"max shard size {text!r}: use a size like 5GB, 500MB or a byte count.")
    unit = m.group(2).removesuffix("B")  # "GB" and "G" alike; "B" and "" are bytes
    return int(float(m.group(1)) * {"": 1, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12}[unit])


def _shard_plan(sizes: list[tuple[str, int]], max_shard_bytes: int) -> list[list[str]]:
    """Group names (in the given order) into files of at most ``max_shard_bytes`` (a bigger tensor
    gets a file of its own)."""
    shards: list[list[str]] = [[]]
    size = 0
    for name, nbytes in sizes:
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


def _file_names(num_files: int) -> list[str]:
    if num_files == 1:
        return [SINGLE_FILE]
    return [f"model-{i + 1:05d}-of-{num_files:05d}.safetensors" for i in range(num_files)]


def _write_sidecars(
    out_dir: str,
    weight_map: dict[str, str],
    total_bytes: int,
    spec: ModelSpec,
    args: ModelArgs,
    dtype: torch.dtype,
    extra: Optional[dict[str, Any]],
    bos_id: Optional[int],
    eos_id: Optional[int],
) -> list[str]:
    """The index (when sharded), ``config.json`` and ``meshwright.json`` (when ``extra``)."""
    files = []
    if len(set(weight_map.values())) > 1:
        index = {"metadata": {"total_size": total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
        _write_json(os.path.join(out_dir, INDEX_FILE), index)
        files.append(INDEX_FILE)
    dtype_name = str(dtype).removeprefix("torch.")
    _write_json(
        os.path.join(out_dir, CONFIG_FILE),
        _hf_adapter(spec).to_hf_config(args, bos_id=bos_id, eos_id=eos_id, dtype=dtype_name),
    )
    files.append(CONFIG_FILE)
    if extra is not None:
        _write_json(os.path.join(out_dir, MESHWRIGHT_FILE), extra)
        files.append(MESHWRIGHT_FILE)
    return files


def _hf_adapter(spec: ModelSpec) -> HFAdapter:
    if spec.hf is None:
        raise ConfigError(f"model family {spec.family!r} has no Hugging Face format.")
    return spec.hf


def save_hf(
    state: dict[str, torch.Tensor],
    spec: ModelSpec,
    args: ModelArgs,
    out_dir: str,
    *,
    max_shard_bytes: int = 5 * 2**30,
    dtype: torch.dtype = torch.float32,
    extra: Optional[dict[str, Any]] = None,
    bos_id: Optional[int] = None,
    eos_id: Optional[int] = None,
) -> list[str]:
    """Write ``state`` (our names, full tensors) as HF safetensors + ``config.json``; return the files.

    One ``model.safetensors`` when it fits ``max_shard_bytes``, else ``model-0000i-of-0000n``
    shards plus ``model.safetensors.index.json``.
    """
    from safetensors.torch import save_file

    adapter = _hf_adapter(spec)
    hf = {name: t.detach().to("cpu", dtype).contiguous() for name, t in adapter.to_hf_state(state, args)}
    os.makedirs(out_dir, mode=0o750, exist_ok=True)
    sizes = [(name, hf[name].numel() * hf[name].element_size()) for name in sorted(hf)]
    shards = _shard_plan(sizes, max_shard_bytes)
    names = _file_names(len(shards))
    weight_map: dict[str, str] = {}
    for fname, shard in zip(names, shards):
        save_file({n: hf[n] for n in shard}, os.path.join(out_dir, fname), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, fname))
    total = sum(nbytes for _, nbytes in sizes)
    return names + _write_sidecars(out_dir, weight_map, total, spec, args, dtype, extra, bos_id, eos_id)


@torch.no_grad()
def save_hf_distributed(
    module: nn.Module,
    spec: ModelSpec,
    args: ModelArgs,
    out_dir: str,
    *,
    is_writer: bool,
    max_shard_bytes: int = 5 * 2**30,
    dtype: torch.dtype = torch.float32,
    extra: Optional[dict[str, Any]] = None,
    bos_id: Optional[int] = None,
    eos_id: Optional[int] = None,
) -> list[str]:
    """``save_hf`` of a (possibly sharded) live model, one tensor gathered at a time; collective.

    Every rank calls it with the same module layout (plain, DDP, FSDP/HSDP or TP; not a
    pipeline stage, which lacks the other stages' weights). Each parameter is gathered with
    ``full_tensor()`` in the same order on every rank; the writer (``is_writer``, one rank)
    keeps the tensors of the current file only and writes it before gathering the next, so its
    memory holds one file (``max_shard_bytes``), the others' one tensor. Returns the files
    (written by the writer only; ``out_dir`` must exist there).
    """
    from safetensors.torch import save_file
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    from torch.distributed.tensor import DTensor

    adapter = _hf_adapter(spec)
    # canonical names; DTensors stay sharded (a module's state holds tensors only); float8 weight
    # wrappers give the plain tensors they hold
    state = {k: plain_tensor(cast(torch.Tensor, v)) for k, v in get_model_state_dict(module).items()}
    # Our tensors that make one HF tensor together (a fused projection: Qwen3.5's q, k, v) are
    # gathered and converted together: a group per HF name, keyed by its first tensor's name.
    groups: dict[str, list[str]] = {}
    group_of_hf: dict[str, str] = {}
    for name in sorted(state):
        hf_names = adapter.hf_names_of(name, args)
        key = next((group_of_hf[h] for h in hf_names if h in group_of_hf), name)
        groups.setdefault(key, []).append(name)
        group_of_hf.update(dict.fromkeys(hf_names, key))
    # Names and sizes of every HF tensor, from a dry run on meta tensors (no data moves).
    pieces: dict[str, int] = {}
    for key, members in groups.items():
        metas = {n: torch.empty(state[n].shape, dtype=dtype, device="meta") for n in members}
        hf = list(adapter.to_hf_state(metas, args))
        if hf:
            pieces[key] = sum(t.numel() * t.element_size() for _, t in hf)
        elif not any(isinstance(state[n], DTensor) for n in members):
            # No HF tensor (a tied head, the MoE routing bias): the adapter sees the value, on every
            # rank alike (no collective), and refuses one HF cannot represent before a file is written.
            list(adapter.to_hf_state({n: state[n] for n in members}, args))
    shards = _shard_plan(list(pieces.items()), max_shard_bytes)
    names = _file_names(len(shards))
    weight_map: dict[str, str] = {}
    for fname, shard in zip(names, shards):
        tensors: dict[str, torch.Tensor] = {}
        for key in shard:
            full: dict[str, torch.Tensor] = {}
            for n in groups[key]:  # collective, one tensor of the group at a time
                value = state[n]
                full[n] = value.full_tensor() if isinstance(value, DTensor) else value
            if is_writer:
                for hf_name, t in adapter.to_hf_state(full, args):
                    tensors[hf_name] = t.detach().to("cpu", dtype).contiguous()
            del full
        if is_writer:
            save_file(tensors, os.path.join(out_dir, fname), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(tensors, fname))
        del tensors
    if not is_writer:
        return names
    total = sum(pieces.values())
    return names + _write_sidecars(out_dir, weight_map, total, spec, args, dtype, extra, bos_id, eos_id)


def _write_json(path: str, value: Any) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(value, f, indent=2)


def read_hf_config(hf_dir: str) -> tuple[ModelSpec, ModelArgs]:
    """(spec, args) of a HF folder's ``config.json``; ``ConfigError`` when unusable."""
    cfg_path = os.path.join(hf_dir, CONFIG_FILE)
    if not os.path.isfile(cfg_path):
        raise ConfigError(f"{hf_dir} has no {CONFIG_FILE}; point at a Hugging Face model folder.")
    with open(cfg_path, encoding="utf-8") as f:
        cfg = json.load(f)
    spec = spec_for_hf_config(cfg)
    return spec, spec.make_args(_hf_adapter(spec).args_from_hf_config(cfg))


def _weight_files(hf_dir: str) -> dict[str, str]:
    """HF tensor name -> the safetensors file (path) holding it."""
    from safetensors import safe_open

    index = os.path.join(hf_dir, INDEX_FILE)
    if os.path.isfile(index):
        with open(index, encoding="utf-8") as f:
            return {k: os.path.join(hf_dir, v) for k, v in json.load(f)["weight_map"].items()}
    single = os.path.join(hf_dir, SINGLE_FILE)
    if not os.path.isfile(single):
        raise ConfigError(f"{hf_dir} has neither {SINGLE_FILE} nor {INDEX_FILE}; export safetensors weights.")
    try:
        with safe_open(single, framework="pt") as f:
            return dict.fromkeys(f.keys(), single)
    except Exception as e:
        raise ConfigError(f"{single} cannot be read ({e}).") from e


def read_hf(hf_dir: str) -> tuple[ModelSpec, Any, dict[str, torch.Tensor]]:
    """(spec, args, full tensors renamed to ours) of a HF folder, on one process."""
    from safetensors.torch import load_file

    spec, args = read_hf_config(hf_dir)
    adapter = _hf_adapter(spec)
    hf_state: dict[str, torch.Tensor] = {}
    skipped: list[str] = []
    for path in sorted(set(_weight_files(hf_dir).values())):
        try:
            tensors = load_file(path)
        except Exception as e:
            raise ConfigError(f"{path} cannot be read ({e}).") from e
        for folder_name, tensor in tensors.items():  # the adapter's names; unused-by-design skipped
            name = adapter.folder_name(folder_name)
            if name is None:
                skipped.append(folder_name)
            else:
                hf_state[name] = tensor
    if skipped:
        logger.info(
            f"{hf_dir}: skipped {len(skipped)} tensors the {spec.family} model does not use, e.g. "
            f"{skipped[0]}"
        )
    return spec, args, adapter.from_hf_state(hf_state, args)


# safetensors dtype names -> torch dtypes (the ones a model checkpoint holds).
_SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


class _SliceReader:
    """Reads index slices of named tensors from safetensors files with positioned reads.

    Only the bytes of the requested slice are read: one read for a range of rows (an FSDP or
    column-parallel shard), one read per row for a range of columns (a row-parallel shard).
    Plain ``preadv`` into a buffer sized for the slice, not ``mmap``: on a fault the kernel maps
    the pages around it too (fault-around, large page-cache folios), so a memory-mapped reader's
    resident memory grew by ~78% of a 38m model per FSDP rank of two, against 50% of slices
    touched. ``bytes_read`` counts what was read.
    """

    def __init__(self, files: dict[str, str], aliases: Optional[dict[str, str]] = None) -> None:
        self.files = files
        self.aliases = aliases or {}  # a name -> the folder's own name of the tensor, where they differ
        self.bytes_read = 0
        self._fds: dict[str, int] = {}
        self._headers: dict[str, tuple[int, dict[str, Any]]] = {}  # path -> (data offset, header)

    def _entry(self, hf_name: str) -> tuple[int, dict[str, Any]]:
        """(file descriptor, header entry with an absolute ``start``) of one tensor."""
        path = self.files[hf_name]
        if path not in self._fds:
            self._fds[path] = os.open(path, os.O_RDONLY)
            try:
                size = int.from_bytes(os.pread(self._fds[path], 8, 0), "little")
                header = json.loads(os.pread(self._fds[path], size, 8))
            except (ValueError, OSError) as e:
                raise ConfigError(f"{path} is not a readable safetensors file ({e}).") from e
            self._headers[path] = (8 + size, header)
        base, header = self._headers[path]
        hf_name = self.aliases.get(hf_name, hf_name)
        if hf_name not in header:
            raise ConfigError(f"{path} lacks {hf_name!r}, which its index lists there.")
        entry = header[hf_name]
        if entry["dtype"] not in _SAFETENSORS_DTYPES:
            raise ConfigError(f"{path}: {hf_name} has dtype {entry['dtype']}, which meshwright cannot read.")
        return self._fds[path], {**entry, "start": base + entry["data_offsets"][0]}

    def shape(self, hf_name: str) -> list[int]:
        """The full shape of ``hf_name``."""
        return list(self._entry(hf_name)[1]["shape"])

    def read(self, hf_name: str, index: tuple[slice, ...]) -> torch.Tensor:
        """``tensor[index]`` (a tuple of step-1 slices, one per leading dim) of ``hf_name``."""
        fd, entry = self._entry(hf_name)
        shape, dtype = entry["shape"], _SAFETENSORS_DTYPES[entry["dtype"]]
        if not shape:
            return self._pread(fd, entry["start"], 1, dtype).reshape(())
        bounds = [slice(*s.indices(n)[:2]) for s, n in zip(index, shape)]
        bounds += [slice(0, n) for n in shape[len(bounds) :]]
        rows = bounds[0].stop - bounds[0].start
        row_numel = math.prod(shape[1:])
        if len(shape) >= 2 and [b.stop - b.start for b in bounds[2:]] == shape[2:]:
            # Within each row, the requested columns are one contiguous run.
            cols = bounds[1].stop - bounds[1].start
            col_numel = math.prod(shape[2:])
            if cols == shape[1]:  # whole rows: one read
                start = entry["start"] + bounds[0].start * row_numel * dtype.itemsize
                return self._pread(fd, start, rows * row_numel, dtype).reshape(rows, *shape[1:])
            out = torch.empty((rows, cols, *shape[2:]), dtype=dtype)
            for i in range(rows):
                start = (
                    entry["start"]
                    + ((bounds[0].start + i) * row_numel + bounds[1].start * col_numel) * dtype.itemsize
                )
                self._pread_into(fd, start, out[i])
            return out
        # Slices in dims >= 2: read the rows, then cut (transient: one tensor's rows).
        start = entry["start"] + bounds[0].start * row_numel * dtype.itemsize
        block = self._pread(fd, start, rows * row_numel, dtype).reshape(rows, *shape[1:])
        rest = (slice(None), *bounds[1:])
        return block[rest].clone()

    def _pread(self, fd: int, offset: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
        out = torch.empty(numel, dtype=dtype)
        self._pread_into(fd, offset, out)
        return out

    def _pread_into(self, fd: int, offset: int, out: torch.Tensor) -> None:
        view = out.view(torch.uint8).numpy().data.cast("B")  # the tensor's bytes, written in place
        done = 0
        while done < len(view):
            n = os.preadv(fd, [view[done:]], offset + done)
            if n <= 0:
                raise ConfigError(f"a safetensors file ended early (reading at byte {offset + done}).")
            done += n
        self.bytes_read += done

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        self._headers.clear()


def _local_index(param: torch.Tensor) -> tuple[tuple[slice, ...], torch.Tensor]:
    """(slice of the full tensor this rank holds, the local tensor to write) of a parameter."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if isinstance(param, DTensor):
        shape, offset = compute_local_shape_and_global_offset(
            param.shape, param.device_mesh, param.placements
        )
        return tuple(slice(o, o + s) for o, s in zip(offset, shape)), param.to_local()
    return tuple(slice(0, s) for s in param.shape), param


def _named_tensors(module: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Parameters (each once, tied ones under their first name), then persistent buffers (the
    state dict's other entries, e.g. the MoE routing bias), with canonical names."""
    seen: set[int] = set()
    for name, p in module.named_parameters(remove_duplicate=False):
        if id(p) in seen:
            continue
        seen.add(id(p))
        yield unwrapped_name(name), p
    for prefix, sub in module.named_modules():
        for name, buf in sub._buffers.items():
            if buf is None or name in sub._non_persistent_buffers_set or id(buf) in seen:
                continue
            seen.add(id(buf))
            yield unwrapped_name(f"{prefix}.{name}" if prefix else name), buf


# Model settings that change what the weights compute but not their shapes (RoPE, norm, MoE routing);
# those the family's args have.
_SAME_SHAPE_SETTINGS = (
    "rope_theta",
    "rope_scaling",
    "norm_eps",
    "top_k",
    "route_norm",
    "score_func",
    "route_scale",
)


def _check_folder(
    hf_dir: str, spec: ModelSpec, args: ModelArgs, full_names: Iterable[str], aliases: dict[str, str]
) -> dict[str, str]:
    """The folder's weight files (``_weight_files``, by the adapter's names: ``aliases`` gets the
    folder's own name of each renamed one) once it holds this model: same family, no tensor the
    model lacks. Warns when the folder's RoPE, norm or (MoE) routing settings differ from
    the run's (same shapes, different function)."""
    folder_spec, folder_args = read_hf_config(hf_dir)
    if folder_spec.family != spec.family:
        raise ConfigError(
            f"{hf_dir} holds a {folder_spec.family!r} model but this run's model.family is {spec.family!r}."
        )
    adapter = _hf_adapter(spec)
    # The folder's names as the adapter spells them (a vision-language folder's text decoder); the
    # tensors the model does not use by design (a vision tower) are skipped, by name in the log.
    files: dict[str, str] = {}
    skipped: list[str] = []
    for folder_name, path in _weight_files(hf_dir).items():
        name = adapter.folder_name(folder_name)
        if name is None:
            skipped.append(folder_name)
        else:
            files[name] = path
            if name != folder_name:
                aliases[name] = folder_name
    if skipped:
        logger.info(
            f"{hf_dir}: skipped {len(skipped)} tensors the {spec.family} model does not use, e.g. "
            f"{skipped[0]}"
        )
    expected = {hf_name for name in full_names for hf_name in adapter.hf_names_of(name, args)}
    extra = sorted(k for k in files if k not in expected and not k.endswith("rotary_emb.inv_freq"))
    if extra:
        raise ConfigError(
            f"{hf_dir} has tensor {extra[0]!r} that this model lacks ({len(extra)} in all); set the model "
            "config to match its config.json."
        )
    # Both are the family's args class (checked above): the same fields, read without probing.
    theirs, ours = dataclasses.asdict(folder_args), dataclasses.asdict(args)
    differ = [
        f"{key}={theirs[key]} (this run: {ours[key]})"
        for key in _SAME_SHAPE_SETTINGS
        if key in ours and theirs[key] != ours[key]
    ]
    if differ:
        logger.warning(f"{hf_dir}/config.json differs from model config: {'; '.join(differ)}")
    return files


@torch.no_grad()
def load_hf_into(
    module: nn.Module,
    hf_dir: str,
    spec: ModelSpec,
    args: ModelArgs,
    full_names: Optional[Iterable[str]] = None,
) -> int:
    """Copy a HF folder's weights into ``module`` (plain, FSDP, TP or a pipeline stage); return
    the number of bytes this rank read.

    Each rank reads only the slices of the tensors it owns, one parameter at a time, straight
    into a buffer of the slice's size: its memory grows by one slice at most, not by the model.
    The folder must hold this model: its ``config.json`` names the same family, every tensor has
    this model's full shape and none is left over (``full_names``: the whole model's state-dict
    names, default the module's own; a pipeline stage passes the full model's). State HF does
    not store (no HF name, e.g. the MoE routing bias) is set to zero, as in a fresh model.
    """
    names = list(full_names) if full_names is not None else [n for n, _ in _named_tensors(module)]
    aliases: dict[str, str] = {}
    files = _check_folder(hf_dir, spec, args, names, aliases)
    reader = _SliceReader(files, aliases)
    try:
        for name, param in _named_tensors(module):
            hf_names = _hf_adapter(spec).hf_names_of(name, args)
            index, local = _local_index(param)
            if not hf_names:  # state HF does not store (the MoE routing bias): a fresh model's zero
                local.zero_()
                continue
            pieces = []
            for hf_name in hf_names:
                if hf_name not in files:
                    raise ConfigError(
                        f"{hf_dir} has no tensor {hf_name!r} (for {name!r}); the model config differs from "
                        f"the exported one."
                    )
                pieces.append((hf_name, reader.shape(hf_name)))
            full_shape = _hf_adapter(spec).full_shape(name, [s for _, s in pieces], args)
            if list(full_shape) != list(param.shape):
                raise ConfigError(
                    f"{hf_dir}: {hf_names[0]} ({name!r}) has shape {list(full_shape)} but this model's is "
                    f"{list(param.shape)}; set the model config to match config.json."
                )
            value = _hf_adapter(spec).read_slice(name, index, reader, args)
            local.copy_(value.to(local.device, local.dtype))
        return reader.bytes_read
    finally:
        reader.close()
