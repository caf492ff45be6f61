"""Gradient averaging across torchft replica groups: the collective behind fault-tolerant data parallelism.

With ``parallelism.fault_tolerance.enable=true`` every ``dp_replicate`` index is a *replica group*
(its own torchrun, its own process group and mesh, any layout inside: FSDP, TP, PP, CP, EP). The
groups are joined only by torchft: a lighthouse forms a quorum of the live groups before every
step, and gradients are averaged over the groups of that quorum through the torchft ``Manager``'s
reconfigurable process group. A group can die (and restart) without stopping the others.

This file swaps *only the collective*; the wrappers stay ours:

* **Pure replication inside a group** (``dp_shard = cp = pp = 1``): :class:`BucketedDDP` with a
  :class:`ManagedReducer` (``parallelisms.ddp.apply_replica_ddp``). Its buckets and hooks are unchanged
  (gradients are copied into flat
  buckets, each bucket launched in order as soon as it is full, overlapping backward); each
  bucket's ``all_reduce`` goes through ``Manager.allreduce`` instead of ``dist.all_reduce``.
* **Sharded or pipelined groups** (FSDP2 / HSDP-like, PP, CP): after backward (FSDP's own
  reduce-scatter inside the group is done) :func:`allreduce_gradients` all-reduces every local
  gradient shard over the replica groups, in flat buckets. Rank ``r`` of one group holds the same
  shard as rank ``r`` of another (the groups have identical layouts), and torchft gives each
  group rank its own cross-group process group. torchft's gloo process group has no
  reduce-scatter, so this is the all-reduce half of HSDP; inside a group FSDP keeps its
  reduce-scatter on the group's own backend.

Both are SUM all-reduces of gradients pre-scaled by ``1 / participants`` (the quorum's size), so
they leave the mean over the groups that took part. A peer that dies *during* the all-reduce
does not raise here: torchft's work object catches the error and reports it to the manager, the
step's ``should_commit`` then returns False on every surviving group and the step is discarded
(torchft's own DDP wrapper asserts on that path, and its ``PureDistributedDataParallel`` never
waits for the all-reduce; neither is used). ``torchft`` is imported only by whoever builds a
``Manager``; nothing here imports it.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torch.distributed.tensor import DTensor

__all__ = ["ManagedReducer", "ReplicaReducer", "allreduce_gradients"]

_DEFAULT_BUCKET_BYTES = 25 * 1024 * 1024


class ReplicaReducer(Protocol):
    """A SUM all-reduce over the replicas of the current step (``BucketedDDP``'s swappable collective)."""

    def size(self) -> int:
        """Replicas taking part in the current step (the divisor of the mean)."""
        ...

    def all_reduce(self, tensor: torch.Tensor) -> Any:
        """Start a SUM all-reduce of ``tensor`` in place; returns a work object with ``wait()``."""
        ...


class ManagedReducer:
    """:class:`ReplicaReducer` over the replica groups of a torchft ``Manager``'s current quorum."""

    def __init__(self, manager: Any) -> None:
        self.manager = manager
        self.sent_bytes = 0  # payload bytes all-reduced with the other groups so far (this rank)

    def size(self) -> int:
        # The quorum is synchronous (computed before the forward pass), so this never blocks.
        return max(int(self.manager.num_participants()), 1)

    def all_reduce(self, tensor: torch.Tensor) -> Any:
        # Manager.allreduce zeroes a non-participating replica's tensor, and on a failed peer returns
        # a work whose wait() reports the error to the manager instead of raising.
        self.sent_bytes += tensor.numel() * tensor.element_size()
        return self.manager.allreduce(tensor, reduce_op=dist.ReduceOp.SUM)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def allreduce_gradients(
    params: Iterable[nn.Parameter], reducer: ReplicaReducer, *, bucket_bytes: int = _DEFAULT_BUCKET_BYTES
) -> None:
    """Average every local gradient (a DTensor's local shard) over the replica groups, in place.

    Gradients are pre-scaled by ``1 / reducer.size()``, flattened into buckets of at most
    ``bucket_bytes`` per (dtype, device), all buckets launched, then waited for and copied back.
    Parameters without a gradient are skipped (every replica runs the same model and step, so
    they agree on which). A failed peer leaves the gradients unspecified; the caller's
    ``should_commit`` then discards the step.
    """
    grads = [_local(p.grad) for p in params if p.grad is not None]
    if not grads:
        return
    scale = 1.0 / reducer.size()
    by_kind: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for g in grads:
        by_kind.setdefault((g.dtype, g.device), []).append(g)
    pending: list[tuple[Any, torch.Tensor, list[torch.Tensor]]] = []
    with torch.no_grad():
        for group in by_kind.values():
            chunk: list[torch.Tensor] = []
            size = 0
            for g in group:
                chunk.append(g)
                size += g.numel() * g.element_size()
                if size >= bucket_bytes:
                    pending.append(_launch(chunk, scale, reducer))
                    chunk, size = [], 0
            if chunk:
                pending.append(_launch(chunk, scale, reducer))
        for work, flat, chunk in pending:
            work.wait()
            for g, averaged in zip(chunk, _unflatten_dense_tensors(flat, chunk)):
                g.copy_(averaged)


def _launch(
    chunk: list[torch.Tensor], scale: float, reducer: ReplicaReducer
) -> tuple[Any, torch.Tensor, list[torch.Tensor]]:
    flat = _flatten_dense_tensors(chunk)
    flat.mul_(scale)
    return reducer.all_reduce(flat), flat, chunk
