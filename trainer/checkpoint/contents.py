"""What a checkpoint holds, apart from the act of saving it: the DCP Stateful adapters over the model
parts, the optimizer and the run's counters (``ModelState``, ``OptimizerState``, ``TrainProgress``;
``one_module`` names every parameter as the whole model does), the per-rank paths of the saved state
(``peer_path``, ``every_stage``: how a save's footprint and the planner derive the other ranks'
entries), each rank's RNG entry, and the fields of the completion marker (``marker_of``,
``completed_marker``, ``model_info``, ``describe_layout``). Split from ``checkpointer.py`` (the
``Checkpointer``: save, load, commit, purge), which re-exports the names the trainer, the planner and
the rehearsal import from it."""

from __future__ import annotations

import time
from dataclasses import asdict
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from parallelisms.parallel_dims import DEGREE_NAMES
from parallelisms.utils import plain_tensor
from trainer.checkpoint.storage import FORMAT_VERSION

if TYPE_CHECKING:
    from models.spec import ModelArgs
    from parallelisms.config import ParallelismConfig
    from parallelisms.parallel_dims import ParallelDims

# Optimizer implementation switches describe this run's hardware, not training state.
_IMPL_KEYS = ("foreach", "fused", "capturable", "differentiable")
_OPTIM_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


# -- small helpers -------------------------------------------------------------------


def one_module(parts: list[nn.Module]) -> nn.Module:
    """One module naming every parameter of ``parts`` (the model parts from
    ``parallelisms.parallelize.model_parts``) as the whole model does: the part itself when there
    is one; pipeline stages (which keep global names) merged into a view module that owns no
    parameters. For what needs one module: the optimizer state (one optimizer spans the parts),
    HF load and export."""
    if len(parts) == 1:
        return parts[0]
    view = nn.Module()  # registers the stages' children; it owns no parameters itself
    for part in parts:
        for name, child in part.named_children():
            if isinstance(child, nn.ModuleDict):  # e.g. ``layers``: merge the stages' blocks
                if name not in view._modules:
                    view.add_module(name, nn.ModuleDict())
                merged = view.get_submodule(name)
                for key, block in child.items():
                    merged.add_module(key, block)
            elif child is not None:
                view.add_module(name, child)
    return view


def describe_layout(dims: ParallelDims, parallelism: ParallelismConfig) -> dict[str, Any]:
    """What wrote the checkpoint (informational; loading never depends on it): the degrees, and the
    DDP options when DDP runs (``ParallelDims.ddp_enabled``, the one answer to whether it does)."""
    layout: dict[str, object] = {k: getattr(dims, k) for k in DEGREE_NAMES}
    if dims.ddp_enabled:
        layout["ddp"] = parallelism.ddp.impl
        layout["sharded_optimizer"] = parallelism.ddp.sharded_optimizer
    return layout


# -- Stateful adapters ---------------------------------------------------------------


class ModelState:
    """DCP Stateful over the model parts: layout-independent, prefix-free keys (the parts' state
    dicts merged; pipeline stages hold disjoint names)."""

    def __init__(self, parts: list[nn.Module]) -> None:
        self.parts = parts

    def state_dict(self) -> dict[str, Any]:
        merged: dict[str, Any] = {}
        for part in self.parts:
            merged.update(get_model_state_dict(part))
        return {k: plain_tensor(v) for k, v in merged.items()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if len(self.parts) == 1:
            set_model_state_dict(self.parts[0], state_dict)
            return
        for part in self.parts:  # each part takes its own names
            names = get_model_state_dict(part).keys()
            set_model_state_dict(part, {k: state_dict[k] for k in names})


class OptimizerState:
    """DCP Stateful over the optimizer, flattened to ``state.<fqn>.*`` / ``param_groups.<fqn>.*``.

    Works for AdamW over plain, FSDP or TP parameters and for the ZeRO-1 ShardedOptimizer,
    whose ``state`` holds only this rank's parameters: each rank contributes its own keys. One
    optimizer spans all model parts, so torch names its parameters within ``one_module(parts)``.
    """

    def __init__(self, parts: list[nn.Module], optimizer: torch.optim.Optimizer) -> None:
        self.module = one_module(parts)
        self.optimizer = optimizer

    def state_dict(self) -> dict[str, Any]:
        state = get_optimizer_state_dict(self.module, self.optimizer, options=_OPTIM_OPTIONS)
        return {k: plain_tensor(v) for k, v in state.items()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        current = self.optimizer.param_groups[0]
        for key in state_dict:
            name = key.rsplit(".", 1)[-1]
            if key.startswith("param_groups.") and name in _IMPL_KEYS and name in current:
                state_dict[key] = current[name]
        set_optimizer_state_dict(self.module, self.optimizer, state_dict, options=_OPTIM_OPTIONS)


class Progress(Protocol):
    """The counters of the run a checkpoint keeps (the trainer's ``TrainState``)."""

    step: int
    tokens_seen: int


class TrainProgress:
    """DCP Stateful over the trainer's ``TrainState`` (step and tokens seen; not the log history)."""

    def __init__(self, train_state: Progress) -> None:
        self.train_state = train_state

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.train_state.step, "tokens_seen": self.train_state.tokens_seen}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.train_state.step = int(state_dict["step"])
        self.train_state.tokens_seen = int(state_dict["tokens_seen"])


def _rng_key(rank: int) -> str:
    return f"rank{rank}"


def peer_path(path: tuple[object, ...], peer: int) -> tuple[object, ...]:
    """The object path in the saved state that rank ``peer`` writes in place of ``path``: the RNG entry
    is per rank (``rng.rank<R>.*``); every other entry has the same path on every rank. (A save's
    footprint, ``trainer.checkpoint.footprint``, derives the other ranks' entries with it.)"""
    if len(path) >= 2 and path[0] == "rng":
        return ("rng", _rng_key(peer), *path[2:])
    return path


def every_stage(path: tuple[object, ...]) -> bool:
    """Whether every pipeline stage saves the entry at ``path`` of the saved state: all but the model's
    and the optimizer's, which are a stage's own parameters (``trainer.checkpoint.footprint``)."""
    return not path or path[0] not in ("model", "optimizer")


def marker_of(
    info: dict[str, object], *, step: int, tokens_seen: int, world_size: int, model_only: bool
) -> dict[str, object]:
    """The completion marker of a save of ``step`` before its files are known: ``info`` (``model_info``)
    and the run's position."""
    return {
        "format_version": FORMAT_VERSION,
        "step": step,
        "tokens_seen": tokens_seen,
        "model_only": model_only,
        "world_size": world_size,
        "time": time.time(),
        **info,
    }


def completed_marker(
    marker: dict[str, object], files: dict[str, int], crcs: dict[str, str]
) -> dict[str, object]:
    """The marker rank 0 writes last: ``marker`` plus the size and CRC32 of every file of the checkpoint."""
    return {**marker, "crc32": crcs, "files": files}


def _rng_state(device: torch.device) -> dict[str, torch.Tensor]:
    state = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def model_info(model_cfg: ModelArgs, tokenizer: str, layout: dict[str, Any]) -> dict[str, Any]:
    """The marker fields that let export and generation rebuild the model without the config."""
    return {"model": asdict(model_cfg), "tokenizer": tokenizer, "layout": layout}
