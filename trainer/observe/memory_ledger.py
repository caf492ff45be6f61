"""The memory ledger (``metrics.memory_ledger=true``): what a training step keeps in memory, per
rank, measured on the logged steps -- the numbers the planner's memory model is checked against.

- **Saved for backward** (``saved``): every tensor autograd saves, seen through
  ``torch.autograd.graph.saved_tensors_hooks`` while the step runs, deduplicated by storage (a
  view saved by three ops counts once, as the storage it keeps alive), per scope -- the
  embedding, each block (``block.<i>``), the head (final norm + output), the loss and the
  multi-token-prediction modules (``mtp``, with their calls of the shared head and loss) -- and
  per kind and dtype: ``activations``; ``weight_copies`` (the casts of parameters that bf16
  autocast makes and autograd saves: one bf16 copy of each matrix per forward); ``ac_inputs``
  (the inputs a checkpointed block keeps for its recompute: torch's checkpoint holds them in
  its recompute closure, not through the hooks, so the ledger adds them at the block's
  forward and drops them when its gradient arrives). Parameters (leaves that require grad and
  their views, FSDP's unsharded parameters included) and module buffers (the rotary cache) are
  not activations and are left out. Bytes are per step (summed over its microbatches);
  ``forwards`` counts the microbatch forwards of each scope.
- **Peak live saved bytes** (``peak_saved``): the largest total of saved storages alive at once
  during the step -- what grad accumulation and pipeline schedules change (a tensor is dead when
  autograd drops it, i.e. after its node ran in backward).
- **Model states** (``model_state``): parameters, gradients (measured before the optimizer
  step) and optimizer state, as in the communication ledger.
- **Buffers** it can see (``buffers``): FSDP's unsharded parameters (the peak of gathered
  bytes, sampled at every save, unpack and block boundary) and its reduce-scatter input (the
  largest unit's unsharded gradients in ``reduce_dtype``); the DDP buckets; the ZeRO-1 flat
  parameter storage; the pipeline's receive buffers (activations and gradients, one per
  microbatch, allocated once by torch's ``PipelineStage``) and the peak of stage outputs kept
  for backward (each stage's ``fwd_cache``, observed as entries are added).
- On CUDA also ``torch.cuda.max_memory_allocated`` / ``memory_reserved`` of the step.

Not seen: what op-level selective checkpointing caches (torch keeps the saved matmul outputs in
its own dispatch mode, below the hooks) and the one block that full checkpointing recomputes in
backward (under torch's own hooks); the planner plans both, only CUDA's allocator peak sees them.

Off (the default) nothing is installed. On, the hooks run on the logged steps only; every
rank's record is gathered to every rank at each logged step (one ``all_gather_object`` outside
the step) and written to ``metrics.jsonl`` and the trackers under ``memory``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Optional, Union

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from trainer.observe.comm_ledger import _optimizer_tensors, storage_bytes

if TYPE_CHECKING:
    from models.spec import ModelSpec
    from parallelisms.pipeline_parallel import Pipeline

__all__ = ["MemoryLedger"]

_PLAIN = (torch.Tensor, nn.Parameter)

# autograd nodes that pass a parameter on unchanged in memory terms: views, DTensor.to_local(), the
# expert-parallel gradient scale (``_ScaleGrad``, a custom Function), and casts (autocast copies)
_VIEW_NODES = (
    "TBackward",
    "ViewBackward",
    "TransposeBackward",
    "ExpandBackward",
    "_ToTorchTensorBackward",
    "UnsafeViewBackward",
    "ReshapeAliasBackward",
    "_ScaleGradBackward",
)


def _local(t: torch.Tensor) -> torch.Tensor:
    """The plain tensor that holds ``t``'s memory: a DTensor's local shard, the inner tensor of a
    wrapper subclass (functional collectives' ``AsyncCollectiveTensor``)."""
    for _ in range(4):
        if type(t) in _PLAIN or not is_traceable_wrapper_subclass(t):
            return t
        names, _ctx = t.__tensor_flatten__()
        t = getattr(t, names[0])
    return t


def _storage_key(t: torch.Tensor) -> tuple[int, int]:
    s = _local(t).untyped_storage()
    return s.data_ptr(), s.nbytes()


def _param_origin(t: torch.Tensor) -> Optional[str]:
    """``"param"`` for a parameter or a view of one (``weight.t()`` saved by a matmul, an expert
    weight's ``to_local()``), ``"cast"`` for a cast of one (autocast's bf16 weight), else None: its
    autograd history leads through views (and at most casts) only to a leaf."""
    if t.grad_fn is None:
        return "param" if t.requires_grad else None
    fn, cast = t.grad_fn, False
    for _ in range(6):
        name = type(fn).__name__
        if name == "AccumulateGrad":
            return "cast" if cast else "param"
        if name.startswith("ToCopyBackward"):
            cast = True
        elif not name.startswith(_VIEW_NODES):
            return None
        nexts = [f for f, _ in fn.next_functions if f is not None]
        if len(nexts) != 1:
            return None
        fn = nexts[0]
    return None


class _Saved:
    """What autograd stores instead of a saved tensor while the ledger is on; tells the ledger
    when autograd drops it."""

    __slots__ = ("tensor", "key", "ledger", "__weakref__")

    def __init__(self, tensor: torch.Tensor, key: tuple[int, int], ledger: MemoryLedger) -> None:
        self.tensor, self.key, self.ledger = tensor, key, ledger

    def __del__(self) -> None:
        self.ledger._release(self.key)


class _ObservedCache(dict):
    """A pipeline stage's ``fwd_cache`` (microbatch -> (outputs, inputs) kept for its backward) that
    tells the ledger its size whenever a microbatch's entry is added: the peak of kept outputs."""

    def __init__(self, initial: dict, ledger: MemoryLedger) -> None:
        super().__init__(initial)
        self._ledger = ledger

    def __setitem__(self, key: Any, value: Any) -> None:
        super().__setitem__(key, value)
        if self._ledger.active:
            self._ledger._sample_stage_outputs()


class MemoryLedger:
    """Measures the memory of the steps it is entered around (``with ledger: trainer.train_step()``)."""

    # the running counters (``_reset``)
    _live_bytes: int
    _peak: int
    _fsdp_peak: int
    _fwd_cache_peak: int

    def __init__(
        self,
        model_parts: list[nn.Module],
        spec: ModelSpec,
        *,
        model: Union[nn.Module, Pipeline, None] = None,
        optimizer: Optional[torch.optim.Optimizer] = None,
        device: Optional[torch.device] = None,
    ) -> None:
        self.parts, self.spec, self.model, self.optimizer = model_parts, spec, model, optimizer
        self.device = device or torch.device("cpu")
        self.active = False
        self.scope = "other"
        self._in_mtp = False  # inside the MTP modules (their head calls keep the "mtp" scope)
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._live: dict[tuple[int, int], list[int]] = {}  # storage -> [references, bytes]
        self._ac_held: dict[int, list[list[_Saved]]] = {}  # per checkpointed block: a stack of forwards
        self._fsdp = self._fsdp_params()
        for stage in getattr(model, "stages", None) or []:  # pipeline: see each stage output it keeps
            stage.fwd_cache = _ObservedCache(stage.fwd_cache, self)
        self._gather_storages: list[list[Any]] = [[] for _ in self._fsdp]
        self._install_scope_hooks()
        self._reset()
        self.grads_bytes = 0
        self.trace: Optional[list[tuple]] = (
            None  # set to [] to record every first save (scope, kind, shape, ...)
        )

    # -- scopes --------------------------------------------------------------------------
    def _install_scope_hooks(self) -> None:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

        def enter(scope: str) -> Any:
            return lambda module, args, kwargs=None: self._enter_scope(module, scope, args, kwargs)

        for part in self.parts:
            first = [getattr(part, n, None) for n in self.spec.first_modules]
            last = [m for m in (getattr(part, n, None) for n in self.spec.last_modules) if m is not None]
            # multi-token prediction (DeepSeek-V3): its modules run after the blocks and call the
            # shared head themselves; one scope of their own, nothing inside it switches scope
            mtp = getattr(part, "mtp", None)
            if mtp is not None and mtp in last:
                last.remove(mtp)
                mtp.register_forward_pre_hook(self._enter_mtp)
                mtp.register_forward_hook(self._leave_mtp)
            for m in first:
                if m is not None:
                    m.register_forward_pre_hook(enter("embedding"))
                    m.register_forward_hook(lambda *a: self._set_scope("other"))
            for key, block in self.spec.block_items(part):
                checkpointed = isinstance(block, CheckpointWrapper)
                block.register_forward_pre_hook(enter(f"block.{key}"), with_kwargs=True)
                block.register_forward_hook(
                    lambda module, args, out, c=checkpointed: self._leave_block(module, out, c)
                )
            if last:
                last[0].register_forward_pre_hook(enter("head"))
                last[-1].register_forward_hook(lambda *a: self._set_scope("loss"))

    def _enter_mtp(self, module: nn.Module, args: tuple) -> None:
        self._enter_scope(module, "mtp", args, None)
        self._in_mtp = self.active

    def _leave_mtp(self, module: nn.Module, args: tuple, out: Any) -> None:
        self._in_mtp = False
        self._set_scope("other")

    def _set_scope(self, scope: str) -> None:
        if self.active and not self._in_mtp:
            self.scope = scope
            self._sample_buffers()

    def _enter_scope(self, module: nn.Module, scope: str, args: tuple, kwargs: Optional[dict]) -> None:
        if not self.active or self._in_mtp:
            return
        self.scope = scope
        self._forwards[scope] = self._forwards.get(scope, 0) + 1
        self._sample_buffers()
        if kwargs is None or not scope.startswith("block."):
            return
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

        if isinstance(module, CheckpointWrapper):  # its recompute closure keeps the inputs alive
            held = [
                self._hold(t, "ac_inputs") for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)
            ]
            self._ac_held.setdefault(id(module), []).append([h for h in held if h is not None])

    def _leave_block(self, module: nn.Module, out: Any, checkpointed: bool) -> None:
        if not self.active:
            return
        self.scope = "other"
        self._sample_buffers()
        if checkpointed and isinstance(out, torch.Tensor) and out.requires_grad:
            stack = self._ac_held.get(id(module), [])
            held = stack.pop() if stack else []
            out.register_hook(lambda grad, held=held: held.clear())  # the block's backward starts

    # -- saved tensors -------------------------------------------------------------------
    def _hold(self, t: torch.Tensor, kind: Optional[str] = None) -> Optional[_Saved]:
        key = _storage_key(t)
        origin = _param_origin(t)
        if key[1] == 0 or key[0] in self._buffer_ptrs or origin == "param":  # parameters, receive buffers
            return None
        entry = self._live.get(key)
        if entry is not None:
            entry[0] += 1
        else:
            if kind is None:
                kind = "weight_copies" if origin == "cast" else "activations"
            self._live[key] = [1, key[1]]
            self._live_bytes += key[1]
            self._peak = max(self._peak, self._live_bytes)
            by_kind = self._saved.setdefault(self.scope, {}).setdefault(kind, {})
            dtype = str(_local(t).dtype).replace("torch.", "")
            by_kind[dtype] = by_kind.get(dtype, 0) + key[1]
            if self.trace is not None:  # debugging aid: what each first save was
                fn = _local(t).grad_fn or t.grad_fn
                self.trace.append(
                    (self.scope, kind, tuple(t.shape), dtype, key[1], type(fn).__name__ if fn else None)
                )
        return _Saved(t, key, self)

    def _pack(self, t: torch.Tensor) -> Any:
        self._sample_buffers()
        held = self._hold(t)
        return t if held is None else held

    def _unpack(self, packed: Any) -> torch.Tensor:
        if isinstance(packed, _Saved):
            if self._fsdp:
                self._sample_buffers()
            return packed.tensor
        return packed

    def _release(self, key: tuple[int, int]) -> None:
        entry = self._live.get(key)
        if entry is None:
            return
        entry[0] -= 1
        if entry[0] == 0:
            del self._live[key]
            self._live_bytes -= entry[1]

    # -- buffers ---------------------------------------------------------------------------
    def _fsdp_params(self) -> list[Any]:
        from torch.distributed.fsdp import FSDPModule

        out: dict[int, Any] = {}  # a unit over several modules (the head: norm + output) once
        for part in self.parts:
            for m in part.modules():
                if isinstance(m, FSDPModule):
                    group = m._get_fsdp_state()._fsdp_param_group
                    if group is not None:
                        out[id(group)] = group
        return list(out.values())

    def _sample_buffers(self) -> None:
        if self._fsdp:  # each unit's gathered parameters, or its pending (prefetched) flat all-gather output
            gathered = 0
            for i, g in enumerate(self._fsdp):
                pending = g._all_gather_result
                if pending is not None:
                    gathered += pending.all_gather_output.untyped_storage().nbytes()
                    continue
                storages = self._gather_storages[i]  # FSDP2 allocates them once, then resizes in place
                if not storages:
                    storages[:] = [t.untyped_storage() for p in g.fsdp_params for t in p.all_gather_outputs]
                gathered += sum(st.nbytes() for st in storages)
            self._fsdp_peak = max(self._fsdp_peak, gathered)

    def _sample_stage_outputs(self) -> None:
        stages = getattr(self.model, "stages", None) or []
        kept = storage_bytes(t for st in stages for out, _ in st.fwd_cache.values() for t in _tensors(out))
        self._fwd_cache_peak = max(self._fwd_cache_peak, kept)

    def _static_buffers(self) -> dict[str, float]:
        out: dict[str, float] = {}
        if self._fsdp:
            out["fsdp_unsharded_params"] = self._fsdp_peak
            out["fsdp_grad_reduce"] = max(
                sum(
                    p.padded_sharded_param_size.numel()
                    * p.mesh_info.shard_mesh_size
                    * (p.reduce_dtype or p.orig_dtype).itemsize
                    for p in g.fsdp_params
                )
                for g in self._fsdp
            )
        buckets = getattr(self.model, "_buckets", None)
        if buckets:
            out["ddp_buckets"] = sum(
                b.buffer.numel() * b.buffer.element_size() for b in buckets if b.buffer is not None
            )
        flat = getattr(self.optimizer, "_flat", None)
        if flat:
            out["zero1_flat_params"] = sum(f.storage.numel() * f.storage.element_size() for f in flat)
        stages = getattr(self.model, "stages", None)
        if stages:
            recv = [info.buffer for st in stages for infos in st.args_recv_info.values() for info in infos]
            grad = [info.buffer for st in stages for infos in st.grad_recv_info.values() for info in infos]
            out["pp_act_recv"] = storage_bytes(b for b in recv if isinstance(b, torch.Tensor))
            out["pp_grad_recv"] = storage_bytes(b for b in grad if isinstance(b, torch.Tensor))
            out["pp_fwd_cache_peak"] = self._fwd_cache_peak
        return out

    # -- the step ------------------------------------------------------------------------
    def _reset(self) -> None:
        self._saved: dict[str, dict[str, dict[str, int]]] = {}
        self._forwards: dict[str, int] = {}
        self._live_bytes = self._peak = 0
        self._fsdp_peak = self._fwd_cache_peak = 0
        self.steps = 0

    def __enter__(self) -> MemoryLedger:
        self.steps += 1
        self.active = True
        self._buffer_ptrs: set[int] = {
            b.untyped_storage().data_ptr() for part in self.parts for b in part.buffers()
        }
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._hooks.__exit__(*exc)
        self.active = False
        self.scope = "other"

    def measure_gradients(self, params: Iterable[torch.Tensor]) -> None:
        """Remember the gradient bytes (call once they are complete, before the optimizer step)."""
        self.grads_bytes = storage_bytes(p.grad for p in params)

    def pop(self, params: Iterable[torch.Tensor]) -> dict[str, Any]:
        """This rank's record per step since the last pop (then starts afresh)."""
        steps = max(self.steps, 1)
        saved = {
            scope: {kind: {dt: b / steps for dt, b in dts.items()} for kind, dts in kinds.items()}
            for scope, kinds in sorted(self._saved.items())
        }
        record: dict[str, Any] = {
            "saved": saved,
            "saved_total": sum(b for kinds in saved.values() for dts in kinds.values() for b in dts.values()),
            "forwards": {k: v / steps for k, v in sorted(self._forwards.items())},
            "peak_saved": self._peak,
            "model_state": {
                "params": storage_bytes(params),
                "grads": self.grads_bytes,
                "optimizer": storage_bytes(_optimizer_tensors(self.optimizer))
                if self.optimizer is not None
                else 0,
            },
            "buffers": self._static_buffers(),
        }
        if self.device.type == "cuda":
            record["cuda"] = {
                "max_allocated": torch.cuda.max_memory_allocated(self.device),
                "reserved": torch.cuda.memory_reserved(self.device),
            }
        self._reset()
        return record

    def collect(self, params: Iterable[torch.Tensor]) -> dict[str, Any]:
        """Every rank's :meth:`pop`, gathered to every rank (a collective over the default group:
        call on every rank, outside the step): ``{"steps": k, "ranks": {"0": {...}, ...}}``."""
        steps = self.steps
        local = self.pop(params)
        if dist.is_initialized() and dist.get_world_size() > 1:
            gathered: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, local)
        else:
            gathered = [local]
        return {"steps": steps, "ranks": {str(r): g for r, g in enumerate(gathered)}}


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [_local(value)]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []
