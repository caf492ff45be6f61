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

The arguments (``MoEArgs``) are ``args.py``'s, the stacked experts (``GroupedExperts``) ``experts.py``'s;
this file holds the router, the MoE layer, the blocks, the counts, the planner's terms and the TP plan.
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
from typing import Any, Optional, Protocol

import torch
from torch import Tensor, nn

from models.common import ParamInit, RMSNorm, unwrapped_name
from models.llama.model import TP_PLAN as LLAMA_TP_PLAN
from models.llama.model import Attention, FeedForward, Transformer, _attention_params, num_flops_per_token
from models.llama.model import ffn_saved as llama_ffn_saved
from models.llama.model import planner_terms as llama_planner_terms
from models.moe.args import MoEArgs
from models.moe.experts import GroupedExperts, padded_group_rows
from models.spec import BlockLayout, ExpertGroups, ParamCounts, PlannerTerms

# MoEArgs (models/moe/args.py) and GroupedExperts (models/moe/experts.py) are re-exported: the family's
# arguments and its stacked experts, which other families and the float8 tests import from here.
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
    "param_counts",
    "planner_terms",
]

_INT64 = 8  # bytes of an int64 index


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
    dense SwiGLU, replicated inside the tp group like the whole layer (``TP_PLAN``: every tp rank runs
    the router and all the experts on all its local tokens, so no term divides by ``layout.tp``;
    rehearsed qwen3_5_moe_debug tp=2: 1.085 of the plan while the shared experts were split). Under
    bf16 autocast over an fp32 stream (``layout.cast_each``) each of w1 and w3 saves its own bf16 cast
    of the rows and the weighted copies stay fp32 (measured, deepseek_v3_debug and moe_debug: 1.134
    and 1.062 of the plan's saved activations before these terms). A dense block (``moe`` false)
    saves Llama's."""
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
        terms["shared_experts"] = 4 * cb * args.num_shared_experts * Fe
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
