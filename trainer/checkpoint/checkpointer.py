"""Distributed checkpoints that never lose work: DCP, atomic commit, async save, resharding.

What a checkpoint holds (DCP keys, identical whatever layout wrote them, so a checkpoint is
one logical model: any layout loads what any other wrote):

* ``model.<fqn>``: the weights, named as the model names them (``models/<family>/model.py``; no
  ``module.`` / FSDP / compile prefixes), via ``get_model_state_dict`` on each model part
  (``model_parts``: DDP stripped, pipeline stages merged). A weight wrapper (torchao's float8 /
  MXFP8 training weights) is saved as the plain high-precision tensor it holds
  (``parallelisms.utils.plain_tensor``), so float8 and high-precision runs load each other's
  checkpoints.
* ``optimizer.state.<fqn>.<exp_avg|exp_avg_sq|step>`` and ``optimizer.param_groups.<fqn>.<key>``:
  the flattened optimizer state (``flatten_optimizer_state_dict``), so FSDP/TP shards, ZeRO-1
  owners and replicated optimizers all write the same logical keys.
* ``lr_scheduler.*``, ``dataloader.*`` (the global sample count: reshards over any dp
  degree), ``train_state.{step,tokens_seen}``, and ``rng.rank<R>.{cpu,cuda}`` per rank.

The Stateful adapters behind these keys, the per-rank paths and the marker's fields are
``trainer.checkpoint.contents``'s; this module saves, commits, loads and purges.

Atomic commit (see ``trainer.checkpoint.storage`` for the folder layout): every rank writes into
``step-N.tmp-<id>``; DCP writes ``.metadata`` only after every rank's data is on disk; then
rank 0 writes the marker ``checkpoint.json`` (sizes and CRC32 of every file, fsync), renames
the folder to ``step-N`` and fsyncs the parent. Old checkpoints are purged oldest-first by
renaming them to ``*.trash-*`` before deleting, never the newest complete one nor, with
``checkpoint.keep_every=K``, a step that is a multiple of K (the stable checkpoints a WSD decay
branches from).

Async (``checkpoint.async_mode=async``): ``dcp.async_save`` copies the state to host memory
(staging; the only pause of the loop) and writes in a background thread, on its own gloo
process group; rank 0 commits when the write finishes; a second save first waits for it.

RNG on resume: restored per rank when the world size is unchanged. Under another world size
the per-rank streams have no meaning, so every rank reseeds with ``seed + step`` (the model
has no dropout; the RNG does not affect the losses).

Two neighbours have their own modules: the seed checkpoint (``trainer.checkpoint.seed``: what a seed
is; ``save_seed`` here writes it as a model-only checkpoint) and the Hugging Face folder written at the
last step (``checkpoint.last_save_in_hf``: ``trainer.checkpoint.export.save_hf_step``).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
import uuid
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, Optional, cast

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

from models.errors import ConfigError
from trainer.checkpoint.contents import (
    ModelState,
    OptimizerState,
    Progress,
    TrainProgress,
    _rng_key,
    _rng_state,
    completed_marker,
    describe_layout,
    every_stage,
    marker_of,
    model_info,
    one_module,
    peer_path,
)
from trainer.checkpoint.export import save_hf_step
from trainer.checkpoint.reader import dcp_load
from trainer.checkpoint.seed import check_seed_folder
from trainer.checkpoint.space import (
    CheckpointDiskFull,
    as_disk_full,
    checkpoint_bytes,
    disk_full_message,
    find_disk_full,
    free_bytes,
    human_bytes,
    optimizer_states_per_param,
)
from trainer.checkpoint.storage import (
    CRC_SUFFIX,
    MARKER,
    CheckpointWriter,
    check_model_shapes,
    complete_steps,
    corrupt_files,
    corrupt_message,
    crash_point,
    file_crc32,
    fsync_dir,
    load_full_state,
    make_dir,
    read_marker,
    read_metadata,
    remove_leftovers,
    step_dir,
    verify_files,
    write_json_durable,
)

if TYPE_CHECKING:
    from torch.distributed.checkpoint.stateful import Stateful

    from models.spec import ModelArgs, ModelSpec
    from trainer.config import CheckpointConfig

# Re-exported here: the storage names other modules use, and the contents' names that trainer/train.py,
# the rehearsal and the planner import from this module (their home is trainer.checkpoint.contents).
__all__ = [
    "MARKER",
    "Checkpointer",
    "complete_steps",
    "completed_marker",
    "crash_point",
    "describe_layout",
    "every_stage",
    "load_full_state",
    "marker_of",
    "model_info",
    "peer_path",
    "read_marker",
    "verify_files",
]

logger = logging.getLogger("meshwright")


# -- the checkpointer ------------------------------------------------------------------


class Checkpointer:
    """Saves and loads the whole training state with DCP; see the module docstring.

    Collective: construct, ``load``, ``save`` and ``close`` on every rank in the same order.
    """

    def __init__(
        self,
        cfg: CheckpointConfig,
        *,
        dump_folder: str,
        model_parts: list[nn.Module],
        optimizer: torch.optim.Optimizer,
        lr_scheduler: Stateful,
        dataloader: Stateful,
        train_state: Progress,
        seed: int,
        device: torch.device,
        info: dict[str, Any],
        full_shapes: Optional[dict[str, torch.Size]] = None,
        hf_target: Optional[tuple[ModelSpec, ModelArgs]] = None,
        shared_folder: bool = False,
        extra_states: Optional[dict[str, Stateful]] = None,
    ) -> None:
        self.cfg = cfg
        self.hf_target = hf_target  # (ModelSpec, args) of the model, for checkpoint.initial_load_hf
        # Names and global shapes of the WHOLE model (a pipeline rank holds only its stages, so
        # its own state dict cannot tell a foreign checkpoint from the other stages' tensors).
        self.full_shapes = full_shapes
        self.folder = os.path.join(dump_folder, cfg.folder)
        self.parts = model_parts  # ``parallelisms.parallelize.model_parts``: no wrappers
        self.module = one_module(model_parts)
        self.train_state = train_state
        self.seed = seed
        self.device = device
        self.info = info  # model args, tokenizer, layout: written into every marker
        self.optimizer = optimizer
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.states: dict[str, Any] = {
            "model": ModelState(model_parts),
            "optimizer": OptimizerState(model_parts, optimizer),
            "lr_scheduler": lr_scheduler,
            "dataloader": dataloader,
            "train_state": TrainProgress(train_state),
        }
        # Optional run state (``spike``: the spike-skipping window); a checkpoint written without it
        # loads with that state left fresh.
        self.extra_keys = tuple(extra_states or {})
        self.states.update(extra_states or {})
        self.async_mode = cfg.async_mode == "async"
        # Background saves run their collectives on their own gloo group, never on the
        # group the training step uses at the same time.
        self._pg: Optional[dist.ProcessGroup] = dist.new_group(backend="gloo") if self.async_mode else None
        self._pending: Optional[tuple[int, str, dict[str, Any], Future]] = None
        self._last_saved_step: Optional[int] = None
        self._token = ""
        if cfg.enable or cfg.create_seed or cfg.last_save_in_hf:
            # shared_folder (fault-tolerant replica groups): a ``*.tmp-*`` folder may be another
            # group's save in progress, not a leftover; it is left alone.
            if self.rank == 0 and not shared_folder:
                for name in remove_leftovers(self.folder):
                    logger.warning(f"removed {name} from {self.folder}: an interrupted save or purge")
            # Rank 0's view of the disk travels with the token, so every rank takes the same verdict.
            shared: list[object] = [uuid.uuid4().hex[:12], *self._room()] if self.rank == 0 else [None] * 3
            dist.broadcast_object_list(shared, src=0, group=self._pg)  # also orders the cleanup first
            self._token, needed, free = cast("tuple[str, int, int]", tuple(shared))
            if (cfg.enable or cfg.create_seed) and free < needed:
                raise ConfigError(
                    f"{self.folder} has {human_bytes(free)} free but one checkpoint of this run needs about "
                    f"{human_bytes(needed)}; no checkpoint could be saved. Free space there, or set "
                    "checkpoint.folder / job.dump_folder to a larger disk (or checkpoint.enable=false)."
                )

    # -- loading ------------------------------------------------------------------------
    def _expected_shapes(self) -> dict[str, torch.Size]:
        if self.full_shapes is not None:
            return self.full_shapes
        return {k: v.shape for k, v in self.states["model"].state_dict().items()}

    def _resolve(self) -> Optional[tuple[str, bool]]:
        """(path, model_only) of what to start from, or None for a fresh start. No collectives."""
        cfg = self.cfg
        if cfg.enable:
            steps = complete_steps(self.folder)
            if cfg.load_step >= 0:
                if cfg.load_step not in steps:
                    raise ConfigError(
                        f"checkpoint.load_step={cfg.load_step}: {step_dir(self.folder, cfg.load_step)} does "
                        "not "
                        f"exist or is incomplete; complete checkpoints in {self.folder}: {steps or 'none'}. "
                        "Pick one of them, or checkpoint.load_step=-1 for the newest."
                    )
                newer = [s for s in steps if s > cfg.load_step]
                if newer:
                    logger.warning(
                        f"resuming from step {cfg.load_step} although newer checkpoints {newer} exist; "
                        "they are replaced as this run reaches their steps"
                    )
                return step_dir(self.folder, cfg.load_step), False
            if steps:
                return step_dir(self.folder, steps[-1]), False
        if cfg.initial_load_path:
            return cfg.initial_load_path, cfg.initial_load_model_only
        return None

    def load(self) -> bool:
        """Resume (or start from initial weights); True if anything was loaded. Raises ConfigError
        on every rank, before any collective, for a missing, incomplete, corrupt or foreign checkpoint."""
        if self.cfg.create_seed:
            return False
        target = self._resolve()
        if target is None:
            if self.cfg.initial_load_hf:
                from trainer.checkpoint.hf import load_hf_into

                spec, args = self._hf_target()
                start = time.perf_counter()
                names = self.full_shapes.keys() if self.full_shapes is not None else None
                nbytes = load_hf_into(self.module, self.cfg.initial_load_hf, spec, args, names)
                logger.info(
                    f"initial weights from Hugging Face folder {self.cfg.initial_load_hf}: this rank read "
                    f"{nbytes / 2**20:.1f} MiB in {time.perf_counter() - start:.2f}s"
                )
                return True
            return False
        path, model_only = target
        start = time.perf_counter()
        info = read_marker(path)
        verify_files(path, info)
        metadata = read_metadata(path)
        try:
            check_model_shapes(metadata, self._expected_shapes(), path)
        except ConfigError as e:
            saved = {k: v for k, v in info.get("model", {}).items() if v is not None}
            raise ConfigError(f"{e} It was saved with model: {saved}.") from None
        # Each rank checksums a share of the files; the verdict is shared before DCP's collectives.
        found: list[Any] = [None] * self.world_size
        dist.all_gather_object(found, corrupt_files(path, info, self.rank, self.world_size), group=self._pg)
        bad = sorted(n for part in found for n in part)
        if bad:
            raise ConfigError(corrupt_message(path, bad))
        model_only = model_only or bool(info.get("model_only", False))
        state: dict[str, Any] = {"model": self.states["model"]}
        rng_keys = {f"rng.rank{self.rank}.{k}" for k in _rng_state(self.device)}
        restore_rng = False
        if not model_only:
            written = {key.split(".", 1)[0] for key in metadata.state_dict_metadata}
            for key in self.extra_keys:
                if key not in written:
                    logger.warning(
                        f"checkpoint {path} has no {key!r} state (written without it): starts fresh"
                    )
            state.update(
                {
                    k: v
                    for k, v in self.states.items()
                    if k != "model" and (k not in self.extra_keys or k in written)
                }
            )
            restore_rng = info.get("world_size") == self.world_size and rng_keys <= set(
                metadata.state_dict_metadata
            )
            if restore_rng:
                state["rng"] = {f"rank{self.rank}": _rng_state(self.device)}
        try:
            dcp_load(state, path, process_group=self._pg)  # refuses code in .metadata / bytes entries
        except ConfigError:
            raise
        except Exception as e:
            raise ConfigError(
                f"checkpoint {path} could not be read ({type(e).__name__}: {str(e).strip()[:400]}); its "
                "files are corrupt or from an incompatible run. Delete it to resume from the previous "
                "checkpoint, or set checkpoint.load_step to another step."
            ) from e
        if restore_rng:
            rng = state["rng"][f"rank{self.rank}"]
            torch.set_rng_state(rng["cpu"])
            if "cuda" in rng:
                torch.cuda.set_rng_state(rng["cuda"], self.device)
        elif not model_only:
            torch.manual_seed(self.seed + self.train_state.step)
        what = "weights" if model_only else f"step {self.train_state.step}"
        self._last_saved_step = None if model_only else self.train_state.step
        logger.info(f"loaded {what} from {path} in {time.perf_counter() - start:.2f}s")
        return True

    # -- disk space ---------------------------------------------------------------------
    def _needed_bytes(self) -> int:
        """Bytes one checkpoint takes: the newest complete one's files, else an estimate."""
        steps = complete_steps(self.folder)
        if steps:
            try:
                return sum(read_marker(step_dir(self.folder, steps[-1]))["files"].values())
            except ConfigError:
                pass
        dtypes = {n: t.dtype for n, t in self.module.state_dict().items() if isinstance(t, torch.Tensor)}
        default = next(iter(dtypes.values()), torch.float32)
        states = optimizer_states_per_param(self.optimizer)
        return checkpoint_bytes(self._expected_shapes(), dtypes, default, states)

    def _room(self) -> tuple[int, int]:
        """(bytes one checkpoint needs, bytes free in the checkpoint folder)."""
        return self._needed_bytes(), free_bytes(self.folder)

    def _warn_if_short(self, step: int) -> None:
        if self.rank != 0:
            return
        needed, free = self._room()
        if free < needed:
            logger.warning(
                f"checkpoint step {step}: {self.folder} has {human_bytes(free)} free but a checkpoint needs "
                f"about {human_bytes(needed)}; the save will likely fail. Free space there, or lower "
                "checkpoint.keep_latest."
            )

    def _save_failed(self, step: int, tmp: str, exc: BaseException, *, in_lockstep: bool = True) -> None:
        """After a failed write on every rank: a full disk removes the partial folder and becomes
        CheckpointDiskFull (the same on every rank: the DiskFullError was gathered by DCP).
        ``in_lockstep``: every rank raises at this same point (sync saves), so teardown may use
        collectives; an async save's failure surfaces whenever each rank polls it."""
        full = find_disk_full(exc)
        if full is None:  # e.g. a peer died mid-save: the next start removes the leftover
            return
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        intact = complete_steps(self.folder)
        message = disk_full_message(
            step,
            self.folder,
            self._needed_bytes(),
            free_bytes(self.folder) if self.rank == 0 else full.free,
            step_dir(self.folder, intact[-1]) if intact else None,
            removed=self.rank == 0,
        )
        error = CheckpointDiskFull(f"{message} (the write failed with: {full.cause})")
        error.in_lockstep = in_lockstep
        raise error from None

    def _commit_everywhere(self, step: int, tmp: str, marker: dict[str, Any]) -> None:
        """Rank 0 commits; every rank learns whether that worked (a full disk can stop the marker)."""
        outcome: list[Any] = [None]
        if self.rank == 0:
            try:
                self._commit(step, tmp, marker)
            except Exception as e:  # shared with every rank, then raised
                outcome = [as_disk_full(e, tmp) or e]
        dist.broadcast_object_list(outcome, src=0, group=self._pg)
        if outcome[0] is not None:
            self._save_failed(step, tmp, outcome[0])
            raise outcome[0]

    # -- saving -------------------------------------------------------------------------
    def marker(self, step: int, model_only: bool) -> dict[str, Any]:
        """The completion marker of a save of ``step`` before its files are known (``completed_marker``)."""
        return marker_of(
            self.info,
            step=step,
            tokens_seen=self.train_state.tokens_seen,
            world_size=self.world_size,
            model_only=model_only,
        )

    def _commit(self, step: int, tmp: str, marker: dict[str, Any]) -> None:
        """Rank 0, after every rank's data and DCP's .metadata are on disk: marker, rename, purge."""
        crash_point("before_commit", step)
        crcs: dict[str, str] = {}
        for name in sorted(os.listdir(tmp)):
            if name.endswith(CRC_SUFFIX):
                with open(os.path.join(tmp, name), encoding="utf-8") as f:
                    crcs.update(json.load(f))
                os.remove(os.path.join(tmp, name))
        crcs[".metadata"] = file_crc32(os.path.join(tmp, ".metadata"))
        files = {n: os.path.getsize(os.path.join(tmp, n)) for n in sorted(os.listdir(tmp))}
        write_json_durable(os.path.join(tmp, MARKER), completed_marker(marker, files, crcs))
        final = step_dir(self.folder, step)
        trash = None
        if os.path.exists(final):  # resumed from an older step: replace the stale one
            trash = f"{final}.trash-{self._token}"
            os.rename(final, trash)
        os.rename(tmp, final)
        fsync_dir(self.folder)
        if trash:
            shutil.rmtree(trash, ignore_errors=True)
        crash_point("after_commit", step)
        self._purge(step)

    def _purge(self, newest: int) -> None:
        """Remove the complete checkpoints older than the ``keep_latest`` newest, except every
        ``keep_every``-th step's (``step % keep_every == 0``: read from the step numbers on disk, so it
        holds across restarts)."""
        keep = self.cfg.keep_latest
        if keep <= 0:
            return
        steps = complete_steps(self.folder)
        every = self.cfg.keep_every
        for old in [s for s in steps[:-keep] if s < newest and not (every > 0 and s % every == 0)]:
            path = step_dir(self.folder, old)
            trash = f"{path}.trash-{self._token}"
            os.rename(path, trash)  # atomic: never a half-deleted folder that looks complete
            crash_point("during_purge", newest)
            shutil.rmtree(trash, ignore_errors=True)

    def _begin(self, step: int) -> str:
        tmp = f"{step_dir(self.folder, step)}.tmp-{self._token}"
        make_dir(self.folder)
        make_dir(tmp)
        crash_point("before_write", step)
        return tmp

    def maybe_save(self, step: int, *, last: bool) -> None:
        """Called after every step: commit a finished async save; save at the interval and the end."""
        crash_point("after_step", step)
        if self.cfg.enable:
            self._poll()
            if step % self.cfg.interval == 0 or (last and self.cfg.save_final):
                self.save(step, final=last)
        if last and self.cfg.last_save_in_hf:  # the weights as a HF folder too (export.py)
            save_hf_step(
                self.module,
                self._hf_target(),
                self.cfg,
                self.info,
                step,
                folder=self.folder,
                token=self._token,
                group=self._pg,
            )

    def _hf_target(self) -> tuple[ModelSpec, ModelArgs]:
        if self.hf_target is None:
            raise ValueError(
                "checkpoint.initial_load_hf and last_save_in_hf need the Checkpointer's hf_target"
            )
        return self.hf_target

    def save(self, step: int, *, final: bool = False) -> None:
        """Checkpoint ``step`` (async unless ``final``); a second save first waits for the first."""
        if step == self._last_saved_step:
            return
        self.wait()
        self._last_saved_step = step
        tmp = self._begin(step)
        marker = self.marker(step, model_only=False)
        state = self.save_state()
        self._warn_if_short(step)
        start = time.perf_counter()
        if self.async_mode and not final:
            # Returns once the state is copied (staged) to host memory; the write runs in a thread.
            fut = dcp.async_save(state, storage_writer=CheckpointWriter(tmp, step), process_group=self._pg)
            assert isinstance(fut, Future)  # without an async stager: the write's future
            self._pending = (step, tmp, marker, fut)
            logger.info(
                f"checkpoint step {step}: staged in {time.perf_counter() - start:.2f}s, writing async"
            )
            return
        self._write_and_commit(step, tmp, state, marker)
        logger.info(f"checkpoint step {step} saved in {time.perf_counter() - start:.2f}s")

    def save_state(self) -> dict[str, object]:
        """What a save writes: the Stateful objects of ``states`` and this rank's RNG state."""
        state: dict[str, object] = dict(self.states)
        state["rng"] = {_rng_key(self.rank): _rng_state(self.device)}
        return state

    def _write_and_commit(self, step: int, tmp: str, state: dict[str, Any], marker: dict[str, Any]) -> None:
        """A synchronous save of ``state`` into ``tmp``, committed as ``step-N``; visible once this
        returns on any rank."""
        try:
            dcp.save(state, storage_writer=CheckpointWriter(tmp, step), process_group=self._pg)
        except BaseException as e:  # DCP raises CheckpointException (a BaseException) on every rank
            self._save_failed(step, tmp, e)
            raise
        self._commit_everywhere(step, tmp, marker)

    def _poll(self) -> None:
        if self._pending is not None and self._pending[3].done():
            self.wait()

    def wait(self) -> None:
        """Finish the pending async save (rank 0 commits it). Collective-free."""
        if self._pending is None:
            return
        step, tmp, marker, fut = self._pending
        self._pending = None
        try:
            fut.result()  # re-raises a failed background write (on every rank: DCP gathers failures)
        except BaseException as e:
            self._save_failed(step, tmp, e, in_lockstep=False)
            raise
        if self.rank == 0:  # collective-free: a failed commit stops rank 0, and torchrun the others
            try:
                self._commit(step, tmp, marker)
            except OSError as e:
                self._save_failed(step, tmp, as_disk_full(e, tmp) or e, in_lockstep=False)
                raise
        logger.info(f"checkpoint step {step} committed")

    def save_seed(self) -> str:
        """Write the model-only seed checkpoint ``step-0`` (one process; ``trainer.checkpoint.seed``);
        return its path."""
        check_seed_folder(self.folder)
        tmp = self._begin(0)
        self._write_and_commit(0, tmp, {"model": self.states["model"]}, self.marker(0, model_only=True))
        logger.info(f"seed checkpoint written to {step_dir(self.folder, 0)}")
        return step_dir(self.folder, 0)

    def close(self) -> None:
        """Wait for the pending save, then release the checkpoint process group."""
        try:
            self.wait()
            if self.async_mode and self.world_size > 1:
                dist.barrier(group=self._pg)  # every rank's background write is done before teardown
        finally:
            if self._pg is not None:
                dist.destroy_process_group(self._pg)
                self._pg = None
