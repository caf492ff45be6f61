"""Per-layer statistics (``metrics.layer_stats_freq``): for every block, the embedding and the head, the
pre-clip gradient norm, the parameter norm and the update/parameter ratio of the step, into
``metrics.jsonl`` (``layer_stats/<group>/<figure>``) and the trackers.

Groups: ``<blocks>.<i>`` (each repeated block, e.g. ``layers.3``), ``embedding`` (the family's
``first_modules``), ``head`` (its ``last_modules``: the final norm and the output projection) and, for
any other top-level module (DeepSeek-V3's ``mtp``), its own name. Every parameter is in exactly one
group, so the root of the sum of the squared group gradient norms is the global gradient norm.

Computed on sharded parameters without gathering them: each rank sums the squares of its local shard
(``DTensor.to_local()``), per group, into one vector per kind of placement (the DTensor's mesh and the
mesh dimensions it is sharded over); each vector is summed over exactly those mesh dimensions (one
all-reduce per dimension: FSDP's and TP's shards add up, replicas are counted once); under a pipeline the
stages' vectors are then summed over ``pp`` (a stage holds no other stage's groups). The figures:

- ``grad_norm``: at ``after_backward`` (the gradients complete, before clipping), as the global norm;
- ``param_norm``: the weights before the step's update;
- ``update_ratio``: ``||w_after - w_before|| / ||w_before||`` over the group, the optimizer's (and
  QK-clip's) change of the step (the step's local shards are copied before it: one model's worth of
  memory per rank on the measured steps only).

Measured steps are those with ``step % layer_stats_freq == 0`` (a multiple of ``metrics.log_freq``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from models.common import unwrapped_name

if TYPE_CHECKING:
    from models.spec import ModelSpec
    from parallelisms.parallel_dims import ParallelDims
    from trainer.step import StepState

__all__ = ["LayerStats", "group_of"]

FIGURES = ("grad_norm", "param_norm", "update_ratio")


def group_of(name: str, spec: ModelSpec) -> str:
    """The statistics group of parameter ``name`` (the model's own name, wrappers stripped)."""
    parts = name.split(".")
    if parts[0] == spec.blocks and len(parts) > 1:
        return f"{spec.blocks}.{parts[1]}"
    if parts[0] in spec.first_modules:
        return "embedding"
    if parts[0] in spec.last_modules:
        return "head"
    return parts[0]


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


Kind = tuple[str, tuple[dist.ProcessGroup, ...]]


def _resolved(t: torch.Tensor) -> torch.Tensor:
    """``t`` with pending sums done: a Partial placement (a replicated weight's gradient under sequence
    parallel, e.g. the norms') is all-reduced to Replicate -- the squares of partial sums do not add up
    to the square of their sum. Shards stay shards."""
    if isinstance(t, DTensor) and any(isinstance(pl, Partial) for pl in t.placements):
        return t.redistribute(
            t.device_mesh, [Replicate() if isinstance(pl, Partial) else pl for pl in t.placements]
        )
    return t


def _kind(p: torch.Tensor) -> Kind:
    """The mesh dimensions a tensor's local squares are summed over (those it is sharded over), named
    (the same on every rank) and as process groups; none for a plain (replicated) tensor."""
    if not isinstance(p, DTensor):
        return "", ()
    mesh, names = p.device_mesh, p.device_mesh.mesh_dim_names or ()
    dims = [i for i, pl in enumerate(p.placements) if isinstance(pl, Shard) and mesh.size(i) > 1]
    label = ",".join(names[i] if i < len(names) else str(i) for i in dims)
    return label, tuple(mesh.get_group(mesh_dim=i) for i in dims)


class LayerStats:
    """The per-layer statistics as a step hook (``trainer/hooks.py``)."""

    def __init__(
        self,
        model_parts: list[nn.Module],
        spec: ModelSpec,
        dims: ParallelDims,
        freq: int,
    ) -> None:
        self.freq = freq
        named: dict[nn.Parameter, str] = {}
        for part in model_parts:
            for name, p in part.named_parameters():
                named.setdefault(p, unwrapped_name(name))
        self.params = list(named)
        local_groups = sorted({group_of(n, spec) for n in named.values()})
        self.pp_group = dims.get_mesh("pp").get_group() if dims.pp > 1 else None
        if self.pp_group is not None:  # every stage lists every group, in one order
            gathered: list[Optional[list[str]]] = [None] * dist.get_world_size(self.pp_group)
            dist.all_gather_object(gathered, local_groups, group=self.pp_group)
            local_groups = sorted({g for names in gathered for g in names or []})
        self.groups = local_groups
        index = {g: i for i, g in enumerate(self.groups)}
        self.group_index = [index[group_of(named[p], spec)] for p in self.params]
        self._grad_sq: Optional[torch.Tensor] = None
        self._param_sq: Optional[torch.Tensor] = None
        self._update_sq: Optional[torch.Tensor] = None
        self._before: list[torch.Tensor] = []

    def due(self, step: int) -> bool:
        return step % self.freq == 0

    def _squares(self, tensors: list[Optional[torch.Tensor]]) -> torch.Tensor:
        """Per group, the sum of squares of ``tensors`` (one per parameter, local shards) over the
        whole model (collective: all-reduces over the sharded mesh dimensions, then ``pp``)."""
        device = _local(self.params[0]).device if self.params else torch.device("cpu")
        by_kind: dict[str, torch.Tensor] = {}
        groups_of: dict[str, tuple[dist.ProcessGroup, ...]] = {}
        for t, g in zip(tensors, self.group_index):
            if t is None:
                continue
            t = _resolved(t)
            label, groups = _kind(t)  # a gradient's own placements (e.g. Partial where its weight is not)
            acc = by_kind.setdefault(label, torch.zeros(len(self.groups), dtype=torch.float64, device=device))
            groups_of[label] = groups
            acc[g] += _local(t).detach().double().square().sum()
        total = torch.zeros(len(self.groups), dtype=torch.float64, device=device)
        # the same kinds in the same order on every rank of each group (a stage's ranks share its params)
        for label in sorted(by_kind):
            acc = by_kind[label]
            for group in groups_of[label]:
                dist.all_reduce(acc, group=group)
            total += acc
        if self.pp_group is not None:
            dist.all_reduce(total, group=self.pp_group)
        return total

    def after_backward(self, state: StepState) -> None:
        if self.due(state.step):
            self._grad_sq = self._squares([p.grad for p in self.params])

    def before_optimizer_step(self, state: StepState) -> None:
        if self.due(state.step):
            self._param_sq = self._squares(list(self.params))
            self._before = [p.detach().clone() for p in self.params]

    def after_optimizer_step(self, state: StepState) -> None:
        if self.due(state.step) and self._before:
            deltas: list[Optional[torch.Tensor]] = [
                p.detach() - before for p, before in zip(self.params, self._before)
            ]
            self._before = []
            self._update_sq = self._squares(deltas)

    def metrics(self, state: StepState, device: torch.device) -> dict[str, dict[str, dict[str, float]]]:
        """``layer_stats``: ``{group: {grad_norm, param_norm, update_ratio}}`` on measured steps."""
        if not self.due(state.step) or self._grad_sq is None or self._param_sq is None:
            return {}
        assert self._update_sq is not None
        figures = torch.stack([self._grad_sq.sqrt(), self._param_sq.sqrt(), self._update_sq.sqrt()])
        figures[2] /= figures[1].clamp(min=1e-30)
        values = figures.T.tolist()  # one host read
        self._grad_sq = self._param_sq = self._update_sq = None
        return {"layer_stats": {g: dict(zip(FIGURES, v)) for g, v in zip(self.groups, values)}}
