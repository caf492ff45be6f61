"""The communication ledger (``metrics.comm_ledger=true``): bytes and calls of every collective a
training step issues, per rank, by collective and mesh axis.

A :class:`~torch.utils._python_dispatch.TorchDispatchMode` (the mechanism of torch's own
``CommDebugMode``, which counts calls but not bytes) is active around each ``train_step``. Every
collective reaches the dispatcher as an op, whoever issues it: ``torch.distributed`` calls (our
DDP and ZeRO-1, context parallel, expert parallel, pipelining's send/recv, FSDP2's
all-gather/reduce-scatter) are ``c10d::*`` ops; DTensor's redistributions (tensor parallel, loss
parallel, clipping over DTensors) and functional collectives are ``_c10d_functional::*`` ops.
DTensor ops themselves are passed through (``NotImplemented``) so that the mode sees the
collectives they lower to. Collectives outside a step (checkpointing, logging, the preemption
flag) are not counted: they are not the step's traffic and the planner does not plan them.

Bytes are *logical* sizes, the planner's ``size`` of a call: the full tensor of an all-reduce or
broadcast, the gathered output of an all-gather, the unreduced input of a reduce-scatter, what
this rank hands to an all-to-all or sends/receives point-to-point. What a ring moves on the wire
follows from it (:func:`trainer.planner.cluster.ring_wire_bytes`).

When the ledger is off nothing is installed: no mode, no hook, no extra collective. When it is on,
the per-step counts of every rank are gathered to rank 0 at each logged step (one
``all_gather_object`` outside the step) and written to ``metrics.jsonl`` and the trackers under
``comm`` (``comm/ranks/<r>/<op>/<axis>/bytes``, ``.../calls``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional, cast

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

if TYPE_CHECKING:
    from torch._ops import OpOverload
    from torch.distributed.distributed_c10d import GroupName

__all__ = ["CommLedger", "axis_names_of_groups", "ledger_totals", "storage_bytes"]


def _nbytes(tensors: Any) -> int:
    """Bytes of a tensor or a (nested) list of tensors."""
    if isinstance(tensors, torch.Tensor):
        return tensors.numel() * tensors.element_size()
    return sum(_nbytes(t) for t in tensors)


@dataclass(frozen=True)
class _Rule:
    op: str  # all_reduce | all_gather | reduce_scatter | all_to_all | broadcast | send | recv | ...
    size: Callable[[tuple], int]  # logical bytes of one call, from the op's arguments
    group: int  # index of the ProcessGroup (c10d) or group name (functional) argument


def _rules() -> dict[Any, _Rule]:
    c10d, fc = torch.ops.c10d, torch.ops._c10d_functional
    first = lambda a: _nbytes(a[0])  # noqa: E731 -- the op's first argument
    second = lambda a: _nbytes(a[1])  # noqa: E731
    gathered = lambda a: _nbytes(a[0]) * a[1]  # noqa: E731 -- functional all-gather: input x group size
    table = {
        # torch.distributed (c10d) ops
        "allreduce_": ("all_reduce", first, 1),
        "allreduce_coalesced_": ("all_reduce", first, 1),
        "_allgather_base_": ("all_gather", first, 2),
        "allgather_": ("all_gather", first, 2),
        "allgather_coalesced_": ("all_gather", first, 2),
        "allgather_into_tensor_coalesced_": ("all_gather", first, 2),
        "_reduce_scatter_base_": ("reduce_scatter", second, 2),
        "reduce_scatter_": ("reduce_scatter", second, 2),
        "reduce_scatter_tensor_coalesced_": ("reduce_scatter", second, 2),
        "alltoall_base_": ("all_to_all", second, 2),
        "alltoall_": ("all_to_all", second, 2),
        "broadcast_": ("broadcast", first, 1),
        "send": ("send", first, 1),
        "recv_": ("recv", first, 1),
        "recv_any_source_": ("recv", first, 1),
        "reduce_": ("reduce", first, 1),
        "gather_": ("gather", second, 2),
        "scatter_": ("scatter", first, 2),
        "barrier": ("barrier", lambda a: 0, 1),
    }
    functional = {
        "all_reduce": ("all_reduce", first, 2),
        "all_reduce_coalesced": ("all_reduce", first, 2),
        "all_gather_into_tensor": ("all_gather", gathered, 2),
        "all_gather_into_tensor_out": ("all_gather", gathered, 2),
        "all_gather_into_tensor_coalesced": ("all_gather", gathered, 2),
        "reduce_scatter_tensor": ("reduce_scatter", first, 3),
        "reduce_scatter_tensor_coalesced": ("reduce_scatter", first, 3),
        "all_to_all_single": ("all_to_all", first, 3),
        "broadcast": ("broadcast", first, 2),
    }
    rules: dict[Any, _Rule] = {}
    for namespace, entries in ((c10d, table), (fc, functional)):
        for name, (op, size, group) in entries.items():
            packet = getattr(namespace, name, None)
            if packet is not None:  # an op this torch does not have is never issued
                rules[packet.default] = _Rule(op, size, group)
    return rules


def storage_bytes(tensors: Iterable[Optional[torch.Tensor]]) -> int:
    """Bytes of the distinct tensors in ``tensors`` (a DTensor counts its local shard; a tensor seen
    twice -- tied weights -- counts once). Views count their own elements, so DDP's gradients (views
    of its buckets) and ZeRO-1's parameters (views of one flat storage) add up to the bucket and
    the storage; a view into a larger temporary (e.g. one tensor-parallel gradient without
    sequence parallel is a slice of a 2x buffer) counts its elements only."""
    from torch.distributed.tensor import DTensor
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    def plain(t: torch.Tensor) -> Iterable[torch.Tensor]:
        """The tensors holding ``t``'s storage: a DTensor's local shard, a wrapper subclass's inner
        tensors (float8 training weights wrap their fp32 master; a wrapper has no storage of its own)."""
        if isinstance(t, DTensor):
            t = t._local_tensor
        if is_traceable_wrapper_subclass(t):
            names, _ = t.__tensor_flatten__()
            for name in names:
                yield from plain(getattr(t, name))
        else:
            yield t

    seen: dict[tuple[int, int], int] = {}
    for tensor in tensors:
        if tensor is None:
            continue
        for t in plain(tensor):
            nbytes = t.numel() * t.element_size()
            seen[(t.data_ptr(), nbytes)] = nbytes
    return sum(seen.values())


def _optimizer_tensors(optimizer: Any) -> Iterable[torch.Tensor]:
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                yield value


def axis_names_of_groups(mesh: Any, names: Iterable[str]) -> dict[str, str]:
    """``{process group name: axis}`` for the dims and flattened views ``names`` of ``mesh``
    (a view whose group is the same as an earlier name's keeps the earlier, more basic name)."""
    out: dict[str, str] = {}
    for name in names:
        try:
            group = mesh[name].get_group()
        except (KeyError, RuntimeError, ValueError):
            continue
        out.setdefault(group.group_name, name)
    return out


# The axis of a collective over a process group torch has no name for: in this trainer, torchft's
# reconfigurable group across the replica groups (parallelism.fault_tolerance: per-step gradients, or
# DiLoCo's pseudo-gradients at its syncs).
UNREGISTERED_AXIS = "replica_groups"


class CommLedger(TorchDispatchMode):
    """Counts the collectives issued while it is entered (``with ledger: trainer.train_step()``).

    ``axes`` maps process-group names to the mesh axis they belong to; other groups are named
    ``world`` (the default group) or ``group<size>``.
    """

    def __init__(self, axes: Optional[dict[str, str]] = None) -> None:
        super().__init__()
        self.axes = dict(axes or {})
        self.rules = _rules()
        self.counts: dict[tuple[str, str], list[float]] = {}  # (op, axis) -> [calls, bytes, group size]
        self.steps = 0
        self._labels: dict[str, tuple[str, int]] = {}  # group name -> (axis, size)
        self.grads_bytes = 0
        self.active = False  # inside a measured step
        from torch.distributed.tensor import DTensor

        self._dtensor = DTensor

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # torch wraps a mode's __torch_dispatch__ in a dynamo-disable frame by default: ~30 us per
        # op, a quarter of a small FSDP step. Nothing compiles under the ledger (torch.compile does
        # not compile while a Python dispatch mode is active; the config rejects the combination).
        return False

    def __torch_dispatch__(
        self, func: OpOverload, types: Sequence[type], args: tuple = (), kwargs: Optional[dict] = None
    ) -> object:
        if types and any(issubclass(t, self._dtensor) for t in types):
            return NotImplemented  # let DTensor lower the op; its collectives come back here
        out = func(*args, **(kwargs or {}))
        rule = self.rules.get(func)
        if rule is not None:
            axis, size = self._label(args[rule.group])
            entry = self.counts.setdefault((rule.op, axis), [0, 0, size])
            entry[0] += 1
            entry[1] += rule.size(args)
        return out

    def _label(self, group: Any) -> tuple[str, int]:
        if isinstance(group, str):
            name = group
        else:  # a c10d op's ScriptObject ProcessGroup
            pg = dist.ProcessGroup.unbox(group)
            name = pg.group_name
            if not name:  # not registered with torch: torchft's process group across the replica groups
                return UNREGISTERED_AXIS, pg.size()
        label = self._labels.get(name)
        if label is None:
            from torch.distributed.distributed_c10d import _resolve_process_group

            pg = _resolve_process_group(cast("GroupName", name))  # torch's NewType of the name
            default = dist.group.WORLD
            axis = self.axes.get(name) or (
                "world" if default is not None and name == default.group_name else f"group{pg.size()}"
            )
            label = self._labels[name] = (axis, pg.size())
        return label

    def __enter__(self) -> CommLedger:
        self.steps += 1
        self.active = True
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        self.active = False
        super().__exit__(*exc)

    def measure_gradients(self, params: Iterable[torch.Tensor]) -> None:
        """Remember the bytes of the gradients this rank holds (call once they are complete, before
        the optimizer step); reported with the parameters and optimizer state by :meth:`collect`."""
        self.grads_bytes = storage_bytes(p.grad for p in params)

    def pop(self) -> dict[str, Any]:
        """This rank's counts per step since the last pop: ``{op: {axis: {calls, bytes, group_size}}}``
        averaged over the steps counted (steps of a run issue the same collectives), plus
        ``total_bytes``; then starts afresh."""
        steps = max(self.steps, 1)
        out: dict[str, Any] = {}
        for (op, axis), (calls, nbytes, size) in sorted(self.counts.items()):
            out.setdefault(op, {})[axis] = {
                "calls": calls / steps,
                "bytes": nbytes / steps,
                "group_size": size,
            }
        out["total_bytes"] = sum(v[1] for v in self.counts.values()) / steps
        self.counts, self.steps = {}, 0
        return out

    def collect(self, params: Iterable[torch.Tensor], optimizer: Any) -> dict[str, Any]:
        """Every rank's :meth:`pop` and its model-state bytes (``model_state``: parameters, gradients
        as measured in the step, optimizer state), gathered to every rank (a collective over the
        default group: call on every rank, outside the ledger):
        ``{"steps": k, "ranks": {"0": {...}, "1": {...}}}``."""
        steps = self.steps
        local = self.pop()
        local["model_state"] = {
            "params": storage_bytes(params),
            "grads": self.grads_bytes,
            "optimizer": storage_bytes(_optimizer_tensors(optimizer)),
        }
        if dist.is_initialized() and dist.get_world_size() > 1:
            gathered: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, local)
        else:
            gathered = [local]
        return {"steps": steps, "ranks": {str(r): g for r, g in enumerate(gathered)}}


def ledger_totals(rank_counts: dict[str, Any]) -> dict[str, dict[str, float]]:
    """``{op: {"calls": c, "bytes": b}}`` of one rank's ledger entry, summed over axes."""
    out: dict[str, dict[str, float]] = {}
    for op, axes in rank_counts.items():
        if op in ("total_bytes", "model_state"):
            continue
        for v in axes.values():
            slot = out.setdefault(op, {"calls": 0.0, "bytes": 0.0})
            slot["calls"] += v["calls"]
            slot["bytes"] += v["bytes"]
    return out
