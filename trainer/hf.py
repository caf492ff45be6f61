"""Hugging Face interop for every model family: ``config.json`` and safetensors, read and written.

The family-specific parts -- config conversion and tensor names -- are each family's HF adapter
(``ModelSpec.hf``, e.g. ``models.llama.LlamaHF``); this module only does the file work:

- ``save_hf``: full tensors (our names) -> ``model.safetensors`` or shards + index, ``config.json``.
- ``read_hf``: a HF folder -> (spec, args, full tensors in our names), for one process.
- ``load_hf_into``: a HF folder -> an already parallelized module, where each rank reads only
  the slices it owns (safetensors slices are memory-mapped, so a rank's resident memory grows
  by its shard, not by the whole model).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any, Optional

import torch
from torch import nn

from models import MODEL_SPECS
from models.errors import ConfigError
from models.spec import ModelSpec

CONFIG_FILE = "config.json"
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
MESHWRIGHT_FILE = "meshwright.json"  # our tokenizer choice and model args, for generation


def spec_for_hf_config(cfg: dict[str, Any]) -> ModelSpec:
    """The family whose HF adapter reads this ``config.json`` (by ``model_type``)."""
    model_type = cfg.get("model_type")
    for spec in MODEL_SPECS.values():
        if spec.hf is not None and model_type in getattr(spec.hf, "model_types", (spec.hf.model_type,)):
            return spec
    known = sorted(
        t for spec in MODEL_SPECS.values() if spec.hf is not None
        for t in getattr(spec.hf, "model_types", (spec.hf.model_type,))
    )  # fmt: skip
    raise ConfigError(f"config.json has model_type={model_type!r}; meshwright reads {known}.")


def _shard_plan(tensors: dict[str, torch.Tensor], max_shard_bytes: int) -> list[dict[str, torch.Tensor]]:
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name in sorted(tensors):
        nbytes = tensors[name].numel() * tensors[name].element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensors[name]
        size += nbytes
    return shards


def save_hf(state: dict[str, torch.Tensor], spec: ModelSpec, args: Any, out_dir: str, *,
            max_shard_bytes: int = 5 * 2**30, dtype: torch.dtype = torch.float32,
            extra: Optional[dict[str, Any]] = None, bos_id: Optional[int] = None,
            eos_id: Optional[int] = None) -> list[str]:  # fmt: skip
    """Write ``state`` (our names, full tensors) as HF safetensors + ``config.json``; return the files.

    One ``model.safetensors`` when it fits ``max_shard_bytes``, else ``model-0000i-of-0000n``
    shards plus ``model.safetensors.index.json``.
    """
    from safetensors.torch import save_file

    if spec.hf is None:
        raise ConfigError(f"model family {spec.family!r} has no Hugging Face format.")
    hf = {name: t.detach().to("cpu", dtype).contiguous() for name, t in spec.hf.to_hf_state(state, args)}
    os.makedirs(out_dir, mode=0o750, exist_ok=True)
    shards = _shard_plan(hf, max_shard_bytes)
    files = []
    if len(shards) == 1:
        save_file(shards[0], os.path.join(out_dir, SINGLE_FILE), metadata={"format": "pt"})
        files.append(SINGLE_FILE)
    else:
        weight_map = {}
        for i, shard in enumerate(shards):
            fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, os.path.join(out_dir, fname), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(shard, fname))
            files.append(fname)
        total = sum(t.numel() * t.element_size() for t in hf.values())
        _write_json(
            os.path.join(out_dir, INDEX_FILE), {"metadata": {"total_size": total}, "weight_map": weight_map}
        )
        files.append(INDEX_FILE)
    dtype_name = str(dtype).removeprefix("torch.")
    _write_json(
        os.path.join(out_dir, CONFIG_FILE),
        spec.hf.to_hf_config(args, bos_id=bos_id, eos_id=eos_id, dtype=dtype_name),
    )
    files.append(CONFIG_FILE)
    if extra is not None:
        _write_json(os.path.join(out_dir, MESHWRIGHT_FILE), extra)
        files.append(MESHWRIGHT_FILE)
    return files


def _write_json(path: str, value: Any) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(value, f, indent=2)


def read_hf_config(hf_dir: str) -> tuple[ModelSpec, Any]:
    """(spec, args) of a HF folder's ``config.json``; ``ConfigError`` when unusable."""
    cfg_path = os.path.join(hf_dir, CONFIG_FILE)
    if not os.path.isfile(cfg_path):
        raise ConfigError(f"{hf_dir} has no {CONFIG_FILE}; point at a Hugging Face model folder.")
    with open(cfg_path, encoding="utf-8") as f:
        cfg = json.load(f)
    spec = spec_for_hf_config(cfg)
    return spec, spec.make_args(spec.hf.args_from_hf_config(cfg))


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
    hf_state: dict[str, torch.Tensor] = {}
    for path in sorted(set(_weight_files(hf_dir).values())):
        try:
            hf_state.update(load_file(path))
        except Exception as e:
            raise ConfigError(f"{path} cannot be read ({e}).") from e
    return spec, args, spec.hf.from_hf_state(hf_state, args)


class _SliceReader:
    """Opens safetensors files lazily and reads index slices of named tensors (memory-mapped)."""

    def __init__(self, files: dict[str, str]) -> None:
        self.files = files
        self._open: dict[str, Any] = {}

    def shape(self, hf_name: str) -> list[int]:
        return list(self._handle(hf_name).get_slice(hf_name).get_shape())

    def read(self, hf_name: str, index: tuple[slice, ...]) -> torch.Tensor:
        return self._handle(hf_name).get_slice(hf_name)[index]

    def _handle(self, hf_name: str) -> Any:
        from safetensors import safe_open

        path = self.files[hf_name]
        if path not in self._open:
            self._open[path] = safe_open(path, framework="pt")
        return self._open[path]

    def close(self) -> None:
        self._open.clear()


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
    """Parameters (each once, tied ones under their first name) with canonical names."""
    seen: set[int] = set()
    for name, p in module.named_parameters(remove_duplicate=False):
        if id(p) in seen:
            continue
        seen.add(id(p))
        yield name.replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", ""), p


@torch.no_grad()
def load_hf_into(module: nn.Module, hf_dir: str, spec: ModelSpec, args: Any) -> None:
    """Copy a HF folder's weights into ``module`` (plain, FSDP, TP or a pipeline stage).

    Each rank reads only the slices of the tensors it owns. The folder's config must describe
    the same model (shapes are checked against the full shapes of this rank's parameters).
    """
    files = _weight_files(hf_dir)
    reader = _SliceReader(files)
    try:
        for name, param in _named_tensors(module):
            hf_names = spec.hf.hf_names_of(name, args)
            index, local = _local_index(param)
            pieces = []
            for hf_name in hf_names:
                if hf_name not in files:
                    raise ConfigError(
                        f"{hf_dir} has no tensor {hf_name!r} (for {name!r}); the model config differs from "
                        f"the exported one."
                    )
                pieces.append((hf_name, reader.shape(hf_name)))
            full_shape = spec.hf.full_shape(name, [s for _, s in pieces], args)
            if list(full_shape) != list(param.shape):
                raise ConfigError(
                    f"{hf_dir}: {hf_names[0]} ({name!r}) has shape {list(full_shape)} but this model's is "
                    f"{list(param.shape)}; set the model config to match config.json."
                )
            value = spec.hf.read_slice(name, index, reader, args)
            local.copy_(value.to(local.device, local.dtype))
    finally:
        reader.close()
