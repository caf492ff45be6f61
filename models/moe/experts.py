"""The routed experts of the mixture-of-experts family, free of any parallelism: ``GroupedExperts`` (E
SwiGLU experts stored stacked, run on rows grouped by expert: ``torch._grouped_mm``, the same over token
groups padded for low-precision GEMMs, or a padded batched ``bmm`` fallback), the static padded-row
bound the planner shares (``padded_group_rows``), the gradient scale expert parallelism sets
(``_ScaleGrad``) and ``_local`` (a DTensor's local block, duck-typed). Split from ``model.py`` (the
router, the MoE layer, the blocks, counts and planner terms), which re-exports ``GroupedExperts``."""

from __future__ import annotations

from typing import Optional, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from models.common import ParamInit
from models.spec import StackedExperts

__all__ = ["GroupedExperts", "padded_group_rows"]


class _ScaleCtx(Protocol):
    """What ``_ScaleGrad`` keeps on its autograd context."""

    factor: float


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; gradient times ``factor`` (expert parallel's extra 1/ep, see GroupedExperts)."""

    @staticmethod
    def forward(ctx: _ScaleCtx, x: Tensor, factor: float) -> Tensor:
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx: _ScaleCtx, grad: Tensor) -> tuple[Tensor, None]:
        return grad * ctx.factor, None


def padded_group_rows(rows: int, groups: int, multiple: int) -> int:
    """The rows ``GroupedExperts._grouped_padded`` runs its grouped GEMMs over: ``rows`` token copies
    in ``groups`` expert groups, each padded to a multiple of ``multiple``, as a static bound (no host
    sync): rows + groups * (multiple - 1), rounded up to ``multiple``. The planner's count too
    (``ffn_saved``, ``expert_padding_flops``)."""
    return -(-(rows + groups * (multiple - 1)) // multiple) * multiple


def _local(t: Tensor) -> Tensor:
    """The local block of an expert-parallel DTensor (duck-typed: models/ never imports distributed)."""
    return t.to_local() if hasattr(t, "to_local") else t


class GroupedExperts(StackedExperts):
    """E SwiGLU experts stored stacked: ``w1/w3`` (E, F, H), ``w2`` (E, H, F) (each expert in
    ``nn.Linear`` layout), run on rows already grouped by expert.

    ``forward(x, counts)``: rows ``x`` (N, H) sorted by expert, ``counts`` (E_local,) rows per
    expert. Under expert parallelism the parameters are DTensors sharded on dim 0 and this module
    sees only its E_local experts (``_local``). ``grad_scale`` multiplies the weights' gradients
    (expert parallel sets 1/ep: the experts' data-parallel group is ep times smaller than the
    dense parameters', yet each expert's gradient holds the whole ep group's tokens).
    """

    def __init__(self, num_experts: int, dim: int, hidden_dim: int, grouped_mm: str = "auto") -> None:
        super().__init__()
        self.num_experts = num_experts
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.w3 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))
        self.grouped_mm = grouped_mm
        self.grad_scale = 1.0
        self.group_multiple = 1  # > 1: grouped GEMMs over token groups padded to it (pad_token_groups)

    def init_weights(self, init: ParamInit, prefix: str, std: float, out_std: float) -> None:
        """Like ``FeedForward``: w1 truncated normal (std); w2/w3 depth-scaled ``out_std``."""
        init.trunc_normal(f"{prefix}.w1", self.w1, std, 2.0)
        init.trunc_normal(f"{prefix}.w2", self.w2, out_std, 2.0)
        init.trunc_normal(f"{prefix}.w3", self.w3, out_std, 2.0)

    def pad_token_groups(self, multiple: int) -> None:
        """Low-precision experts (parallelisms/float8.py): always ``torch._grouped_mm``, each
        expert's token group padded with zero rows to a multiple of ``multiple``."""
        self.grouped_mm = "on"
        self.group_multiple = multiple

    def use_grouped_mm(self, x: Tensor) -> bool:
        """``on``; ``off``; ``auto`` = CUDA with compute capability >= 9.0 and bf16 activations."""
        if self.grouped_mm != "auto":
            return self.grouped_mm == "on"
        return (
            x.is_cuda
            and x.dtype == torch.bfloat16
            and hasattr(torch, "_grouped_mm")
            and torch.cuda.get_device_capability(x.device) >= (9, 0)
        )

    def forward(self, x: Tensor, counts: Tensor, host_counts: Optional[list[int]] = None) -> Tensor:
        """``host_counts``: the same ``counts`` already on the host (a balanced routing knows them), so
        that the padded path needs no host sync; None reads them from ``counts`` when needed."""
        w1, w2, w3 = (_local(w) for w in (self.w1, self.w2, self.w3))  # (E_l, F, H), (E_l, H, F), (E_l, F, H)
        if self.grad_scale != 1.0:
            w1, w2, w3 = (_ScaleGrad.apply(w, self.grad_scale) for w in (w1, w2, w3))
        if self.group_multiple > 1:
            return self._grouped_padded(x, counts, w1, w2, w3, self.group_multiple)
        if self.use_grouped_mm(x):
            return self._grouped(x, torch.cumsum(counts, dim=0, dtype=torch.int32), w1, w2, w3)
        largest = max(host_counts, default=0) if host_counts is not None else None
        return self._padded(x, counts, w1, w2, w3, largest)

    @staticmethod
    def _grouped(x: Tensor, offs: Tensor, w1: Tensor, w2: Tensor, w3: Tensor) -> Tensor:
        """``offs`` (E_l,) int32: the end row of each expert's group."""
        w1t, w2t, w3t = (w.transpose(-2, -1) for w in (w1, w2, w3))  # (E_l, H, F), (E_l, F, H)
        h = F.silu(torch._grouped_mm(x, w1t, offs=offs)) * torch._grouped_mm(x, w3t, offs=offs)  # (N, F)
        return torch._grouped_mm(h.contiguous(), w2t, offs=offs)  # (N, H)

    @staticmethod
    def _grouped_padded(
        x: Tensor, counts: Tensor, w1: Tensor, w2: Tensor, w3: Tensor, multiple: int
    ) -> Tensor:
        """``_grouped`` over groups padded with zero rows to a multiple of ``multiple`` rows (what
        torchao's float8 / MXFP8 grouped GEMMs require). The padded length is a static bound
        (:func:`padded_group_rows`, no host sync); the slack joins the last group. Zero rows give
        zero outputs (silu(0) * 0 = 0) and add nothing to the weight gradients; only the real rows
        are gathered back."""
        n, dim = x.shape
        num_local = counts.numel()
        total = padded_group_rows(n, num_local, multiple)
        padded = (counts + (multiple - 1)) // multiple * multiple  # (E_l,)
        ends = torch.cumsum(padded, 0)  # (E_l,) end row of each padded group
        starts = torch.cumsum(counts, 0) - counts  # (E_l,) start row of each group in x
        offs = torch.cat([ends[:-1], ends.new_full((1,), total)]).to(torch.int32)
        expert = torch.repeat_interleave(
            torch.arange(num_local, device=x.device), counts, output_size=n
        )  # (N,)
        dest = torch.arange(n, device=x.device) - starts[expert] + (ends - padded)[expert]  # (N,) padded row
        batch = x.new_zeros(total, dim).index_put((dest,), x)  # (total, H)
        return GroupedExperts._grouped(batch, offs, w1, w2, w3)[dest]  # (N, H)

    @staticmethod
    def _padded(
        x: Tensor, counts: Tensor, w1: Tensor, w2: Tensor, w3: Tensor, largest: Optional[int] = None
    ) -> Tensor:
        """Batched fallback: scatter the groups into a zero-padded (E_l, C, H) batch (C = largest
        group, ``largest`` when the caller knows it), three ``bmm``, gather the rows back. Padding
        rows stay zero (silu(0) * 0 = 0)."""
        n, dim = x.shape
        num_local = counts.numel()
        if largest is not None:
            capacity = largest
        else:
            capacity = int(counts.max()) if n > 0 else 0  # one host sync per layer
        starts = torch.cumsum(counts, 0) - counts  # (E_l,)
        expert = torch.repeat_interleave(
            torch.arange(num_local, device=x.device), counts, output_size=n
        )  # (N,): n = counts.sum(), given so that no host sync is needed
        pos = torch.arange(n, device=x.device) - starts[expert]  # (N,) row within its group
        batch = x.new_zeros(num_local, capacity, dim).index_put((expert, pos), x)  # (E_l, C, H)
        h = F.silu(torch.bmm(batch, w1.transpose(1, 2))) * torch.bmm(batch, w3.transpose(1, 2))  # (E_l, C, F)
        y = torch.bmm(h, w2.transpose(1, 2))  # (E_l, C, H)
        return y[expert, pos]  # (N, H)
