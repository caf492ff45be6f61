"""Mixture-of-experts decoder (Mixtral / Qwen3-MoE / DeepSeek-MoE shapes), free of any parallelism.

The model is the Llama decoder (``models/llama/model.py``) whose feed-forward is, in chosen layers, a
mixture of experts: layer ``i`` is an MoE layer when ``i >= first_k_dense`` and
``i % moe_layer_freq == 0`` (DeepSeek's rule), the others keep Llama's dense SwiGLU. Module tree::

    tok_embeddings.weight
    layers.{i}.attention.{wq,wk,wv,wo}.weight        (+ attention.{q_norm,k_norm}.weight with qk_norm)
    layers.{i}.{attention_norm,ffn_norm}.weight
    layers.{i}.feed_forward.{w1,w2,w3}.weight         dense layers
    layers.{i}.moe.router.gate.weight                 (E, H)      MoE layers
    layers.{i}.moe.experts.{w1,w3}                    (E, F, H)   stacked, one nn.Linear layout per expert
    layers.{i}.moe.experts.w2                         (E, H, F)
    layers.{i}.moe.shared_experts.{w1,w2,w3}.weight   optional always-on SwiGLU
    layers.{i}.moe.expert_bias                        (E,) buffer: aux-loss-free balancing (checkpointed)
    norm.weight, output.weight

One MoE layer, for the T = B*S tokens of a forward (seed article section 8):

1. router (``TopKRouter``): scores = softmax or sigmoid of ``gate(x)`` in fp32; the top-k experts are
   chosen on ``scores + expert_bias`` (the bias steers only the choice), their weights are the
   unbiased scores, optionally renormalised to sum 1, times ``route_scale``;
2. the T*k (token, expert) pairs are sorted by expert, optionally cut to a capacity per expert;
3. the sorted token copies go through the experts -- locally, or through ``dispatcher`` when expert
   parallelism is on (``parallelisms/expert_parallel.py`` sets it: all_to_all to the experts' owners
   and back); ``GroupedExperts`` runs each expert on its contiguous group of rows, with
   ``torch._grouped_mm`` or a padded batched matmul;
4. combine: each copy is scaled by its routing weight and added back to its token (``index_add``),
   plus the shared experts' output.

Balanced routing (``MoE.balanced_routing``, off unless set): copy j of a forward's T*k token copies
goes to expert j mod E, whatever the scores -- torchtitan's ``_debug_force_load_balance``, Megatron's
``--moe-router-force-load-balancing``. The tokens per expert are then known on the host without
reading a tensor (``balanced_counts``), so the sort, the experts and a dispatcher need no host sync:
what a rehearsal under ``FakeTensorMode`` (tensors without values) needs, and a way to benchmark a
layout without the routing's imbalance. The routing weights remain the chosen experts' scores.

Load balancing. Each MoE module records, per forward of a step, the tokens each expert receives
and the auxiliary loss (``step_records``); the trainer reduces the counts over the data-parallel ranks
(``parallelisms.expert_parallel.LoadBalancer``) and calls ``update_bias`` before the optimizer step:
``expert_bias += bias_update_coeff * sign(mean - count)`` (DeepSeek-V3's auxiliary-loss-free
balancing). The auxiliary loss (``aux_loss_coeff > 0``, Switch-style ``E * sum_e f_e P_e`` over the
forward's tokens, or per sequence) is added to the gradient only: ``AddAuxGrad`` returns the layer
output unchanged and feeds ``d(aux)/d(scores)`` into backward, so the language-model loss value is
untouched and works with pipeline stages. The weight of each forward's aux term is
``aux_grad_scale * tokens`` (the trainer sets ``aux_grad_scale`` = dp_cp / tokens per step, so that
over all microbatches and ranks the objective is ``LM mean + coeff * token-weighted mean aux``).

``MOE_SPEC`` (``models/moe/__init__.py``) is what the rest of the stack sees; it declares
``moe_layers(model)`` (the MoE modules by name) and ``expert_modules(model)`` (the stacked experts),
which expert parallelism, FSDP, the load balancer and the planner use.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from models.common import ParamInit, RMSNorm, unwrapped_name
from models.errors import ConfigError, check_choice
from models.llama.model import (
    TP_PLAN as LLAMA_TP_PLAN,
)
from models.llama.model import (
    Attention,
    FeedForward,
    LlamaArgs,
    Transformer,
    _attention_params,
    _positive_int,
    num_flops_per_token,
)
from models.llama.model import ffn_saved as llama_ffn_saved
from models.llama.model import planner_terms as llama_planner_terms
from models.spec import BlockLayout, ExpertGroups, ParamCounts, PlannerTerms, StackedExperts

__all__ = [
    "TP_PLAN",
    "GroupedExperts",
    "MoE",
    "MoEArgs",
    "MoEBlock",
    "MoETransformer",
    "TopKRouter",
    "balanced_counts",
    "expert_modules",
    "moe_layers",
    "padded_group_rows",
    "param_counts",
    "planner_terms",
]

_INT64 = 8  # bytes of an int64 index
SCORE_FUNCS = ("softmax", "sigmoid")
AUX_LOSS_TYPES = ("global", "sequence")
GROUPED_MM = ("auto", "on", "off")


# --------------------------------------------------------------------------------------------
# Arguments
# --------------------------------------------------------------------------------------------


@dataclass
class MoEArgs(LlamaArgs):
    """A Llama decoder plus the mixture-of-experts hyper-parameters."""

    family: str = "moe"
    num_experts: int = 8  # routed experts E per MoE layer
    top_k: int = 2  # experts per token
    moe_hidden_dim: int = 256  # SwiGLU hidden size F of one routed expert
    moe_layer_freq: int = 1  # layer i >= first_k_dense is MoE when i % moe_layer_freq == 0
    first_k_dense: int = 0  # the first k layers keep the dense FFN (hidden ffn_hidden_dim)
    num_shared_experts: int = 0  # always-on experts, fused into one SwiGLU of hidden num_shared * F
    score_func: str = "softmax"  # softmax | sigmoid (router scores, in fp32)
    route_norm: bool = True  # renormalise the top-k scores to sum 1
    route_scale: float = 1.0  # multiply the routing weights (DeepSeek-V3's routed_scaling_factor)
    n_group: int = 1  # experts form n_group equal groups; a token picks experts only inside ...
    topk_group: int = 1  # ... its topk_group best groups (group score: sum of its top-2 biased scores)
    bias_update_coeff: float = 0.0  # aux-loss-free balancing step (DeepSeek-V3: 1e-3); 0 = off
    aux_loss_coeff: float = 0.0  # auxiliary load-balancing loss weight; 0 = off
    aux_loss_type: str = "global"  # global (over a forward's tokens) | sequence (per sequence, averaged)
    capacity_factor: float = (
        0.0  # > 0: each expert takes at most ceil(cf * T * k / E) tokens, the rest are dropped
    )
    grouped_mm: str = "auto"  # auto (torch._grouped_mm on CUDA sm90+ in bf16) | on | off (padded bmm)

    def validate(self) -> None:
        """Raise ``ConfigError`` naming the bad value and the fix; return None when consistent."""
        if self.mup.enable:
            raise ConfigError(
                f"model.mup.enable=true with model.family={self.family}: µP (models/mup.py) is "
                "implemented for the dense Llama-style families (llama, qwen3) only; the experts, router and "
                "(DeepSeek-V3) latent attention have no µP rules here. Set model.mup.enable=false."
            )
        super().validate()
        for name in ("num_experts", "top_k", "moe_hidden_dim", "moe_layer_freq"):
            _positive_int(getattr(self, name), f"model.{name}")
        for name in ("first_k_dense", "num_shared_experts"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ConfigError(f"model.{name}={value!r} must be an integer >= 0.")
        for name in ("n_group", "topk_group"):
            _positive_int(getattr(self, name), f"model.{name}")
        if self.num_experts % self.n_group != 0 or self.topk_group > self.n_group:
            raise ConfigError(
                f"model.n_group={self.n_group} must divide model.num_experts={self.num_experts} and be >= "
                f"model.topk_group={self.topk_group}; n_group=1 turns group-limited routing off."
            )
        if self.n_group > 1 and self.top_k > self.topk_group * (self.num_experts // self.n_group):
            raise ConfigError(
                f"model.top_k={self.top_k} exceeds the "
                f"{self.topk_group * (self.num_experts // self.n_group)} experts "
                f"of the topk_group={self.topk_group} groups a token may use; raise topk_group or lower "
                "top_k."
            )
        if self.top_k > self.num_experts:
            raise ConfigError(
                f"model.top_k={self.top_k} exceeds model.num_experts={self.num_experts}: a token cannot pick "
                "more "
                f"experts than exist; use top_k <= {self.num_experts}."
            )
        for value, allowed, key in (
            (self.score_func, SCORE_FUNCS, "model.score_func"),
            (self.aux_loss_type, AUX_LOSS_TYPES, "model.aux_loss_type"),
            (self.grouped_mm, GROUPED_MM, "model.grouped_mm"),
        ):
            check_choice(value, allowed, key)
        for name in ("bias_update_coeff", "aux_loss_coeff", "capacity_factor"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise ConfigError(f"model.{name}={value!r} must be a finite number >= 0 (0 turns it off).")
        if not (isinstance(self.route_scale, (int, float)) and self.route_scale > 0):
            raise ConfigError(f"model.route_scale={self.route_scale!r} must be a positive number.")
        if not self.moe_layer_ids:
            raise ConfigError(
                f"no layer is an MoE layer (model.n_layers={self.n_layers}, "
                f"first_k_dense={self.first_k_dense}, "
                f"moe_layer_freq={self.moe_layer_freq}); lower first_k_dense or use the llama family."
            )

    def is_moe_layer(self, layer_id: int) -> bool:
        """Whether block ``layer_id`` has an MoE feed-forward (else Llama's dense one)."""
        return layer_id >= self.first_k_dense and layer_id % self.moe_layer_freq == 0

    @property
    def moe_layer_ids(self) -> list[int]:
        return [i for i in range(self.n_layers) if self.is_moe_layer(i)]


# --------------------------------------------------------------------------------------------
# Modules
# --------------------------------------------------------------------------------------------


class TopKRouter(nn.Module):
    """Scores in fp32, top-k choice on ``scores + bias``, weights from the unbiased scores."""

    def __init__(self, args: MoEArgs) -> None:
        super().__init__()
        self.gate = nn.Linear(args.dim, args.num_experts, bias=False)
        self.top_k = args.top_k
        self.score_func = args.score_func
        self.route_norm = args.route_norm
        self.route_scale = args.route_scale
        self.n_group = args.n_group
        self.topk_group = args.topk_group

    def init_weights(self, init: ParamInit, prefix: str, std: float) -> None:
        init.trunc_normal(f"{prefix}.gate.weight", self.gate.weight, std, 2.0)

    def limit_groups(self, choice: Tensor) -> Tensor:
        """Group-limited routing (DeepSeek-V3): keep the experts of each token's ``topk_group`` best
        groups (group score = sum of its two best biased scores), -inf elsewhere. (T, E) -> (T, E)."""
        T, E = choice.shape
        groups = choice.view(T, self.n_group, E // self.n_group)  # (T, G, E/G)
        group_scores = groups.topk(min(2, E // self.n_group), dim=-1).values.sum(-1)  # (T, G)
        best = group_scores.topk(self.topk_group, dim=-1).indices  # (T, topk_group)
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)  # (T, G)
        return groups.masked_fill(~keep[:, :, None], float("-inf")).view(T, E)

    def forward(
        self, x: Tensor, bias: Optional[Tensor] = None, balanced: bool = False
    ) -> tuple[Tensor, Tensor, Tensor]:
        """``x`` (T, H) -> (weights (T, k) fp32, expert ids (T, k), scores (T, E) fp32); ``balanced``:
        copy j of the T*k goes to expert j mod E instead of the top-k choice (see the module doc)."""
        logits = self.gate(x).float()  # (T, E)
        scores = logits.softmax(dim=-1) if self.score_func == "softmax" else logits.sigmoid()
        with torch.no_grad():
            if balanced:
                T, E = scores.shape
                indices = (torch.arange(T * self.top_k, device=x.device) % E).view(T, self.top_k)
            else:
                choice = scores if bias is None else scores + bias  # the bias only steers the choice
                if self.n_group > 1:
                    choice = self.limit_groups(choice)
                indices = torch.topk(choice, self.top_k, dim=-1).indices  # (T, k)
        weights = scores.gather(1, indices)  # (T, k)
        if self.route_norm and self.top_k > 1:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        if self.route_scale != 1.0:
            weights = weights * self.route_scale
        return weights, indices, scores


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; gradient times ``factor`` (expert parallel's extra 1/ep, see GroupedExperts)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, factor: float) -> Tensor:
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
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


class AddAuxGrad(torch.autograd.Function):
    """``forward(out, aux) = out``; backward adds ``d aux`` as if ``aux`` were added to the loss.

    The auxiliary loss thus shapes the router's gradient without changing the reported loss, and
    reaches the router from any pipeline stage (its gradient rides on the stage's activations).
    """

    @staticmethod
    def forward(ctx: Any, out: Tensor, aux: Tensor) -> Tensor:
        ctx.aux_meta = (aux.shape, aux.dtype, aux.device)
        return out.view_as(out)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, Tensor]:
        shape, dtype, device = ctx.aux_meta
        return grad, torch.ones(shape, dtype=dtype, device=device)


# (rows sorted by expert, counts (E,), experts, the counts on the host or None) -> rows
Dispatcher = Callable[[Tensor, Tensor, nn.Module, Optional[list[int]]], Tensor]


def _starts(counts: list[int]) -> list[int]:
    """Exclusive prefix sums: where each group starts."""
    return [0, *itertools.accumulate(counts)][:-1]


def balanced_counts(copies: int, num_experts: int) -> list[int]:
    """Token copies per expert under balanced routing (copy j to expert j mod E): ``copies / E``
    each, the first ``copies mod E`` experts one more."""
    base, extra = divmod(copies, num_experts)
    return [base + (e < extra) for e in range(num_experts)]


def _recomputing() -> bool:
    """True inside backward (e.g. activation checkpointing re-running a forward): statistics are
    recorded once per real forward."""
    return torch._C._current_graph_task_id() != -1


class MoE(nn.Module):
    """Router + stacked routed experts (+ shared experts), with load-balancing statistics."""

    expert_bias: Tensor  # a persistent buffer (registered in __init__)

    def __init__(self, args: MoEArgs) -> None:
        super().__init__()
        self.num_experts = args.num_experts
        self.top_k = args.top_k
        self.router = TopKRouter(args)
        self.experts = GroupedExperts(args.num_experts, args.dim, args.moe_hidden_dim, args.grouped_mm)
        self.shared_experts: Optional[FeedForward] = (
            FeedForward(args.dim, args.num_shared_experts * args.moe_hidden_dim)
            if args.num_shared_experts > 0
            else None
        )
        self.capacity_factor = args.capacity_factor
        self.aux_loss_coeff = args.aux_loss_coeff
        self.aux_loss_type = args.aux_loss_type
        self.bias_update_coeff = args.bias_update_coeff
        self.register_buffer("expert_bias", torch.zeros(args.num_experts), persistent=True)
        # Per-forward statistics of the current step (cleared by ``reset_stats``), never
        # checkpointed: one (E + 2,) row per forward = [tokens per expert, aux * tokens, tokens].
        self.step_records: list[Tensor] = []
        self.aux_grad_scale: Optional[float] = None  # None: weight 1 per forward (outside the trainer)
        self.dispatcher: Optional[Dispatcher] = None  # set by expert parallelism
        self.balanced_routing = False  # True: copy j goes to expert j mod E (module doc)

    def init_weights(self, init: ParamInit, prefix: str, std: float, out_std: float) -> None:
        self.router.init_weights(init, f"{prefix}.router", std)
        self.experts.init_weights(init, f"{prefix}.experts", std, out_std)
        if self.shared_experts is not None:
            self.shared_experts.init_weights(init, f"{prefix}.shared_experts", std, out_std)
        with torch.no_grad():
            self.expert_bias.zero_()
            self.reset_stats()

    def reset_stats(self) -> None:
        """Forget the per-step statistics (start of an optimizer step)."""
        self.step_records = []

    @torch.no_grad()
    def step_stats(self, skip: int = 0) -> Tensor:
        """(E + 2,) sums over this step's forwards but the first ``skip`` (forwards beyond the step's
        microbatches, which are not part of its objective): [tokens per expert..., sum of aux * tokens,
        tokens]."""
        records = self.step_records[skip:]
        if not records:
            return self.expert_bias.new_zeros(self.num_experts + 2, dtype=torch.float32)
        return torch.stack(records).sum(0)

    @torch.no_grad()
    def update_bias(self, counts: Tensor) -> None:
        """Aux-loss-free balancing: ``bias += coeff * sign(mean - count)`` from the step's global
        ``counts`` (E,) -- under-loaded experts become more likely to be chosen."""
        if self.bias_update_coeff > 0:
            counts = counts.to(self.expert_bias.dtype)
            self.expert_bias.add_(self.bias_update_coeff * torch.sign(counts.mean() - counts))

    def forward(self, x: Tensor) -> Tensor:
        B, S, H = x.shape  # (B, S, H)
        tokens = x.reshape(B * S, H)  # (T, H)
        weights, indices, scores = self.router(
            tokens, self.expert_bias, self.balanced_routing
        )  # (T, k), (T, k), (T, E)
        host_counts = balanced_counts(indices.numel(), self.num_experts) if self.balanced_routing else None
        counts = (
            torch.bincount(indices.reshape(-1), minlength=self.num_experts)
            if host_counts is None
            else torch.tensor(host_counts, device=indices.device)
        )  # (E,) token copies per expert
        training = self.training and torch.is_grad_enabled()
        aux = self._aux_loss(scores, indices, B, S) if training and self.aux_loss_coeff > 0 else None
        if training and not _recomputing():
            self._record(counts, aux, B * S)
        out = self._routed(tokens, weights, indices, counts, host_counts)  # (T, H)
        if self.shared_experts is not None:
            out = out + self.shared_experts(tokens)
        out = out.view(B, S, H)
        if aux is not None:
            weight = (self.aux_grad_scale * B * S) if self.aux_grad_scale is not None else 1.0
            out = AddAuxGrad.apply(out, aux * (self.aux_loss_coeff * weight))
        return out

    def _routed(
        self,
        tokens: Tensor,
        weights: Tensor,
        indices: Tensor,
        counts: Tensor,
        host_counts: Optional[list[int]],
    ) -> Tensor:
        """Sort the (token, expert) pairs by expert, run the experts, scatter-add weighted outputs.
        ``counts`` (E,): copies per expert; ``host_counts``: the same on the host, or None."""
        T, k = indices.shape
        flat = indices.reshape(-1)  # (T*k,) expert of each copy
        order = torch.argsort(flat, stable=True)  # copies grouped by expert, token order inside
        if self.capacity_factor > 0:
            if host_counts is None:
                order, counts = self._drop_over_capacity(flat, order, counts, T)
            else:
                order, counts, host_counts = self._drop_over_capacity_known(order, host_counts, T)
        token = order // k  # (N,) source token of each sorted copy
        rows = tokens[token]  # (N, H)
        if self.dispatcher is not None:
            out_rows = self.dispatcher(rows, counts, self.experts, host_counts)  # (N, H)
        else:
            out_rows = self.experts(rows, counts, host_counts)  # (N, H)
        w = weights.reshape(-1)[order].unsqueeze(-1).to(out_rows.dtype)  # (N, 1)
        # Under autocast the experts return bf16 copies of fp32 tokens: the k copies of a token are
        # summed in the tokens' dtype (the residual stream's), as a dense MLP's output joins it.
        return tokens.new_zeros(T, tokens.shape[1]).index_add(
            0, token, (out_rows * w).to(tokens.dtype)
        )  # (T, H)

    def _drop_over_capacity(
        self, flat: Tensor, order: Tensor, counts: Tensor, T: int
    ) -> tuple[Tensor, Tensor]:
        """Keep the first ``ceil(cf * T * k / E)`` copies (in token order) of each expert."""
        capacity = math.ceil(self.capacity_factor * T * self.top_k / self.num_experts)
        starts = torch.cumsum(counts, 0) - counts  # (E,)
        pos = torch.arange(order.numel(), device=order.device) - starts[flat[order]]  # (T*k,)
        keep = pos < capacity
        return order[keep], counts.clamp(max=capacity)

    def _drop_over_capacity_known(
        self, order: Tensor, host_counts: list[int], T: int
    ) -> tuple[Tensor, Tensor, list[int]]:
        """``_drop_over_capacity`` for counts known on the host: the kept positions of the sorted
        copies follow from them, with no data-dependent shape."""
        capacity = math.ceil(self.capacity_factor * T * self.top_k / self.num_experts)
        kept = [min(c, capacity) for c in host_counts]
        if kept == host_counts:
            return order, torch.tensor(kept, device=order.device), kept
        device, n = order.device, sum(kept)
        # expert e's copies sit at [S_e, S_e + count_e) of ``order`` and go to [K_e, K_e + kept_e)
        shift = [s - k for s, k in zip(_starts(host_counts), _starts(kept))]  # S_e - K_e
        kept_t = torch.tensor(kept, device=device)
        keep = torch.repeat_interleave(torch.tensor(shift, device=device), kept_t, output_size=n)
        return order[keep + torch.arange(n, device=device)], kept_t, kept

    def _aux_loss(self, scores: Tensor, indices: Tensor, B: int, S: int) -> Tensor:
        """``E / (k T) * sum_e count_e * P_e`` over the forward's tokens ("global") or per sequence
        then averaged ("sequence"); P_e is the mean (normalised) router probability of expert e."""
        E, k = self.num_experts, self.top_k
        probs = (
            scores if self.router.score_func == "softmax" else scores / (scores.sum(-1, keepdim=True) + 1e-20)
        )
        chosen = torch.zeros_like(probs).scatter_(1, indices, 1.0)  # (T, E) one-hot of the top-k
        if self.aux_loss_type == "sequence":
            f = chosen.view(B, S, E).sum(1) * (E / (k * S))  # (B, E)
            return (f * probs.view(B, S, E).mean(1)).sum(-1).mean()
        f = chosen.sum(0) * (E / (k * B * S))  # (E,)
        return (f * probs.mean(0)).sum()

    @torch.no_grad()
    def _record(self, counts: Tensor, aux: Optional[Tensor], num_tokens: int) -> None:
        counts = counts.float()  # (E,) token copies per expert
        aux_sum = aux.detach().float() * num_tokens if aux is not None else counts.new_zeros(())
        self.step_records.append(torch.cat([counts, aux_sum.view(1), counts.new_full((1,), num_tokens)]))


class BlockAttention(Protocol):
    """What ``MoEBlock`` calls on its attention (``build_attention``: Llama's, DeepSeek-V3's MLA)."""

    def init_weights(self, init: ParamInit, prefix: str, std: float, out_std: float) -> None: ...
    def __call__(self, x: Tensor, *, rope_cache: Tensor, positions: Optional[Tensor] = None) -> Tensor: ...


class MoEBlock(nn.Module):
    """Pre-norm decoder block whose feed-forward is an ``MoE`` (MoE layers) or Llama's SwiGLU."""

    def __init__(self, layer_id: int, args: MoEArgs) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.attention = self.build_attention(args)
        self.attention_norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.ffn_norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.moe: Optional[MoE] = MoE(args) if args.is_moe_layer(layer_id) else None
        self.feed_forward: Optional[FeedForward] = (
            None if self.moe is not None else FeedForward(args.dim, args.hidden_dim)
        )

    def build_attention(self, args: MoEArgs) -> BlockAttention:
        """The block's attention; families with another attention (MLA) override this."""
        return Attention(args)  # with q/k head norms when args.qk_norm (Qwen3-MoE)

    def init_weights(self, init: ParamInit, prefix: str, init_std: float) -> None:
        """Llama's scheme; experts like FFN weights (output projections depth-scaled)."""
        out_std = init_std / math.sqrt(2 * (self.layer_id + 1))
        self.attention.init_weights(init, f"{prefix}.attention", init_std, out_std)
        if self.moe is not None:
            self.moe.init_weights(init, f"{prefix}.moe", init_std, out_std)
        elif self.feed_forward is not None:  # always: a block has one of the two
            self.feed_forward.init_weights(init, f"{prefix}.feed_forward", init_std, out_std)
        self.attention_norm.init_weights(init, f"{prefix}.attention_norm")
        self.ffn_norm.init_weights(init, f"{prefix}.ffn_norm")

    def forward(self, x: Tensor, *, rope_cache: Tensor, positions: Optional[Tensor] = None) -> Tensor:
        h = x + self.attention(
            self.attention_norm(x), rope_cache=rope_cache, positions=positions
        )  # (B, S, H)
        ffn = self.moe if self.moe is not None else self.feed_forward
        assert ffn is not None  # a block has one of the two
        return h + ffn(self.ffn_norm(h))  # (B, S, H)


class MoETransformer(Transformer):
    """The Llama decoder with ``MoEBlock`` blocks (pipeline-stage friendly like ``Transformer``)."""

    def build_block(self, layer_id: int, args: Any) -> nn.Module:
        return MoEBlock(layer_id, args)


def moe_layers(model: nn.Module) -> list[tuple[str, MoE]]:
    """The ``MoE`` modules of ``model`` (or a stage of it) with canonical names, in layer order."""
    out = []
    for name, module in model.named_modules():
        if isinstance(module, MoE):
            out.append((unwrapped_name(name), module))
    return out


def expert_modules(model: nn.Module) -> list[GroupedExperts]:
    """The stacked-expert modules of ``model`` (the units expert parallelism shards)."""
    return [m for m in model.modules() if isinstance(m, GroupedExperts)]


# --------------------------------------------------------------------------------------------
# Counting
# --------------------------------------------------------------------------------------------


def param_counts(args: MoEArgs) -> ParamCounts:
    """Parameters of ``MoETransformer(args)``; ``active`` counts the top-k routed experts only."""
    dim, E, Fe = args.dim, args.num_experts, args.moe_hidden_dim
    attention = _attention_params(args) + 2 * dim  # + the two block norms
    dense_ffn = 3 * dim * args.hidden_dim
    expert = 3 * dim * Fe
    shared = 3 * dim * args.num_shared_experts * Fe
    router = dim * E
    n_moe = len(args.moe_layer_ids)
    n_dense = args.n_layers - n_moe
    embedding = args.vocab_size * dim
    head = 0 if args.tie_embeddings else args.vocab_size * dim
    common = (
        embedding + head + dim + args.n_layers * attention + n_dense * dense_ffn + n_moe * (router + shared)
    )
    total = common + n_moe * E * expert
    active = common + n_moe * args.top_k * expert
    return ParamCounts(total=total, active=active, embedding=embedding)


def flops_per_token(args: MoEArgs, seq_len: int) -> int:
    """Training FLOPs per token from the ACTIVE parameters (see ``llama.num_flops_per_token``)."""
    return num_flops_per_token(args, seq_len, param_counts(args))


# --------------------------------------------------------------------------------------------
# The planner's terms (``ModelSpec.planner_terms``)
# --------------------------------------------------------------------------------------------


def ffn_saved(args: MoEArgs, layout: BlockLayout, moe: bool) -> dict[str, float]:
    """What an MoE block's feed-forward saves for backward per local token, after its norm: the routed
    experts see top_k copies of each token (balanced routing): the router's fp32 softmax scores over
    all experts and top-k weights (+ their sum under ``route_norm``), the int64 bookkeeping (top-k
    ids, the sorted order and source token of each copy, the received copies' expert / row /
    position indices), the rows the local experts receive, the four SwiGLU tensors per copy (w1, w3
    outputs, silu, product), the copies back at their tokens and weighted; shared experts are a
    dense SwiGLU. Under bf16 autocast over an fp32 stream (``layout.cast_each``) each of w1 and w3
    saves its own bf16 cast of the rows and the weighted copies stay fp32 (measured, deepseek_v3_debug
    and moe_debug: 1.134 and 1.062 of the plan's saved activations before these terms). A dense block
    (``moe`` false) saves Llama's."""
    if not moe:
        return llama_ffn_saved(args, layout)
    H, k, E, Fe, cb = args.dim, args.top_k, args.num_experts, args.moe_hidden_dim, layout.compute
    # bf16 autocast over an fp32 stream: the w1 and w3 GEMMs each save their own bf16 cast of the
    # gathered fp32 rows, and the weighted copies are fp32 (the stream's dtype) beside the bf16 outputs
    casts, stream = (2, 4) if layout.cast_each else (1, cb)
    terms: dict[str, float] = {
        "router": 4 * E + 4 * k + (4 if args.route_norm and k > 1 else 0),
        "routing_ids": _INT64 * k * 6,
        "expert_rows": casts * cb * k * H,
        "experts": 4 * cb * k * Fe,
        "expert_combine": (cb + stream) * k * H,
    }
    if layout.experts is not None:
        terms.update(_padded_experts_saved(args, layout.experts))
    if args.num_shared_experts:
        terms["shared_experts"] = 4 * cb * args.num_shared_experts * Fe / layout.tp
    return terms


def ffn_norm_consumers(args: MoEArgs, moe: bool) -> int:
    """Matmuls the feed-forward's norm feeds: an MoE layer's router gate and its shared experts' w1 and
    w3 (the routed experts read gathered rows); a dense block's SwiGLU w1 and w3."""
    return 1 + (2 if args.num_shared_experts else 0) if moe else 2


def _padded_rows(args: MoEArgs, groups: ExpertGroups) -> tuple[int, int]:
    """(token copies, rows of the padded grouped GEMMs) of one MoE layer and microbatch: balanced
    routing, so the rank's num_experts / ep experts receive tokens x top_k copies."""
    copies = groups.tokens * args.top_k
    return copies, padded_group_rows(copies, args.num_experts // groups.ep, groups.multiple)


def _padded_experts_saved(args: MoEArgs, groups: ExpertGroups) -> dict[str, float]:
    """The routed experts' terms of ``ffn_saved`` per local token when they run padded in low
    precision (``GroupedExperts._grouped_padded`` under torchao's grouped GEMM): the padded rows in
    the MoE input's dtype (saved once, by the w1 and w3 GEMMs), the four SwiGLU tensors of every
    padded row in the GEMMs' output dtype, the copies' outputs in that dtype with their routing
    weights cast to it (the weighting) and weighted in the tokens' dtype (the scatter-add); the int64
    bookkeeping keeps the top-k ids, the sorted order and source token of each copy and one padded
    row per copy (the E_l int32 group ends are negligible)."""
    H, k, Fe = args.dim, args.top_k, args.moe_hidden_dim
    rows = _padded_rows(args, groups)[1] / groups.tokens  # padded GEMM rows per local token
    return {
        "routing_ids": _INT64 * k * 4,
        "expert_rows": groups.rows_in * rows * H,
        "experts": 4 * groups.out * rows * Fe,
        "expert_combine": k * (groups.out * (H + 1) + groups.rows_in * H),
    }


def expert_padding_flops(args: MoEArgs, groups: ExpertGroups) -> float:
    """Forward matmul FLOPs the padding rows of one MoE layer add per microbatch: w1, w3 and w2
    (2 H Fe each) over the rows beyond the copies."""
    copies, rows = _padded_rows(args, groups)
    return 6.0 * args.dim * args.moe_hidden_dim * (rows - copies)


def planner_terms(args: MoEArgs) -> PlannerTerms:
    """The planner's view of MoE blocks: Llama's attention, the routed feed-forward above."""
    return dataclasses.replace(
        llama_planner_terms(args),
        ffn_saved=functools.partial(ffn_saved, args),
        ffn_norm_consumers=functools.partial(ffn_norm_consumers, args),
        experts_per_token=args.top_k,
        expert_padding_flops=functools.partial(expert_padding_flops, args),
    )


def tp_divisible(args: MoEArgs) -> dict[str, int]:
    sizes = {
        "model.n_heads": args.n_heads,
        "model.n_kv_heads": args.kv_heads,
        "model.vocab_size": args.vocab_size,
    }
    if len(args.moe_layer_ids) < args.n_layers:
        sizes["model FFN hidden size"] = args.hidden_dim
    return sizes


# Attention and dense FFN layers are tensor-parallel as in Llama. The MoE layer runs replicated
# inside the tp group ("moe_io": its input tokens are gathered, its output keeps this rank's share
# of the residual stream): the experts are expert-parallel over the data axes, the router and the
# shared experts are replicated DTensors (q/k head norms: Llama's plan, "head_norm").
TP_PLAN: dict[str, str] = {
    **LLAMA_TP_PLAN,
    "layers.*.moe": "moe_io",
    "layers.*.moe.router.gate": "replicate",
    "layers.*.moe.shared_experts": "replicate",
}
