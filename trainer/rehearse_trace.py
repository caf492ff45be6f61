"""The instruments of a rehearsal (``trainer/rehearse.py``): torch's ``MemTracker`` adapted to fake
tensors and DTensor, a FLOP counter of the rank's local ops, the GPU's attention kernels standing in for
the CPU's, and the cleanup between rehearsed ranks. Each is entered around the rehearsed steps; none
changes what the real code computes."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Optional, Protocol

import torch
from torch import nn

if TYPE_CHECKING:
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.utils.hooks import RemovableHandle


_TOTAL = "Total"  # MemTracker's key of a device's total in its snapshots


def flop_counter() -> Counting:
    """FLOPs of the ops this rank runs, by torch's ``flop_counter`` formulas: DTensor ops are let
    through to their local ops (torch's ``FlopCounterMode`` would count a DTensor matmul at its global
    shape), and the CPU attention kernels count as the fused kernels they stand for. A convolution's
    backward counts each gradient it computes (input, weight) as one forward convolution: torch's
    formula ignores ``groups`` there and counts a depthwise convolution's backward (Qwen3.5's short
    convolutions) as a dense one, channels times too many."""
    from torch.distributed.tensor import DTensor
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils.flop_counter import conv_flop_count, flop_registry, sdpa_backward_flop, sdpa_flop

    aten = torch.ops.aten

    def conv_backward_flop(
        grad_out: torch.Tensor, x: torch.Tensor, w: torch.Tensor, *args: object, **kwargs: object
    ) -> int:
        transposed, output_mask = args[4], args[7]
        assert isinstance(transposed, bool) and isinstance(output_mask, (list, tuple))
        forward = conv_flop_count(list(x.shape), list(w.shape), list(grad_out.shape), transposed)
        return forward * (int(bool(output_mask[0])) + int(bool(output_mask[1])))

    def grouped_mm_flop(a: torch.Tensor, b: torch.Tensor, *args: object, **kwargs: object) -> int:
        """``torch._grouped_mm`` (torch's registry has none): every group's rows, padding included."""
        if a.dim() == 2 and b.dim() == 3:  # (M, K) x (E, K, N): each row meets one expert
            return 2 * a.shape[0] * a.shape[1] * b.shape[2]
        if a.dim() == 2 and b.dim() == 2:  # (K, M) x (M, N) -> (E, K, N): the weight gradient
            return 2 * a.shape[0] * a.shape[1] * b.shape[1]
        if a.dim() == 3 and b.dim() == 2:  # (E, M, K) x (K, N_total)
            return 2 * a.shape[1] * a.shape[2] * b.shape[1]
        return 2 * a.shape[0] * a.shape[1] * a.shape[2] * b.shape[2]  # batched (E, M, K) x (E, K, N)

    formulas = {
        **flop_registry,
        aten._grouped_mm: grouped_mm_flop,
        aten._scaled_dot_product_flash_attention_for_cpu: sdpa_flop,
        aten._scaled_dot_product_flash_attention_for_cpu_backward: sdpa_backward_flop,
        aten.convolution_backward: conv_backward_flop,
    }

    class LocalFlops(TorchDispatchMode):
        total = 0.0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            if any(issubclass(t, DTensor) for t in types):
                return NotImplemented
            out = func(*args, **(kwargs or {}))
            formula = formulas.get(func._overloadpacket)
            if formula is not None and not _PROPAGATING[0]:
                self.total += formula(*args, **(kwargs or {}), out_val=out)
            return out

    return LocalFlops()


class Counting(Protocol):
    total: float

    def __enter__(self) -> object: ...
    def __exit__(self, *exc: object) -> None: ...


def gathered_units_tagged(tracker: MemTracker, parts: list[nn.Module]) -> list[RemovableHandle]:
    """``MemTracker`` books a module's parameters in its pre-forward hook, which runs before FSDP2's
    gather (a module's own hooks follow the global ones): a unit's gathered parameters are booked when
    a submodule of the unit runs, never those of a unit without submodules -- the stacked experts
    under expert parallelism, an FSDP unit of their own -- which it would count as activations. A
    pre-forward hook after FSDP's books them as parameters."""
    from torch.distributed.fsdp import FSDPModule

    def book(module: nn.Module, args: object) -> None:
        tracker._track_module_params_and_buffers(module, install_grad_hooks=False)

    leaves = (m for part in parts for m in part.modules() if next(m.children(), None) is None)
    return [m.register_forward_pre_hook(book) for m in leaves if isinstance(m, FSDPModule)]


@contextlib.contextmanager
def fused_attention_stand_in() -> Iterator[None]:
    """Masked attention (block-causal documents, context parallel's gathered keys) as the GPU runs it:
    FlexAttention with a block mask saves q, k, v, the output and the log-sum-exp, FLOPs of a fused
    kernel; the CPU path builds a dense (Sq, Sk) additive mask and SDPA's math path over it, S x S
    memory that would swamp the report at long context. Under the rehearsal the masked calls run
    SDPA's fused CPU kernel (``is_causal``: same shapes, FLOPs and saved tensors; fake tensors carry no
    values, so the mask's pattern changes nothing measured) and the dense mask is not built. Unlike
    query and value head sizes (MLA), which the CPU runs on SDPA's math path (S x S probabilities
    saved), run the memory-efficient kernel the GPU picks. Causal attention of equal head sizes without
    a mask is traced as it is (the GPU runs SDPA on it too)."""
    import models.attention as attention
    import parallelisms.context_parallel as context_parallel

    real_attend, real_additive = attention.attend, attention.MaskSpec.additive

    def attend(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        mask: Optional[attention.Mask],
        *,
        flex: Optional[object] = None,
    ) -> torch.Tensor:
        unlike = q.size(-1) != v.size(-1)  # MLA: the CPU has no fused kernel for unlike head sizes
        if mask is None and not unlike:
            return real_attend(q, k, v, None)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        if unlike:  # the memory-efficient kernel takes them (its meta and backward run on fake tensors)
            efficient = torch.ops.aten._scaled_dot_product_efficient_attention
            out = efficient(q, k, v, None, True, is_causal=True)[0]
        else:
            out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return out.transpose(1, 2)

    def additive(spec: attention.MaskSpec, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(0, dtype=dtype, device=spec.q_index.device)  # a BlockMask's few bytes

    attention.attend = context_parallel.attend = attend  # type: ignore[assignment]
    attention.MaskSpec.additive = additive  # type: ignore[method-assign]
    try:
        yield
    finally:
        attention.attend = context_parallel.attend = real_attend
        attention.MaskSpec.additive = real_additive  # type: ignore[method-assign]


_PROPAGATING = [0]  # > 0 while DTensor's sharding propagation runs an op on global-shape fake tensors


@contextlib.contextmanager
def propagation_marked() -> Iterator[None]:
    """Mark DTensor's sharding propagation (``ShardingPropagator._propagate_tensor_meta_non_cached``):
    it runs each op once more on fake tensors of the *global* shapes, in the active fake mode (the
    rehearsal's), to learn the output's metadata. Those are neither allocations nor FLOPs of the run:
    the memory tracker and the FLOP counter skip them."""
    from torch.distributed.tensor._sharding_prop import ShardingPropagator

    original = ShardingPropagator._propagate_tensor_meta_non_cached

    def propagate(prop: ShardingPropagator, op_schema: object) -> object:
        _PROPAGATING[0] += 1
        try:
            return original(prop, op_schema)  # type: ignore[arg-type]
        finally:
            _PROPAGATING[0] -= 1

    ShardingPropagator._propagate_tensor_meta_non_cached = propagate  # type: ignore[assignment,method-assign]
    try:
        yield
    finally:
        ShardingPropagator._propagate_tensor_meta_non_cached = original  # type: ignore[method-assign]


def mem_tracker(base: type[MemTracker]) -> MemTracker:
    """torch's ``MemTracker`` with three changes for a rehearsal:

    - what DTensor's sharding propagation allocates is not counted (``propagation_marked``: global-
      shape metadata, never allocated by the run; it put the whole unsharded model into the optimizer
      step's peak);
    - only the device-wide peak is updated per op (the per-module peaks, which the rehearsal does not
      read, cost a walk over every tracked module per op: quadratic in the depth of the model);
    - the model may be called again within a step (gradient accumulation; torch's tracker refuses a
      second top-level forward): the per-module statistics restart, the device-wide ones are kept."""

    class RehearsalMemTracker(base):  # type: ignore[misc,valid-type]
        def _pre_fw_hook(self, module: nn.Module, inputs: tuple[object, ...]) -> None:
            tracker = self._mod_tracker
            if (
                module in self.memory_tracking
                and not tracker.is_bw
                and set(tracker.parents) <= {"Global"} | {tracker.get_known_fqn(module)}
            ):
                self.reset_mod_stats()
            super()._pre_fw_hook(module, inputs)

        # Pipeline schedules run forwards of later microbatches (and, interleaved, of other stages)
        # before the backward of earlier ones: a module whose statistics were restarted meanwhile
        # has none to update in its backward (the device-wide figures are kept either way).
        def _pre_bw_hook(self, module: nn.Module, args: object) -> None:
            if module in self.memory_tracking:
                super()._pre_bw_hook(module, args)

        def _post_bw_hook(self, module: nn.Module, args: object) -> None:
            if module in self.memory_tracking:
                super()._post_bw_hook(module, args)

        def _update_peak_stats(self, peak_state: object) -> None:
            for dev, snap in self._curr_mem_snap.items():
                if self._peak_mem.get(dev, 0) < snap[_TOTAL]:
                    self._peak_mem[dev] = snap[_TOTAL]
                    self._peak_mem_snap[dev] = dict(snap)

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            if _PROPAGATING[0]:
                return func(*args, **(kwargs or {}))
            check_matmul_dtypes(func, args)
            return super().__torch_dispatch__(func, types, args, kwargs)

    return RehearsalMemTracker()


def check_matmul_dtypes(func: object, args: tuple[object, ...]) -> None:
    """Fake tensors' matmuls do not check their operands' dtypes; the CPU and CUDA kernels refuse unlike
    ones (a bf16 activation against an fp32 weight: emulated MXFP8 under autocast did). Raise as they do,
    so that the rehearsal fails where the real run would."""
    aten = torch.ops.aten
    operands = {aten.mm.default: (0, 1), aten.bmm.default: (0, 1), aten.addmm.default: (1, 2)}.get(func)
    if operands is None:
        return
    a, b = (args[i] for i in operands)
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype != b.dtype:
        raise RuntimeError(
            f"{func}: expected m1 and m2 to have the same dtype, but got: {a.dtype} != {b.dtype}"
        )


def forget_meshes() -> None:
    """Clear DTensor's sharding-propagation caches: their entries hold the meshes (and through them
    the destroyed process groups) of the rank rehearsed before; an equal mesh of the next rank would
    otherwise be answered with the old one's groups."""
    from torch.distributed.tensor._redistribute import _gen_transform_infos, clear_redistribute_planner_cache
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    _clear_sharding_prop_cache()  # the Python and the C++ fast path's
    clear_redistribute_planner_cache()
    _gen_transform_infos.cache_clear()
