"""oneDNN fp32 GEMMs for the linears of a CPU run (``training.cpu_gemm``).

torch runs an fp32 ``nn.Linear`` on the CPU through its BLAS, MKL. MKL picks its kernels by CPU
vendor: on AMD processors it runs its AVX2 code even where the CPU has AVX-512, while oneDNN (which
torch also ships, and uses for its bf16 CPU matmuls) picks its kernels by the instructions the CPU
has. Measured on an AMD EPYC (family 26, AVX-512), 1 thread, the debug model's shapes
(1024 x 256 @ 256 x 768): forward 85 -> 194 GFLOP/s, input gradient 63 -> 209, weight gradient
38 -> 130 (README, "Performance: CPU speed against torchtitan").

:func:`use_onednn_linears` turns a built model's plain ``nn.Linear`` modules into
:class:`OneDNNLinear` (same parameters, names, state dict and ``isinstance``) and sets the output
head's ``onednn`` switch (``models.common.OutputHead``). Their forward takes oneDNN's
``mkldnn._linear_pointwise`` for the three GEMMs of a linear (output, input gradient, weight
gradient) only where it computes exactly what ``F.linear`` would, up to fp32 rounding: plain fp32
CPU tensors (not a DTensor or any other tensor subclass: tensor parallel, float8 / MXFP8 weights and
fake tensors keep ``F.linear``), outside autocast (bf16 autocast keeps torch's own path, which is
oneDNN's bf16 GEMM already) and outside ``torch.compile``. Everything else is ``F.linear``. The
saved tensors are ``F.linear``'s (input and weight), so memory is unchanged.
"""

from __future__ import annotations

import platform
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.autograd.function import BackwardCFunction, FunctionCtx

from models.errors import ConfigError

__all__ = ["OneDNNLinear", "linear", "onednn_available", "resolve_cpu_gemm", "use_onednn_linears"]

_PLAIN = (Tensor, nn.Parameter)


def onednn_available() -> bool:
    """Whether this torch build has oneDNN's CPU linear (``torch.ops.mkldnn._linear_pointwise``)."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def resolve_cpu_gemm(choice: str, device_type: str) -> bool:
    """Whether a run's linears take oneDNN (``training.cpu_gemm``): ``auto`` on an x86-64 CPU device
    where torch has oneDNN (elsewhere, e.g. ARM, oneDNN's fp32 GEMMs are not known to beat torch's
    BLAS), ``onednn`` always (a ConfigError where torch lacks it), ``torch`` never."""
    if choice == "onednn" and not onednn_available():
        raise ConfigError(
            "training.cpu_gemm=onednn: this torch build has no oneDNN CPU linear "
            "(torch.ops.mkldnn._linear_pointwise); set training.cpu_gemm=auto or torch."
        )
    x86 = platform.machine().lower() in ("x86_64", "amd64")
    return choice == "onednn" or (choice == "auto" and device_type == "cpu" and x86 and onednn_available())


def _gemm(a: Tensor, b_t: Tensor) -> Tensor:
    """``a @ b_t.T`` for 2-D fp32 CPU tensors (either may be strided) through oneDNN."""
    return torch.ops.mkldnn._linear_pointwise(a, b_t, None, "none", [], "")


class _OneDNNLinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: FunctionCtx, x: Tensor, weight: Tensor, bias: Optional[Tensor]) -> Tensor:
        x2 = x.reshape(-1, x.shape[-1])  # (N, in)
        out = torch.ops.mkldnn._linear_pointwise(x2, weight, bias, "none", [], "")  # (N, out)
        ctx.save_for_backward(x, weight)
        # not a view (as aten::linear's own _unsafe_view): FSDP2 warns on views returned by its modules,
        # whose in-place change would drop its pre-backward hook
        return torch.ops.aten._unsafe_view(out, (*x.shape[:-1], weight.shape[0]))

    @staticmethod
    def backward(
        ctx: BackwardCFunction, grad: Tensor
    ) -> tuple[Optional[Tensor], Optional[Tensor], Optional[Tensor]]:
        saved: tuple[Tensor, ...] = ctx.saved_tensors
        x, weight = saved
        g2 = grad.reshape(-1, grad.shape[-1])  # (N, out)
        grad_x = grad_w = grad_b = None
        need: tuple[bool, ...] = ctx.needs_input_grad  # (x, weight, bias)
        if need[0]:
            grad_x = _gemm(g2, weight.t()).view(x.shape)  # (N, out) @ (out, in)
        if need[1]:
            grad_w = _gemm(g2.t(), x.reshape(-1, x.shape[-1]).t())  # (out, N) @ (N, in)
        if need[2]:  # False without a bias
            grad_b = g2.sum(0)
        return grad_x, grad_w, grad_b


def _applies(x: Tensor, weight: Tensor, bias: Optional[Tensor]) -> bool:
    return (
        type(x) is Tensor
        and type(weight) in _PLAIN
        and (bias is None or type(bias) in _PLAIN)
        and x.device.type == "cpu"
        and x.dtype == weight.dtype == torch.float32
        and (bias is None or bias.dtype == torch.float32)
        and x.dim() >= 2
        and not torch.is_autocast_enabled("cpu")
        and not torch.compiler.is_compiling()
    )


def linear(x: Tensor, weight: Tensor, bias: Optional[Tensor] = None, *, onednn: bool = False) -> Tensor:
    """``F.linear(x, weight, bias)``; with ``onednn`` through oneDNN where that is the same computation
    (plain fp32 CPU tensors, no autocast, not compiling: the module docstring)."""
    if onednn and _applies(x, weight, bias):
        return _OneDNNLinearFn.apply(x, weight, bias)
    return F.linear(x, weight, bias)


class OneDNNLinear(nn.Linear):
    """An ``nn.Linear`` whose fp32 CPU GEMMs run through oneDNN (:func:`linear`)."""

    def forward(self, x: Tensor) -> Tensor:
        return linear(x, self.weight, self.bias, onednn=True)


def use_onednn_linears(model: nn.Module) -> int:
    """Turn every plain ``nn.Linear`` of ``model`` into :class:`OneDNNLinear` (in place, on any device,
    meta included, before wrappers) and set the ``onednn`` switch of every module that has one (the
    output heads); returns how many modules were switched."""
    count = 0
    for module in model.modules():
        if type(module) is nn.Linear:
            module.__class__ = OneDNNLinear
            count += 1
        elif isinstance(getattr(module, "onednn", None), bool):
            setattr(module, "onednn", True)  # noqa: B010 (any module with the switch: the output heads)
            count += 1
    return count
