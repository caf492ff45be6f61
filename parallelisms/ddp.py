"""Data parallelism by replication: a hand-written bucketed DDP and the ``apply_ddp`` entry point.

``BucketedDDP`` spells out what ``torch.nn.parallel.DistributedDataParallel`` hides:

* **Construction** broadcasts every parameter (and buffer) from the process group's first
  rank, coalesced into a few flat tensors per dtype, so differently initialised replicas
  start equal.
* **Backward** fires a ``post_accumulate_grad`` hook per parameter. Parameters were laid out
  in buckets ahead of time, in *reverse* registration order (roughly the order gradients
  become ready), each bucket backed by one flat buffer. The hook copies the finished gradient
  into its slot of the buffer and makes ``p.grad`` a view of that slot; when every gradient of
  a bucket is in, the bucket's ``all_reduce`` is launched asynchronously, overlapping with the
  rest of backward. Buckets are launched strictly in bucket order, so all ranks issue the same
  collectives in the same order and each bucket's content is fixed (bitwise reproducible).
* **``no_sync()``** (gradient accumulation) sends nothing: the hook moves each parameter's first
  gradient of the step into its bucket slot and points ``p.grad`` there, so the later microbatches
  accumulate in place and the step holds one copy of the gradients (the buckets outlive the step).
* **``finish_gradient_sync()``** launches whatever is left (buckets with parameters that got no
  gradient), waits for every handle and leaves the averaged gradient in ``p.grad``. The trainer
  calls it after the last backward of a step, before clipping and ``optimizer.step()``:
  "backward returned" and "gradients are globally averaged" are different moments.

Assumption shared with torch DDP's default ``find_unused_parameters=False``: every rank uses
the same set of parameters in a step. A parameter without a gradient is zero-filled in its
bucket so the collectives still match, and keeps ``grad=None`` afterwards (as in a single
process); if ranks disagree about which parameters were used, replicas silently diverge. Since
buckets launch in order, a bucket holding an unused parameter, and every bucket after it, is
only launched by ``finish_gradient_sync()`` (correct, just without overlap).
"""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from models.errors import ConfigError
from parallelisms.validate import validate_ddp

if TYPE_CHECKING:
    from parallelisms.fault_tolerance import ReplicaReducer

# Parameters and buffers are broadcast at construction in flat chunks of at most this many
# bytes: few collectives, bounded temporary memory (same default as torch DDP).
_BROADCAST_CHUNK_BYTES = 250 * 1024 * 1024

_WRAPPED_PREFIX = "module."


def _local(t: torch.Tensor) -> torch.Tensor:
    """The tensor this rank holds: a DTensor's local shard (tensor-parallel parameters), else ``t``.

    DDP replicates over an axis orthogonal to the DTensor's mesh (e.g. tp), so each rank
    broadcasts and averages only its own shard with the ranks holding the same shard.
    """
    return t.to_local() if isinstance(t, DTensor) else t


def broadcast_tensors_coalesced(
    tensors: list[torch.Tensor],
    process_group: dist.ProcessGroup,
    *,
    chunk_bytes: int = _BROADCAST_CHUNK_BYTES,
) -> None:
    """Overwrite ``tensors`` on every rank with the values of the group's first rank.

    Tensors are grouped by (dtype, device) and flattened into chunks of ``chunk_bytes``, so a
    model costs a handful of collectives instead of one per tensor. The source is group rank 0,
    translated to its global rank: the group may be a sub-mesh that does not contain rank 0.
    """
    if dist.get_world_size(process_group) == 1 or not tensors:
        return
    src = dist.get_global_rank(process_group, 0)
    is_src = dist.get_rank(process_group) == 0
    by_kind: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for t in tensors:
        by_kind.setdefault((t.dtype, t.device), []).append(t)
    with torch.no_grad():
        for group in by_kind.values():
            for chunk in _chunk_by_bytes(group, chunk_bytes):
                flat = _flatten_dense_tensors([t.detach() for t in chunk])
                dist.broadcast(flat, src=src, group=process_group)
                if not is_src:  # the source already holds these values
                    for t, synced in zip(chunk, _unflatten_dense_tensors(flat, chunk)):
                        t.detach().copy_(synced)


def _chunk_by_bytes(tensors: list[torch.Tensor], chunk_bytes: int) -> Iterator[list[torch.Tensor]]:
    chunk: list[torch.Tensor] = []
    size = 0
    for t in tensors:
        chunk.append(t)
        size += t.numel() * t.element_size()
        if size >= chunk_bytes:
            yield chunk
            chunk, size = [], 0
    if chunk:
        yield chunk


@dataclass
class _Bucket:
    """Parameters whose gradients are averaged by one collective, and the flat buffer behind them."""

    params: list[nn.Parameter]
    offsets: list[int]  # start of each parameter's slot in ``buffer``
    numel: int
    buffer: Optional[torch.Tensor] = None  # allocated lazily, on the parameters' device and dtype
    slots: list[torch.Tensor] = field(default_factory=list)  # per-parameter views of ``buffer``
    ready: list[bool] = field(default_factory=list)  # gradient of params[i] copied in this step
    cast_for_wire: bool = False  # all-reduced in grad_dtype rather than the buffer's dtype
    num_ready: int = 0
    launched: bool = False


class BucketedDDP(nn.Module):
    """Replicate ``module`` over ``process_group`` and average gradients in async bucketed all-reduces.

    Args:
        module: the model; it should be on its final device and dtype.
        process_group: the data-parallel replicate group (may be a sub-group of the world).
        bucket_mb: a bucket is closed once its gradients reach this many MiB.
        grad_dtype: if set (e.g. ``torch.bfloat16``), buckets are cast to it for the
            all-reduce and back afterwards: half the bytes on the wire for a small precision cost.
        broadcast_buffers: include buffers in the construction-time broadcast. Buffers are not
            re-broadcast before every forward (an LLM's buffers, e.g. RoPE tables, are constants);
            ``apply_ddp`` builds torch DDP with the same behaviour.
        reducer: swap the collective (``process_group`` is then None): each bucket is SUM
            all-reduced by ``reducer`` over ``reducer.size()`` replicas of the current step
            (torchft replica groups, parallelisms/fault_tolerance.py); nothing is broadcast at
            construction and a failed all-reduce does not raise (the reducer reports it).

    The wrapper's ``state_dict``/``load_state_dict``/``named_parameters`` carry no ``module.``
    prefix, so checkpoints move freely between wrapped and unwrapped models, and attribute
    lookups that miss on the wrapper fall through to the wrapped module.
    """

    def __init__(
        self,
        module: nn.Module,
        process_group: Optional[dist.ProcessGroup],
        *,
        bucket_mb: float = 25.0,
        grad_dtype: Optional[torch.dtype] = None,
        broadcast_buffers: bool = True,
        reducer: Optional[ReplicaReducer] = None,
    ) -> None:
        super().__init__()
        validate_ddp("custom", bucket_mb)
        if grad_dtype is not None and not grad_dtype.is_floating_point:
            raise ConfigError(f"grad_dtype must be a floating dtype such as torch.bfloat16, got {grad_dtype}")
        if (reducer is None) == (process_group is None):
            raise ValueError("BucketedDDP needs exactly one of process_group and reducer")
        self.module = module
        self.process_group = process_group
        self._reducer = reducer
        self._group_size = dist.get_world_size(process_group) if process_group is not None else 1
        self.bucket_bytes = int(bucket_mb * 1024 * 1024)
        self.grad_dtype = grad_dtype
        # NCCL averages natively; gloo has no reliable AVG, so there we pre-scale by 1/N (see
        # _copy_into_slot) or divide after the sum, which is what torch DDP's reducer does too.
        self._use_avg_op = process_group is not None and dist.get_backend(process_group) == dist.Backend.NCCL
        self.require_backward_grad_sync = True  # False inside no_sync()

        if process_group is not None:
            states = [_local(p) for p in module.parameters()]
            if broadcast_buffers:
                states += [_local(b) for b in module.buffers()]
            broadcast_tensors_coalesced(states, process_group)

        self._buckets = self._build_buckets([p for p in module.parameters() if p.requires_grad])
        self._next_bucket = 0  # buckets are launched strictly in order
        self._pending: list[tuple[_Bucket, Any, torch.Tensor]] = []  # (bucket, work handle, wire tensor)
        self._num_marked = 0  # gradients copied into buckets since the last finish_gradient_sync

        # Hooks hold a weak reference: dropping the wrapper must not keep it alive through the
        # parameters, and a dropped wrapper's hooks become no-ops.
        self_ref = weakref.ref(self)
        self._hook_handles = []
        for bucket_index, bucket in enumerate(self._buckets):
            for position, p in enumerate(bucket.params):

                def hook(param: torch.Tensor, b: int = bucket_index, i: int = position) -> None:
                    ddp = self_ref()
                    if ddp is not None:
                        ddp._on_grad_ready(b, i)

                self._hook_handles.append(p.register_post_accumulate_grad_hook(hook))

        self.register_state_dict_post_hook(_strip_wrapped_prefix)
        self.register_load_state_dict_pre_hook(_add_wrapped_prefix)

    @property
    def world_size(self) -> int:
        """Replicas averaged over: the process group's size, or the reducer's current participants."""
        return self._reducer.size() if self._reducer is not None else self._group_size

    def _build_buckets(self, params: list[nn.Parameter]) -> list[_Bucket]:
        """Assign parameters to buckets in reverse registration order, split by size, dtype and device."""
        buckets: list[_Bucket] = []
        current: list[nn.Parameter] = []
        size = 0

        def close() -> None:
            offsets, numel = [], 0
            for p in current:
                offsets.append(numel)
                numel += _local(p).numel()
            buckets.append(_Bucket(params=list(current), offsets=offsets, numel=numel))

        for p in reversed(params):
            if current and (p.dtype != current[0].dtype or p.device != current[0].device):
                close()
                current, size = [], 0
            current.append(p)
            size += _local(p).numel() * p.element_size()
            if size >= self.bucket_bytes:
                close()
                current, size = [], 0
        if current:
            close()
        for bucket in buckets:
            bucket.ready = [False] * len(bucket.params)
        return buckets

    # ------------------------------------------------------------------ forward / no_sync

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the wrapped module; gradient sync happens in backward hooks."""
        return self.module(*args, **kwargs)

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally: backward passes inside launch no communication.

        The first backward after leaving the context syncs the accumulated gradients.
        """
        previous = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = previous

    # ------------------------------------------------------------------ backward hooks

    def _ensure_buffer(self, bucket: _Bucket) -> None:
        p0 = bucket.params[0]
        buf = bucket.buffer
        if buf is not None and buf.device == p0.device and buf.dtype == p0.dtype:
            return
        if any(p.device != p0.device or p.dtype != p0.dtype for p in bucket.params):
            raise RuntimeError(
                "BucketedDDP: parameters of one bucket now differ in device or dtype; "
                "move/cast the model before wrapping it, not after"
            )
        buf = torch.zeros(bucket.numel, dtype=p0.dtype, device=p0.device)
        bucket.buffer = buf
        bucket.cast_for_wire = self.grad_dtype is not None and self.grad_dtype != buf.dtype
        bucket.slots = []
        for p, o in zip(bucket.params, bucket.offsets):
            local = _local(p)
            bucket.slots.append(buf[o : o + local.numel()].view(local.shape))

    def _accumulate_in_slot(self, bucket: _Bucket, i: int) -> None:
        """Inside ``no_sync()``: move params[i]'s fresh gradient (the step's first, made after the
        optimizer set ``p.grad`` to None) into its bucket slot, unscaled, and point ``p.grad`` at the
        slot, where autograd accumulates the later microbatches in place; the step's final backward
        then finds the gradient in its slot (``_copy_into_slot``). The buckets outlive the step, so
        without this the accumulated gradients would be fresh tensors beside them: two copies of every
        gradient until the sync. A gradient in other placements than its parameter (``Partial`` under
        sequence parallel) keeps accumulating where it is and is redistributed once, at the sync."""
        p, grad = bucket.params[i], bucket.params[i].grad
        if grad is None or (
            isinstance(grad, DTensor) and isinstance(p, DTensor) and grad.placements != p.placements
        ):
            return
        self._ensure_buffer(bucket)
        slot, local = bucket.slots[i], _local(grad)
        if local.data_ptr() == slot.data_ptr():
            return  # already accumulating in the slot
        slot.copy_(local)
        self._point_at_slot(p, slot)

    def _point_at_slot(self, p: nn.Parameter, slot: torch.Tensor) -> None:
        if isinstance(p, DTensor):
            p.grad = DTensor.from_local(
                slot, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride()
            )
        else:
            p.grad = slot

    def _copy_into_slot(self, bucket: _Bucket, i: int) -> None:
        """Move params[i]'s gradient into its bucket slot and point ``p.grad`` at the slot.

        On gloo the 1/world_size factor is applied here (as torch DDP's reducer does) so the
        SUM all-reduce yields the mean without a second pass over the bucket; with a
        compressed wire dtype the division happens in full precision after the reduce instead.
        """
        p, slot = bucket.params[i], bucket.slots[i]
        grad = p.grad
        scale = not self._use_avg_op and not bucket.cast_for_wire and self.world_size > 1
        if grad is None:
            slot.zero_()
            return
        if isinstance(grad, DTensor) and isinstance(p, DTensor) and grad.placements != p.placements:
            grad = grad.redistribute(p.device_mesh, p.placements)  # e.g. Partial grads of SP norms
        local = _local(grad)
        if (
            local.data_ptr() == slot.data_ptr()
            and local.shape == slot.shape
            and local.stride() == slot.stride()
        ):
            if scale:
                slot.mul_(1.0 / self.world_size)  # accumulated in place (grad already is the slot)
        elif scale:
            torch.mul(local, 1.0 / self.world_size, out=slot)
        else:
            slot.copy_(local)
        self._point_at_slot(p, slot)

    def _on_grad_ready(self, bucket_index: int, i: int) -> None:
        bucket = self._buckets[bucket_index]
        if not self.require_backward_grad_sync:  # gradient accumulation: nothing to send yet
            self._accumulate_in_slot(bucket, i)
            return
        if bucket.launched or bucket.ready[i]:
            raise RuntimeError(
                "BucketedDDP: a gradient became ready twice before finish_gradient_sync(); call "
                "model.finish_gradient_sync() after the last backward of every step (and use "
                "no_sync() for gradient accumulation)"
            )
        self._ensure_buffer(bucket)
        self._copy_into_slot(bucket, i)
        bucket.ready[i] = True
        bucket.num_ready += 1
        self._num_marked += 1
        # Launch in bucket order only: every rank then issues identical collectives in identical order.
        while self._next_bucket < len(self._buckets):
            nxt = self._buckets[self._next_bucket]
            if nxt.num_ready < len(nxt.params):
                break
            self._launch(nxt)
            self._next_bucket += 1

    def _launch(self, bucket: _Bucket) -> None:
        assert bucket.buffer is not None
        wire = bucket.buffer.to(self.grad_dtype) if bucket.cast_for_wire else bucket.buffer
        if self._reducer is not None:
            handle = self._reducer.all_reduce(wire)  # SUM over the replicas of this step
        else:
            op = dist.ReduceOp.AVG if self._use_avg_op else dist.ReduceOp.SUM
            handle = dist.all_reduce(wire, op=op, group=self.process_group, async_op=True)
        bucket.launched = True
        self._pending.append((bucket, handle, wire))

    # ------------------------------------------------------------------ completion

    @property
    def num_pending_buckets(self) -> int:
        """Buckets whose all-reduce has been launched but not yet waited for."""
        return len(self._pending)

    @property
    def bucket_sizes(self) -> list[int]:
        """Number of parameters in each bucket, in launch order."""
        return [len(b.params) for b in self._buckets]

    def finish_gradient_sync(self) -> None:
        """Complete this step's gradient averaging; afterwards ``p.grad`` holds the global mean.

        Launches buckets that are still incomplete (zero-filling gradients that never arrived),
        waits for every handle and, for a compressed wire dtype, casts the averaged values back
        into the buckets (``p.grad`` is a view of its bucket slot). A no-op when no gradient was
        marked ready since the last call (e.g. called twice, or only no_sync() backwards ran).
        """
        if self._num_marked == 0 and not self._pending:
            return
        while self._next_bucket < len(self._buckets):
            bucket = self._buckets[self._next_bucket]
            self._ensure_buffer(bucket)
            for i in range(len(bucket.params)):
                if not bucket.ready[i]:
                    # Zero-fills a missing gradient; a parameter used only in earlier no_sync
                    # microbatches still has its accumulated grad, which is sent as usual.
                    self._copy_into_slot(bucket, i)
            self._launch(bucket)
            self._next_bucket += 1
        for bucket, handle, wire in self._pending:
            handle.wait()
            buf = bucket.buffer
            assert buf is not None
            if wire is not buf:
                buf.copy_(wire)
                if not self._use_avg_op:
                    buf.div_(self.world_size)  # in full precision, after the compressed sum
        for bucket in self._buckets:
            bucket.launched = False
            bucket.num_ready = 0
            bucket.ready = [False] * len(bucket.params)
        self._pending.clear()
        self._next_bucket = 0
        self._num_marked = 0

    # ------------------------------------------------------------------ unwrapped views

    def named_parameters(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, nn.Parameter]]:
        """The wrapped module's parameters, named without the ``module.`` prefix."""
        return self.module.named_parameters(prefix=prefix, recurse=recurse, remove_duplicate=remove_duplicate)

    def named_buffers(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """The wrapped module's buffers, named without the ``module.`` prefix."""
        return self.module.named_buffers(prefix=prefix, recurse=recurse, remove_duplicate=remove_duplicate)

    def _fqn_modifiers(self) -> dict[str, str]:
        """Tell torch.distributed.checkpoint's state_dict helpers that ``module`` is not in the FQNs.

        ``get_model_state_dict``/``get_optimizer_state_dict`` then use the same unprefixed names
        as our ``state_dict()``, so DCP checkpoints are interchangeable with unwrapped models.
        """
        inner = self.module
        names = [n for n, _ in inner.named_children()]
        names += [n for n, _ in inner.named_parameters(recurse=False)]
        names += [n for n, _ in inner.named_buffers(recurse=False)]
        return {name: "module" for name in names}

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            # e.g. model.layers on a wrapped model, like the unwrapped one.
            return getattr(super().__getattr__("module"), name)


def _strip_wrapped_prefix(
    module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any
) -> None:
    """State-dict post-hook: ``<prefix>module.x`` -> ``<prefix>x`` (also in the version metadata)."""
    old = prefix + _WRAPPED_PREFIX
    for key in [k for k in state_dict if k.startswith(old)]:
        state_dict[prefix + key[len(old) :]] = state_dict.pop(key)
    metadata = getattr(state_dict, "_metadata", None)
    if metadata is not None:
        own = prefix[:-1] if prefix else ""
        child = prefix + _WRAPPED_PREFIX[:-1]
        for key in [k for k in metadata if k == child or k.startswith(child + ".")]:
            new_key = own if key == child else prefix + key[len(child) + 1 :]
            metadata[new_key] = metadata.pop(key)


def _add_wrapped_prefix(
    module: nn.Module,
    state_dict: dict[str, Any],
    prefix: str,
    local_metadata: Any,
    strict: bool,
    missing_keys: list[str],
    unexpected_keys: list[str],
    error_msgs: list[str],
) -> None:
    """Load pre-hook: accept unprefixed keys (and, unchanged, torch DDP's ``module.`` ones)."""
    wrapped = prefix + _WRAPPED_PREFIX
    for key in [k for k in state_dict if k.startswith(prefix) and not k.startswith(wrapped)]:
        state_dict[wrapped + key[len(prefix) :]] = state_dict.pop(key)
    metadata = getattr(state_dict, "_metadata", None)
    if metadata is not None:
        # Module version metadata is only ever added to (the dict is shared with the caller's).
        own = prefix[:-1] if prefix else ""
        for key in list(metadata):
            if key == own:
                new_key = wrapped[:-1]
            elif key.startswith(prefix) and not key.startswith(wrapped) and key != wrapped[:-1]:
                new_key = wrapped + key[len(prefix) :]
            else:
                continue
            metadata.setdefault(new_key, metadata[key])


def finish_gradient_sync(model: nn.Module) -> None:
    """Complete gradient averaging for any model ``apply_ddp`` returns (no-op for torch DDP/plain models)."""
    if isinstance(model, BucketedDDP):
        model.finish_gradient_sync()


def apply_ddp(
    model: nn.Module,
    mesh: DeviceMesh,
    *,
    impl: str = "custom",
    bucket_mb: float = 25.0,
    grad_dtype: Optional[torch.dtype] = None,
) -> nn.Module:
    """Replicate ``model`` over the 1-D ``mesh`` (the ``dp_replicate`` axis) with DDP.

    ``impl="custom"`` returns :class:`BucketedDDP`; ``impl="torch"`` returns
    ``torch.nn.parallel.DistributedDataParallel`` configured to behave the same way: buckets
    of ``bucket_mb``, parameters and buffers broadcast once from the group's first rank,
    gradients kept as views of the buckets, ``grad_dtype`` compression via torch's
    bf16/fp16 comm hooks. Call :func:`finish_gradient_sync` before clipping either way.
    """
    validate_ddp(impl, bucket_mb)
    if grad_dtype not in (None, torch.float32, torch.bfloat16, torch.float16):
        raise ConfigError(f"DDP grad_dtype must be None, float32, bfloat16 or float16, got {grad_dtype}")
    if mesh.ndim != 1:
        raise ConfigError(
            f"apply_ddp needs the 1-D dp_replicate mesh, got a {mesh.ndim}-D mesh {mesh.mesh_dim_names}; "
            "pass mesh['dp_replicate']"
        )
    group = mesh.get_group()
    if impl == "custom":
        return BucketedDDP(model, group, bucket_mb=bucket_mb, grad_dtype=grad_dtype)

    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel

    # Ours broadcasts buffers once, at construction. torch DDP's broadcast_buffers=True would
    # also re-broadcast them before every forward; newer torch spells "init only" as
    # forward_sync_buffers=False, older torch needs broadcast_buffers=False plus our own init sync.
    buffer_kwargs: dict[str, Any]
    if "forward_sync_buffers" in inspect.signature(DistributedDataParallel.__init__).parameters:
        buffer_kwargs = {"forward_sync_buffers": False}
    else:
        broadcast_tensors_coalesced(list(model.buffers()), group)
        buffer_kwargs = {"broadcast_buffers": False}
    device = next(model.parameters()).device
    ddp = DistributedDataParallel(
        model,
        device_ids=[device] if device.type == "cuda" else None,  # CPU modules need None
        process_group=group,
        bucket_cap_mb=bucket_mb,
        gradient_as_bucket_view=True,  # like ours: p.grad is a view of its bucket, no copy back
        **buffer_kwargs,
    )
    if grad_dtype == torch.bfloat16:
        ddp.register_comm_hook(group, default_hooks.bf16_compress_hook)
    elif grad_dtype == torch.float16:
        ddp.register_comm_hook(group, default_hooks.fp16_compress_hook)
    return ddp


def apply_replica_ddp(
    model: nn.Module,
    reducer: ReplicaReducer,
    *,
    bucket_mb: float = 25.0,
    grad_dtype: Optional[torch.dtype] = None,
) -> nn.Module:
    """Wrap ``model`` in :class:`BucketedDDP` whose bucket all-reduce goes through ``reducer``.

    No construction-time broadcast: replica groups build identical weights (deterministic init, or
    the same checkpoint), and a group that joins late heals from a live peer before its first step.
    """
    return BucketedDDP(model, None, bucket_mb=bucket_mb, grad_dtype=grad_dtype, reducer=reducer)
