"""On-disk side of checkpoints: folder layout, atomic-commit pieces, integrity checks.

Layout::

    <dump_folder>/<checkpoint.folder>/step-N/    a complete checkpoint
        .metadata, __R_I.distcp                  torch.distributed.checkpoint files
        checkpoint.json                          completion marker (sizes, CRC32s, model
                                                 args, tokenizer, layout), written last
    <dump_folder>/<checkpoint.folder>/step-N.tmp-<id>    a save in progress (or a killed one)
    <dump_folder>/<checkpoint.folder>/step-N.trash-<id>  a checkpoint being deleted

Only ``step-N`` folders holding the marker are ever loaded; ``*.tmp-*`` / ``*.trash-*``
leftovers are deleted at the next start (``remove_leftovers``). Before a load every file is
checked against the size and CRC32 recorded at save time, so a truncated, overwritten or
bit-rotten checkpoint gives a clear error instead of silently wrong weights.

Test hook: ``MESHWRIGHT_TEST_CRASH_AT=<phase>[@<step>]`` SIGKILLs the process at a named
phase (``after_step``, ``before_write``, ``mid_write``, ``before_commit``, ``after_commit``,
``during_purge``), only in the first torchrun attempt. It exists for the kill -9 tests.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import signal
import warnings
import zlib
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from models.errors import ConfigError
from trainer.checkpoint.reader import CheckpointReader, dcp_load
from trainer.checkpoint.space import as_disk_full

logger = logging.getLogger("meshwright")

MARKER = "checkpoint.json"
FORMAT_VERSION = 1
CRASH_ENV = "MESHWRIGHT_TEST_CRASH_AT"
CRC_SUFFIX = "crc.json"
_STEP_RE = re.compile(r"^step-(\d+)$")
_LEFTOVER_RE = re.compile(r"^step-\d+(-hf)?\.(tmp|trash)-[0-9a-f]+$")  # step-N or step-N-hf


def crash_point(phase: str, step: int) -> None:
    """Test hook: ``MESHWRIGHT_TEST_CRASH_AT=<phase>[@<step>]`` kills this process (SIGKILL) here.

    Fires only in the first torchrun attempt (``TORCHELASTIC_RESTART_COUNT`` 0 or unset), so
    a ``--max-restarts`` run recovers. Never set it outside tests.
    """
    spec = os.environ.get(CRASH_ENV)
    if not spec:
        return
    want_phase, _, want_step = spec.partition("@")
    if want_phase != phase or (want_step and int(want_step) != step):
        return
    if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return
    logger.warning(f"{CRASH_ENV}={spec}: killing this process (test hook)")
    os.kill(os.getpid(), signal.SIGKILL)


def step_dir(folder: str, step: int) -> str:
    """The folder of the complete checkpoint of ``step``."""
    return os.path.join(folder, f"step-{step}")


def hf_step_dir(folder: str, step: int) -> str:
    """The Hugging Face folder of ``step`` (``checkpoint.last_save_in_hf``)."""
    return os.path.join(folder, f"step-{step}-hf")


def make_dir(path: str) -> None:
    """Create ``path`` (and parents) with mode 0o750."""
    os.makedirs(path, mode=0o750, exist_ok=True)
    os.chmod(path, 0o750)  # mode= is masked by the umask; the contract says 0o750


def fsync_dir(path: str) -> None:
    """Persist a directory's entries (a rename in it) across power loss."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def json_text(obj: dict[str, object]) -> str:
    """``obj`` as the JSON text ``write_json_durable`` writes."""
    return json.dumps(obj, indent=1, sort_keys=True)


def write_json_durable(path: str, obj: dict[str, Any]) -> None:
    """Write ``obj`` as JSON and fsync it before returning."""
    with open(path, "w", encoding="utf-8") as f:
        f.write(json_text(obj))
        f.flush()
        os.fsync(f.fileno())


def complete_steps(folder: str) -> list[int]:
    """Steps of the complete checkpoints in ``folder`` (``step-N`` with the marker), ascending."""
    if not os.path.isdir(folder):
        return []
    steps = []
    for name in os.listdir(folder):
        m = _STEP_RE.match(name)
        if m and os.path.isfile(os.path.join(folder, name, MARKER)):
            steps.append(int(m.group(1)))
    return sorted(steps)


def remove_leftovers(folder: str) -> list[str]:
    """Delete ``*.tmp-*`` / ``*.trash-*`` folders of interrupted saves and purges; return their names."""
    if not os.path.isdir(folder):
        return []
    removed = []
    for name in sorted(os.listdir(folder)):
        if _LEFTOVER_RE.match(name):
            shutil.rmtree(os.path.join(folder, name), ignore_errors=True)
            removed.append(name)
    return removed


def read_marker(path: str) -> dict[str, Any]:
    """The completion marker of checkpoint ``path``; ConfigError if missing or unreadable."""
    if not os.path.isdir(path):
        raise ConfigError(f"checkpoint folder {path} does not exist; check the path (a step-N folder).")
    marker = os.path.join(path, MARKER)
    if not os.path.isfile(marker):
        raise ConfigError(
            f"{path} has no {MARKER}: it is not a complete meshwright checkpoint (an interrupted save, "
            "or another tool's folder); point at a complete step-N folder."
        )
    try:
        with open(marker, encoding="utf-8") as f:
            info = json.load(f)
        if not isinstance(info, dict) or "step" not in info or "files" not in info:
            raise ValueError("missing keys")
    except ValueError as e:
        raise ConfigError(f"{marker} is corrupt ({e}); delete {path} or load another step.") from e
    return info


def verify_files(path: str, info: dict[str, Any]) -> None:
    """Every file the marker lists exists with its recorded size (catches truncation and deletion)."""
    for name, size in info["files"].items():
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            raise ConfigError(
                f"checkpoint {path} is missing {name}; it was damaged after saving. Delete {path} "
                "to resume from the previous checkpoint, or set checkpoint.load_step to another step."
            )
        actual = os.path.getsize(file)
        if actual != size:
            raise ConfigError(
                f"checkpoint file {file} has {actual} bytes but {size} were written (truncated or "
                f"overwritten). Delete {path} to resume from the previous checkpoint, or set "
                "checkpoint.load_step to another step."
            )


def file_crc32(path: str) -> str:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(16 << 20):
            crc = zlib.crc32(chunk, crc)
    return f"{crc:08x}"


def corrupt_files(path: str, info: dict[str, Any], rank: int = 0, world_size: int = 1) -> list[str]:
    """Files whose CRC32 differs from the one recorded at save time (bit rot, partial overwrite).

    Rank ``rank`` of ``world_size`` checks every ``world_size``-th file, so together the ranks
    read the checkpoint once.
    """
    crcs = info.get("crc32", {})
    names = sorted(crcs)[rank::world_size]
    return [n for n in names if file_crc32(os.path.join(path, n)) != crcs[n]]


def corrupt_message(path: str, names: list[str]) -> str:
    return (
        f"checkpoint {path}: {names[0]} does not match its CRC32 recorded at save time "
        f"({len(names)} corrupt file(s)); the data was damaged after saving. Delete {path} to resume "
        "from the previous checkpoint, or set checkpoint.load_step to another step."
    )


def read_metadata(path: str) -> Metadata:
    """DCP metadata of ``path`` (tensor keys, global shapes); ConfigError if unreadable, and
    UnsafeCheckpointError if its pickle names anything but DCP metadata classes (nothing of it is
    built then; see ``checkpoint_reader``)."""
    try:
        return CheckpointReader(path).read_metadata()
    except ConfigError:
        raise
    except Exception as e:  # unpickling garbage raises anything
        raise ConfigError(
            f"checkpoint {path}: its DCP .metadata cannot be read ({type(e).__name__}: {e}); the "
            "checkpoint is corrupt. Delete it or load another step."
        ) from e


def check_model_shapes(metadata: Metadata, expected: dict[str, torch.Size], path: str) -> None:
    """Raise naming the first tensor whose name or shape differs between checkpoint and model."""
    saved = {
        k[len("model.") :]: tuple(v.size)
        for k, v in metadata.state_dict_metadata.items()
        if k.startswith("model.") and isinstance(v, TensorStorageMetadata)
    }
    for name, shape in expected.items():
        if name not in saved:
            raise ConfigError(
                f"checkpoint {path} has no tensor {name!r} (shape {list(shape)} in this model); it holds "
                "another model. Use the model config it was saved with, or start a new job.dump_folder."
            )
        if saved[name] != tuple(shape):
            raise ConfigError(
                f"checkpoint {path}: tensor {name!r} has shape {list(saved[name])} but this model's is "
                f"{list(shape)}; the model config differs from the one it was saved with. Use that "
                "config, or start a new job.dump_folder."
            )
    extra = [k for k in saved if k not in expected]
    if extra:
        raise ConfigError(
            f"checkpoint {path} has tensor {extra[0]!r} that this model lacks ({len(extra)} extra in all); "
            "it holds a bigger model. Use the model config it was saved with."
        )


def load_full_state(path: str, prefix: str = "model.") -> dict[str, torch.Tensor]:
    """Read every tensor under ``prefix`` of checkpoint ``path`` in full, on this process only.

    Works without a process group (export, generation, tests); keys lose the prefix.
    """
    bad = corrupt_files(path, read_marker(path)) if os.path.isfile(os.path.join(path, MARKER)) else []
    if bad:
        raise ConfigError(corrupt_message(path, bad))
    metadata = read_metadata(path)
    sd = {
        k: torch.empty(v.size, dtype=v.properties.dtype)
        for k, v in metadata.state_dict_metadata.items()
        if k.startswith(prefix) and isinstance(v, TensorStorageMetadata)
    }
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process")
            dcp_load(sd, path, no_dist=True)
    except ConfigError:
        raise
    except Exception as e:
        raise ConfigError(f"checkpoint {path} could not be read ({type(e).__name__}: {e}).") from e
    return {k[len(prefix) :]: v for k, v in sd.items()}


class CheckpointWriter(FileSystemWriter):
    """DCP's file writer, plus a CRC32 of each file this rank wrote (a ``*.crc.json`` sidecar that
    the commit folds into the marker; the data is still in the page cache, so it is cheap) and
    the ``mid_write`` test hook (data written, ``.metadata`` not yet)."""

    def __init__(self, path: str, step: int) -> None:
        super().__init__(path)
        self._step = step

    def write_data(self, plan: Any, planner: Any) -> torch.futures.Future:
        try:
            fut = super().write_data(plan, planner)
            results = fut.wait()
            files = sorted({r.storage_data.relative_path for r in results})
            crcs = {name: file_crc32(os.path.join(self.path, name)) for name in files}
            sidecar = os.path.join(self.path, f"{plan.storage_data.prefix}{CRC_SUFFIX}")
            write_json_durable(sidecar, crcs)
        except Exception as e:  # a full disk becomes DiskFullError, which DCP gathers to every rank
            raise (as_disk_full(e, str(self.path)) or e) from e
        crash_point("mid_write", self._step)
        return fut

    def finish(self, metadata: Any, results: Any) -> None:
        try:
            super().finish(metadata, results)  # rank 0 writes .metadata
        except Exception as e:
            raise (as_disk_full(e, str(self.path)) or e) from e
