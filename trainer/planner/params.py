"""What each rank holds and which tensor-parallel collectives each module issues, read off the model
itself: the planner's parameter table (``trainer/plan.py``).

The model is built on the meta device with the weight-init functions switched off (shapes only:
no storage, ~0.1-1 s even for 405B), and every parameter is classified by the family's own
``ModelSpec``: its block (``spec.block_items``), whether tensor parallel shards it (the style of the TP
plan's kind of the module that owns it, ``parallelisms.tensor_parallel.tp_shard_dim``: ``embedding``,
``colwise``, ``rowwise``, ``head`` and ``shard_params`` shard; ``norm``, ``replicate``, ``head_norm``
and modules without a kind replicate), and whether it is an expert
(``spec.expert_modules``, sharded by expert parallel). A new family gets a correct plan
from its spec alone.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from torch import nn

from models.spec import ModelSpec
from parallelisms.tensor_parallel import tp_kinds, tp_shard_dim

__all__ = ["ModuleParams", "ParamTable", "param_table"]

_INIT_FUNCTIONS = (
    "normal_",
    "trunc_normal_",
    "uniform_",
    "kaiming_uniform_",
    "kaiming_normal_",
    "xavier_uniform_",
    "xavier_normal_",
    "zeros_",
    "ones_",
    "constant_",
)


@dataclass
class ModuleParams:
    """Parameter counts of a group of modules, by how they are split across ranks."""

    tp_sharded: int = 0  # divided by tp
    replicated: int = 0  # whole on every tp rank (norms, routers, ...)
    experts: int = 0  # divided by ep
    norms: list[int] = field(default_factory=list)  # numel of each SP ``norm`` weight (grads all-reduced)
    head_norms: list[int] = field(default_factory=list)  # numel of each ``head_norm`` (q/k norm) weight
    dense_tensors: int = 0  # parameter tensors that are not experts (one gradient norm each in the clip)
    # optimizer=muon: the >=2-D block weights Muon steps (a subset of the counts above, same split)
    muon_sharded: int = 0
    muon_replicated: int = 0
    muon_experts: int = 0
    muon_shapes: list[tuple[int, int, int]] = field(default_factory=list)  # (stack, rows, cols) per weight
    # the >=2-D weights tensor parallel replicates (routers, shared experts, MLA's latent
    # down-projections, in the MTP modules too): matmuls every tp rank runs whole, on all its tokens
    replicated_matrices: int = 0

    def muon_local(self, tp: int = 1, ep: int = 1) -> float:
        """Muon-stepped parameters one rank holds of this group under tp and ep."""
        return self.muon_sharded / tp + self.muon_replicated + self.muon_experts / ep

    def local(self, tp: int = 1, ep: int = 1) -> float:
        """Parameters one rank holds of this group under tp and ep."""
        return self.tp_sharded / tp + self.replicated + self.experts / ep

    def dense_local(self, tp: int = 1) -> float:
        return self.tp_sharded / tp + self.replicated

    def add(self, other: ModuleParams) -> ModuleParams:
        return ModuleParams(
            self.tp_sharded + other.tp_sharded,
            self.replicated + other.replicated,
            self.experts + other.experts,
            self.norms + other.norms,
            self.head_norms + other.head_norms,
            self.dense_tensors + other.dense_tensors,
            self.muon_sharded + other.muon_sharded,
            self.muon_replicated + other.muon_replicated,
            self.muon_experts + other.muon_experts,
            self.muon_shapes + other.muon_shapes,
            self.replicated_matrices + other.replicated_matrices,
        )


@dataclass
class ParamTable:
    """The model's parameters per block and for the first/last modules, plus the TP kinds present."""

    blocks: list[ModuleParams]
    block_kinds: list[list[str]]  # per block: the TP-plan kinds of its modules (one entry per module)
    first: ModuleParams  # spec.first_modules (the embedding; with tied weights also the head)
    last: ModuleParams  # spec.last_modules (final norm, head)
    first_kinds: list[str]
    last_kinds: list[str]
    tied: bool  # the head shares the embedding's weight (no separate FSDP unit for the last modules)
    moe_layers: list[int]  # blocks that hold experts
    # the model on meta (shapes, no storage): the optimizers' own group and owner functions run on it
    model: Optional[nn.Module] = field(default=None, repr=False, compare=False)

    @property
    def total(self) -> int:
        groups = [*self.blocks, self.first, self.last]
        return sum(g.tp_sharded + g.replicated + g.experts for g in groups)


@contextlib.contextmanager
def _no_weight_init() -> Iterator[None]:
    """Skip ``torch.nn.init`` during construction: on the meta device there is nothing to fill, and
    the first random fill on meta costs seconds of one-off decomposition setup."""
    saved = {name: getattr(torch.nn.init, name) for name in _INIT_FUNCTIONS if hasattr(torch.nn.init, name)}
    try:
        for name in saved:
            setattr(torch.nn.init, name, lambda tensor, *a, **k: tensor)
        yield
    finally:
        for name, fn in saved.items():
            setattr(torch.nn.init, name, fn)


def param_table(spec: ModelSpec, args: Any) -> ParamTable:
    """Classify every parameter of ``spec.build(args)`` (on the meta device)."""
    with torch.device("meta"), _no_weight_init():
        model = spec.build(args)
    kinds = tp_kinds(model, spec)
    blocks = spec.block_items(model)
    prefix_of = {f"{spec.blocks}.{key}.": i for i, (key, _) in enumerate(blocks)}
    expert_ids = {
        id(p) for m in (spec.expert_modules(model) if spec.expert_modules else []) for p in m.parameters()
    }
    groups = [ModuleParams() for _ in blocks]
    first, last = ModuleParams(), ModuleParams()
    present = lambda names: [m for m in (getattr(model, n, None) for n in names) if m is not None]  # noqa: E731
    first_ids = {id(p) for m in present(spec.first_modules) for p in m.parameters()}
    tied = any(id(p) in first_ids for m in present(spec.last_modules) for p in m.parameters())
    for name, p in model.named_parameters():  # tied weights once, under the first module
        module_name, _, leaf = name.rpartition(".")
        block = next((i for pre, i in prefix_of.items() if name.startswith(pre)), None)
        group = groups[block] if block is not None else (first if id(p) in first_ids else last)
        kind = kinds.get(module_name)
        muon = block is not None and p.ndim >= 2  # optimizer=muon's split (trainer/optim/muon.py)
        if muon:
            group.muon_shapes.append((p.shape[0] if p.ndim == 3 else 1, p.shape[-2], p.shape[-1]))
        group.dense_tensors += id(p) not in expert_ids
        if id(p) in expert_ids:
            group.experts += p.numel()
            group.muon_experts += p.numel() if muon else 0
        elif tp_shard_dim(kind, model.get_submodule(module_name), leaf) is not None:
            group.tp_sharded += p.numel()
            group.muon_sharded += p.numel() if muon else 0
        else:
            group.muon_replicated += p.numel() if muon else 0
            group.replicated += p.numel()
            group.replicated_matrices += p.numel() if p.ndim >= 2 else 0
            if kind == "norm":
                group.norms.append(p.numel())
            elif kind == "head_norm":
                group.head_norms.append(p.numel())

    def kinds_under(prefixes: tuple[str, ...]) -> list[str]:
        return [k for n, k in sorted(kinds.items()) if n.startswith(prefixes) or n in prefixes]

    return ParamTable(
        blocks=groups,
        block_kinds=[kinds_under((f"{spec.blocks}.{key}.",)) for key, _ in blocks],
        first=first,
        last=last,
        first_kinds=kinds_under(tuple(spec.first_modules)),
        last_kinds=kinds_under(tuple(spec.last_modules)),
        tied=tied,
        moe_layers=[i for i, g in enumerate(groups) if g.experts],
        model=model,
    )
