"""Expert parallel (EP) for mixture-of-experts models, and the MoE step bookkeeping.

Seed article section 8: the E experts of each MoE layer are split over the ``ep`` ranks (E / ep
whole experts each); the dense parameters are untouched by EP. One MoE layer then runs

    router (local)  ->  dispatch: all_to_all the token copies to their experts' ranks
                    ->  local grouped expert compute
                    ->  combine: all_to_all the outputs back, weighted sum per token (local)

Both all_to_all are on the critical path; each moves k copies of every token's hidden state
(k * B * S * H elements per layer and direction).

Layout (``ParallelDims``): ``ep`` is carved out of ``dp_shard x cp`` (inner part of dp_shard), so
an ep group holds different tokens, and the experts' data-parallel group is what is left,
``dp_shard_mod_ep`` (x ``dp_replicate``). ``apply_ep`` makes every stacked expert weight a DTensor
``Shard(0)`` on the ``ep`` mesh and installs an ``AllToAllDispatcher`` in each MoE module; FSDP
(``parallelisms/fsdp.py``) then shards the experts over ``expert_fsdp_mesh`` and the dense
parameters over ``dp_shard_cp`` as usual, so parameters live on two meshes (gradient clipping
groups them by mesh, ``parallelisms/utils.py``; DCP saves each with its own placements).

Gradient scale: every rank's loss is scaled by dp_cp / global tokens and FSDP divides a
gradient by the size of its reduce group. An expert's local gradient already sums the tokens of
its whole ep group (delivered by the backward all_to_all), and its reduce group is ep times
smaller than dp_cp, so the experts scale their weight gradients by 1 / ep
(``GroupedExperts.grad_scale``) -- gloo has no pre-multiplied reduce for FSDP's divide factor.

``LoadBalancer`` is the per-step hook the trainer calls around each optimizer step: it zeroes the
MoE modules' counters, sets the aux-loss gradient weight, all-reduces tokens-per-expert over the
data/context-parallel ranks, moves the aux-loss-free expert bias, and reports the statistics.
"""

from __future__ import annotations

import logging
import math
import re
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Shard

from models.errors import ConfigError
from models.spec import ExpertArgs, ModelArgs, ModelSpec, expert_args
from parallelisms.parallel_dims import ParallelDims

__all__ = ["AllToAllDispatcher", "LoadBalancer", "apply_ep"]

logger = logging.getLogger("meshwright")


# --------------------------------------------------------------------------------------------
# Dispatch / combine
# --------------------------------------------------------------------------------------------


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` with variable splits; backward is the reverse all_to_all."""

    @staticmethod
    def forward(
        ctx: Any, x: Tensor, send: list[int], recv: list[int], group: dist.ProcessGroup, stats: dict, tag: str
    ) -> Tensor:
        ctx.send, ctx.recv, ctx.group, ctx.stats, ctx.tag = send, recv, group, stats, tag
        out = x.new_empty((sum(recv), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), recv, send, group=group)
        _count(stats, f"{tag}_forward", x, send, recv, group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Optional[Tensor], None, None, None, None, None]:
        out = grad.new_empty((sum(ctx.send), *grad.shape[1:]))
        dist.all_to_all_single(out, grad.contiguous(), ctx.send, ctx.recv, group=ctx.group)
        _count(ctx.stats, f"{ctx.tag}_backward", grad, ctx.recv, ctx.send, ctx.group)
        return out, None, None, None, None, None


def _count(
    stats: dict, key: str, x: Tensor, send: list[int], recv: list[int], group: dist.ProcessGroup
) -> None:
    """Bytes this rank hands to / gets from one all_to_all (all, and the part crossing ranks)."""
    row = math.prod(x.shape[1:]) * x.element_size()  # also when this rank sends no rows
    me = dist.get_rank(group)
    for direction, splits in (("sent", send), ("recv", recv)):
        for name, rows in (
            (f"{key}_{direction}_bytes", sum(splits)),
            (f"{key}_{direction}_remote_bytes", sum(splits) - splits[me]),
        ):
            stats[name] = stats.get(name, 0) + rows * row


class AllToAllDispatcher:
    """An MoE module's ``dispatcher`` under expert parallel (see ``models.moe.MoE._routed``).

    ``__call__(rows, counts, experts, host_counts=None)``: ``rows`` (N, H) are this rank's token
    copies sorted by global expert id, ``counts`` (E,) how many go to each expert. The counts are
    exchanged first (so every rank knows its variable receive splits), the rows all_to_all'd to the
    ranks owning their experts (contiguous blocks of E / ep), regrouped by local expert, run through
    ``experts``, put back in arrival order and all_to_all'd home -- in the order they left.

    The splits must be on the host: read from the counts (one sync), or, when the routing gives
    ``host_counts`` (balanced routing, ``MoE.balanced_routing``), computed from them without reading
    a tensor (``fixed_splits``): a rehearsal under FakeTensorMode has no values to read.
    """

    def __init__(self, group: dist.ProcessGroup, ep: int) -> None:
        self.group = group
        self.ep = ep
        self.stats: dict[str, int] = {}  # bytes handed to all_to_all (benchmarks/bench_ep.py)

    def fixed_splits(self, host_counts: list[int]) -> tuple[list[int], list[int], list[int]]:
        """(send splits, receive splits, rows per local expert) of a routing fixed on the host. Such a
        routing is every rank's (balanced routing sends copy j to expert j mod E on every rank, and
        every rank of the group routes equally many copies), so each source sends this rank what
        this rank sends its own experts' owner: its block of ``host_counts``."""
        ep, num_local = self.ep, len(host_counts) // self.ep
        blocks = [host_counts[r * num_local : (r + 1) * num_local] for r in range(ep)]
        mine = blocks[dist.get_rank(self.group)]
        return [sum(b) for b in blocks], [sum(mine)] * ep, [ep * c for c in mine]

    def __call__(
        self, rows: Tensor, counts: Tensor, experts: nn.Module, host_counts: Optional[list[int]] = None
    ) -> Tensor:
        ep = self.ep
        num_local = counts.numel() // ep
        recv_counts = torch.empty_like(counts)
        dist.all_to_all_single(
            recv_counts, counts, group=self.group
        )  # [src * E_l + e]: src's rows for my expert e
        recv_counts = recv_counts.view(ep, num_local)  # (ep, E_l)
        local_counts: Optional[list[int]] = None
        if host_counts is None:
            # One host sync for the splits (all_to_all needs them on the host).
            send_splits, recv_splits = torch.stack(
                [counts.view(ep, num_local).sum(1), recv_counts.sum(1)]
            ).tolist()
        else:
            send_splits, recv_splits, local_counts = self.fixed_splits(host_counts)
        arrived = _AllToAll.apply(
            rows, send_splits, recv_splits, self.group, self.stats, "dispatch"
        )  # (M, H)
        # Regroup (src, e) -> (e, src): each local expert's rows become contiguous.
        segment = torch.repeat_interleave(
            torch.arange(ep * num_local, device=rows.device),
            recv_counts.reshape(-1),
            output_size=sum(recv_splits),
        )  # (M,) segment id src * E_l + e of each arrived row
        key = (segment % num_local) * ep + segment // num_local
        perm = torch.argsort(key, stable=True)  # (M,)
        out = experts(arrived[perm], recv_counts.sum(0), local_counts)  # (M, H) grouped by local expert
        out = out[torch.argsort(perm)]  # back to arrival order
        return _AllToAll.apply(out, recv_splits, send_splits, self.group, self.stats, "combine")  # (N, H)


# --------------------------------------------------------------------------------------------
# apply
# --------------------------------------------------------------------------------------------


def apply_ep(model: nn.Module, spec: ModelSpec, dims: ParallelDims) -> nn.Module:
    """Shard every stacked expert weight of ``model`` (on meta) over the ``ep`` mesh and install
    the all_to_all dispatcher in each MoE module (step 4 of ``parallelize``)."""
    ep_mesh = dims.get_mesh("ep")
    ep = ep_mesh.size()
    # validate_ep lets ep > 1 through for mixture-of-experts families only
    assert spec.expert_modules is not None and spec.moe_layers is not None
    for experts in spec.expert_modules(model):
        for name, param in list(experts.named_parameters(recurse=False)):
            if param.shape[0] % ep != 0:
                raise ConfigError(f"{param.shape[0]} experts are not divisible by parallelism.ep={ep}.")
            # empty_like of a slice keeps a tensor subclass (torchao's MXFP8 training weight wrapper,
            # parallelisms/float8.py: a plain ``torch.empty`` would run the experts in high precision);
            # under TP the experts are Replicate DTensors on the tp mesh (their local block is whole)
            whole = param.to_local() if isinstance(param, DTensor) else param
            local = torch.empty_like(whole.detach().narrow(0, 0, param.shape[0] // ep))
            sharded = DTensor.from_local(
                local, ep_mesh, [Shard(0)], run_check=False, shape=param.shape, stride=param.stride()
            )
            experts.register_parameter(name, nn.Parameter(sharded, requires_grad=param.requires_grad))
        experts.grad_scale = 1.0 / ep
    group = ep_mesh.get_group()
    for _, moe in spec.moe_layers(model):
        moe.dispatcher = AllToAllDispatcher(group, ep)
    return model


# --------------------------------------------------------------------------------------------
# Per-step load balancing and statistics
# --------------------------------------------------------------------------------------------


def _layer_id(name: str) -> int:
    """Block index of an MoE module name such as ``layers.3.moe`` (wrapper prefixes allowed)."""
    match = re.search(r"(?:^|\.)layers\.(\d+)\.", name)
    if match is None:
        raise ValueError(f"MoE module {name!r} is not inside a block ``layers.<i>``")
    return int(match.group(1))


class LoadBalancer:
    """The MoE step hook (the trainer's hook points, ``trainer/hooks.py``): ``begin_step`` before the
    first forward of an optimizer step, ``before_optimizer_step`` after the gradients are complete
    and before ``optimizer.step()``, ``metrics`` on logging steps (collective over pp). Same calls on
    every rank; the step's state argument is not needed here."""

    def __init__(
        self,
        parts: list[nn.Module],
        spec: ModelSpec,
        dims: ParallelDims,
        args: ExpertArgs,
        *,
        tokens_per_step: int,
        forwards_per_step: int,
    ) -> None:
        assert spec.moe_layers is not None  # ``build`` makes a balancer for MoE families only
        self.layers = [(name, moe) for part in parts for name, moe in spec.moe_layers(part)]
        self.num_experts = args.num_experts
        self.n_layers = args.n_layers
        self.moe_layer_ids = [i for i in range(args.n_layers) if args.is_moe_layer(i)]
        self.aux_loss_coeff = args.aux_loss_coeff
        self.dp_group = dims.loss_mesh.get_group() if dims.dp_cp > 1 else None
        self.pp_group = dims.get_mesh("pp").get_group() if dims.pp > 1 else None
        # Weight of one forward's aux term per token: with FSDP/DDP averaging over dp_cp, the
        # summed objective is coeff * (token-weighted mean of the aux losses over the step).
        self.aux_grad_scale = dims.dp_cp / tokens_per_step
        # Forwards of each MoE layer per step (microbatches); any forward beyond them (none today:
        # pipeline stages are built with static shapes, no shape-inference pass) is left out.
        self.forwards_per_step = forwards_per_step
        self._reduced: Optional[Tensor] = None

    @classmethod
    def build(
        cls,
        parts: list[nn.Module],
        spec: ModelSpec,
        dims: ParallelDims,
        args: ModelArgs,
        *,
        tokens_per_step: int,
        forwards_per_step: int,
    ) -> Optional[LoadBalancer]:
        """A balancer for MoE families, None for dense ones."""
        if not spec.has_experts:
            return None
        return cls(
            parts,
            spec,
            dims,
            expert_args(args),
            tokens_per_step=tokens_per_step,
            forwards_per_step=forwards_per_step,
        )

    def begin_step(self, _state: object) -> None:
        for _, moe in self.layers:
            moe.reset_stats()
            moe.aux_grad_scale = self.aux_grad_scale

    @torch.no_grad()
    def before_optimizer_step(self, _state: object) -> None:
        """All-reduce this step's tokens per expert (and aux sums) over dp x cp; move the biases."""
        if not self.layers:
            return
        local = torch.stack(
            [
                moe.step_stats(skip=max(0, len(moe.step_records) - self.forwards_per_step))
                for _, moe in self.layers
            ]
        )  # (L_local, E + 2): tokens per expert, aux * tokens, tokens
        if self.dp_group is not None:
            dist.all_reduce(local, group=self.dp_group)
        for i, (_, moe) in enumerate(self.layers):
            moe.update_bias(local[i, : self.num_experts])
        self._reduced = local

    @torch.no_grad()
    def metrics(self, _state: object, device: torch.device) -> dict[str, Any]:
        """Tokens per expert per layer, max/mean load imbalance, and the aux loss (coeff x token-
        weighted mean, summed over layers) of the last step; all layers, also under pp."""
        E = self.num_experts
        full = torch.zeros(self.n_layers, E + 2, device=device)
        if self._reduced is not None:
            for i, (name, _) in enumerate(self.layers):
                full[_layer_id(name)] = self._reduced[i]
        if self.pp_group is not None:
            dist.all_reduce(full, group=self.pp_group)
        full = full.cpu()
        tokens = {f"layers.{i}": [int(c) for c in full[i, :E].tolist()] for i in self.moe_layer_ids}
        counts = full[self.moe_layer_ids, :E]  # (L_moe, E)
        imbalance = (counts.max(1).values / counts.mean(1).clamp(min=1e-9)).tolist()
        aux = (full[self.moe_layer_ids, E] / full[self.moe_layer_ids, E + 1].clamp(min=1)).sum().item()
        return {
            "aux_loss": self.aux_loss_coeff * aux if self.aux_loss_coeff > 0 else None,
            "moe_imbalance_max": max(imbalance),
            "moe_imbalance_mean": sum(imbalance) / len(imbalance),
            "moe_imbalance": {f"layers.{i}": v for i, v in zip(self.moe_layer_ids, imbalance)},
            "moe_tokens_per_expert": tokens,
        }
