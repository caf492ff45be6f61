"""Context parallel: every sequence is split across the ``cp`` mesh axis; only attention talks.

Seed article section 7: apart from attention every operator is per token, so a rank holding
S / cp tokens of each sequence computes its share of the whole network alone. Attention needs
every key and value:

* ``cp_impl=allgather`` (default; CPU and GPU, any backend incl. gloo): inside each attention
  layer the keys and values of the cp group are all-gathered AFTER RoPE and BEFORE the
  grouped-query expansion (only the kv heads travel, one collective for K and V together);
  the local queries attend to all of them under the mask of their TRUE token indices
  (causal, or block-causal by document), and backward reduce-scatters dK / dV back to their
  owners. This is the Llama 3 paper's design and torchtitan's current one. Per layer and rank
  it moves (cp - 1) / cp x 2 x B x S x n_kv_heads x D elements each way.
* ``cp_impl=ring`` (CUDA only): torch's experimental ``context_parallel`` replaces SDPA with
  ring attention (K/V blocks passed around the ring, online softmax). It supports only the
  causal mask and NCCL, so it is rejected on CPU and with ``model.attention_mask=block_causal``.

Load balance (``cp_load_balance``): with a causal mask, contiguous chunks would give the last
rank ~cp times the attention work of the first. ``headtail`` (default) cuts each sequence into
2 x cp chunks and gives rank r chunks r and 2cp-1-r ("zigzag"), which equalises the work;
``none`` gives rank r the r-th contiguous S / cp tokens.

Wiring (see ``apply_cp`` / ``cp_batch_sharder``): the trainer's ``StepContext.batch_sharder``
cuts inputs, labels and positions of every batch to this rank's tokens (the data loader gives
every rank of a cp group the same batch: its dp rank excludes cp); RoPE and the masks use the
true positions and indices, so the model needs no change beyond its swappable attention core.
Parameters are replicated over cp, so FSDP shards over dp_shard x cp, DDP averages over
dp_replicate x cp, and the loss's token count is summed over dp x cp.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from contextlib import AbstractContextManager as ContextManager
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh

from models.attention import (
    AttentionCore,
    LatentAttentionCore,
    Mask,
    MaskCache,
    MaskSpec,
    RecurrentCore,
    attend,
    compiled_flex_attention,
)
from models.errors import ConfigError
from parallelisms.parallel_dims import cp_chunks

__all__ = [
    "AllGatherAttention",
    "LatentAllGatherAttention",
    "apply_cp",
    "cp_batch_sharder",
    "cp_contexts",
    "gather_sequence",
    "shard_indices",
]

# --------------------------------------------------------------------------------------------
# Layout and batch sharding
# --------------------------------------------------------------------------------------------


def shard_indices(
    seq_len: int, cp: int, rank: int, load_balance: str, device: Optional[torch.device] = None
) -> Tensor:
    """True token indices (S / cp,) that cp rank ``rank`` holds, in its local order.

    ``headtail``: chunks ``rank`` and ``2cp-1-rank`` of 2cp equal chunks; ``none``: chunk ``rank``
    of cp.
    """
    chunks = cp_chunks(cp, load_balance)
    n = seq_len // chunks
    if load_balance == "none":
        return torch.arange(rank * n, (rank + 1) * n, device=device)
    tail = chunks - 1 - rank
    return torch.cat(
        [
            torch.arange(rank * n, (rank + 1) * n, device=device),
            torch.arange(tail * n, (tail + 1) * n, device=device),
        ]
    )


def cp_batch_sharder(cp_mesh: DeviceMesh, load_balance: str) -> Callable[[Any], Any]:
    """A ``StepContext.batch_sharder``: (B, S) inputs / labels / positions (and any other (B, S, ...)
    tensor field) -> this rank's (B, S / cp).

    Positions default to the true indices 0..S-1 (block-causal batches bring their own, which
    restart at every document); they are always returned as (B, S / cp) so that gradient
    accumulation and pipeline microbatching can split them along the batch.
    """
    cp, rank = cp_mesh.size(), cp_mesh.get_local_rank()

    def shard(batch: Any) -> Any:
        B, S = batch.inputs.shape
        device = batch.inputs.device
        positions = batch.positions
        if positions is None:
            positions = torch.arange(S, device=device)
        if positions.dim() == 1:
            positions = positions[None].expand(B, S)
        index = shard_indices(S, cp, rank, load_balance, device)
        # the family's extra per-token inputs (B, S, ...) too (multi-token prediction's shifted ids/targets)
        return dataclasses.replace(
            batch,
            inputs=batch.inputs.index_select(1, index),
            labels=batch.labels.index_select(1, index),
            positions=positions.index_select(1, index),
            extras={k: v.index_select(1, index) for k, v in batch.extras.items()},
        )

    return shard


# --------------------------------------------------------------------------------------------
# All-gather attention
# --------------------------------------------------------------------------------------------

# Non-deprecated names where this torch has them.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class _GatherSequence(torch.autograd.Function):
    """All-gather along a new leading rank dim; backward reduce-scatters (sums) the gradient."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: dist.ProcessGroup) -> Tensor:
        ctx.group = group
        world = dist.get_world_size(group)
        out = x.new_empty((world * x.shape[0], *x.shape[1:]))  # (cp * B, ...): rank-major blocks
        _all_gather_single(out, x.contiguous(), group=group)
        return out.view(world, *x.shape)  # (cp, B, ...)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        # Every rank's queries contributed to every owner's keys: sum the partial dK / dV and
        # give each owner its own slice.
        out = grad.new_empty(grad.shape[1:])
        _reduce_scatter_single(
            out, grad.reshape(-1, *grad.shape[2:]).contiguous(), op=dist.ReduceOp.SUM, group=ctx.group
        )
        return out, None


def gather_sequence(x: Tensor, group: dist.ProcessGroup) -> Tensor:
    """(B, S_local, ...) from every rank of ``group`` -> (B, cp * S_local, ...) in rank order;
    differentiable (backward: reduce-scatter)."""
    g = _GatherSequence.apply(x, group)  # (cp, B, S_local, ...)
    cp, B, S_local = g.shape[:3]
    return g.transpose(0, 1).reshape(B, cp * S_local, *g.shape[3:])


class AllGatherAttention(nn.Module):
    """Context-parallel attention core (``cp_impl=allgather``), swapped into every ``Attention``.

    Receives this rank's q (B, S/cp, nh, D) and k/v (B, S/cp, nkv, D) after RoPE, all-gathers
    K and V over the cp group (one collective: they are stacked), and attends the local
    queries to all keys under the causal (or block-causal) rule of their TRUE indices. The
    mask is built once per batch (one-entry cache shared by all layers); under block-causal
    the positions of all keys are all-gathered once per batch to find their documents.
    """

    def __init__(self, cp_mesh: DeviceMesh, *, load_balance: str, attention_mask: str) -> None:
        super().__init__()
        self.group = cp_mesh.get_group()
        self.cp = cp_mesh.size()
        self.rank = cp_mesh.get_local_rank()
        self.load_balance = load_balance
        self.attention_mask = attention_mask
        self.cache = MaskCache()
        self.flex: Optional[Callable[..., Tensor]] = None
        # collectives and a Python-side cache: kept out of compiled graphs (decorated here, not at
        # class definition, so that importing this module does not import torch._dynamo)
        self._attend = torch.compiler.disable(self._attend_eager)

    def forward(self, q: Tensor, k: Tensor, v: Tensor, *, positions: Optional[Tensor] = None) -> Tensor:
        """q (B, S/cp, nh, D), k/v (B, S/cp, nkv, D) -> (B, S/cp, nh, D)."""
        return self._attend(q, k, v, positions=positions)

    def _attend_eager(self, q: Tensor, k: Tensor, v: Tensor, *, positions: Optional[Tensor] = None) -> Tensor:
        kv = gather_sequence(torch.stack([k, v], dim=2), self.group)  # (B, S, 2, nkv, D)
        return self._attend_gathered(
            q, kv[:, :, 0], kv[:, :, 1], positions
        )  # k/v (B, S, nkv, D) in rank order

    def _attend_gathered(
        self, q: Tensor, k_all: Tensor, v_all: Tensor, positions: Optional[Tensor]
    ) -> Tensor:
        """The local queries over the gathered keys/values, under the mask of their true indices."""
        B, S_local = q.shape[:2]
        use_flex = q.is_cuda
        block = self.attention_mask == "block_causal" and positions is not None
        key = (B, S_local, q.dtype, q.device, use_flex, block)
        mask = self.cache.get(
            positions if block else None, key, lambda: self._build_mask(q, positions if block else None)
        )
        if use_flex and self.flex is None:
            self.flex = compiled_flex_attention()
        return attend(q, k_all, v_all, mask, flex=self.flex if use_flex else None)

    def _build_mask(self, q: Tensor, block_positions: Optional[Tensor]) -> Mask:
        """The mask of the local queries over the gathered keys: causal, and within each packed document
        when ``block_positions`` (the token positions of a block-causal mask) are given."""
        B, S_local = q.shape[:2]
        S = S_local * self.cp
        device = q.device
        q_index = shard_indices(S, self.cp, self.rank, self.load_balance, device)  # (S/cp,)
        k_index = torch.cat(
            [shard_indices(S, self.cp, r, self.load_balance, device) for r in range(self.cp)]
        )  # (S,) keys in gathered (rank) order
        spec = MaskSpec(q_index, k_index)
        if block_positions is not None:
            pos = block_positions.to(device)
            pos = (pos[None] if pos.dim() == 1 else pos).expand(B, S_local).contiguous()
            with torch.no_grad():
                all_pos = gather_sequence(pos, self.group)  # (B, S)
            spec.q_doc = q_index[None] - pos  # (B, S/cp) document start index
            spec.k_doc = k_index[None] - all_pos  # (B, S)
        if q.is_cuda:
            return spec.block_mask(B)
        return spec.additive(q.dtype)

    def extra_repr(self) -> str:
        return (
            f"cp={self.cp}, rank={self.rank}, load_balance={self.load_balance}, "
            f"attention_mask={self.attention_mask}"
        )


class LatentAllGatherAttention(AllGatherAttention):
    """Context-parallel core of multi-head latent attention (``models.attention.LatentAttentionCore``).

    It all-gathers what MLA's keys and values are made of, the per-token latent [normalised KV latent
    (C) | rotated shared RoPE key (R)], and up-projects the gathered latents to per-head keys and values
    locally (``expand``, this rank's ``wkv_b``): C + R numbers per token travel instead of the
    nh * (Dqk + Dv) of the expanded K/V (DeepSeek-V3: 576 vs 40960, 71x fewer). Backward
    reduce-scatters the latents' gradient. The mask is ``AllGatherAttention``'s."""

    def __init__(self, cp_mesh: DeviceMesh, *, load_balance: str, attention_mask: str) -> None:
        super().__init__(cp_mesh, load_balance=load_balance, attention_mask=attention_mask)
        self._attend_latent = torch.compiler.disable(self._attend_latent_eager)

    # the latent core's call (``models.attention.LatentAttentionCore``), not the K/V core's it extends
    def forward(  # type: ignore[override]
        self,
        q: Tensor,
        latent: Tensor,
        *,
        expand: Callable[[Tensor], tuple[Tensor, Tensor]],
        positions: Optional[Tensor] = None,
    ) -> Tensor:
        """q (B, S/cp, nh, Dqk), latent (B, S/cp, 1, C + R) -> (B, S/cp, nh, Dv)."""
        return self._attend_latent(q, latent, expand=expand, positions=positions)

    def _attend_latent_eager(
        self,
        q: Tensor,
        latent: Tensor,
        *,
        expand: Callable[[Tensor], tuple[Tensor, Tensor]],
        positions: Optional[Tensor] = None,
    ) -> Tensor:
        latent_all = gather_sequence(latent, self.group)  # (B, S, 1, C + R) in rank order
        k_all, v_all = expand(latent_all)  # (B, S, nh, Dqk), (B, S, nh, Dv)
        return self._attend_gathered(q, k_all, v_all, positions)


# --------------------------------------------------------------------------------------------
# Recurrent cores: the state hand-off
# --------------------------------------------------------------------------------------------


class AllGatherHandoff:
    """The ``StateHandoff`` of context parallelism (``models/attention.py``) for recurrent cores (linear
    attention, ``RecurrentCore``): each cp rank holds a contiguous slice, in rank order
    (``cp_load_balance=none``). ``previous`` all-gathers a small tensor (a convolution's last inputs)
    and returns the previous rank's; ``incoming_state`` all-gathers every rank's effect on a handed-in
    state (``final = m @ S0 + s``) and folds the previous ranks' in order: the two-pass form (local
    passes from zero, one collective, the scan from the combined state), so the ranks work in
    parallel instead of waiting for each other. Both are differentiable (backward reduce-scatters).
    The first rank gets zeros (as from no hand-off)."""

    def __init__(self, cp_mesh: DeviceMesh) -> None:
        self.group = cp_mesh.get_group()
        self.rank = cp_mesh.get_local_rank()

    # The first rank has nothing before it, yet returns zeros computed FROM the gathered tensor: every
    # rank's backward must run each all-gather's reduce-scatter (a collective), so its output stays in
    # the graph everywhere.

    def previous(self, x: Tensor) -> Optional[Tensor]:
        gathered = _GatherSequence.apply(x, self.group)  # (cp, ...)
        return gathered[self.rank - 1] if self.rank > 0 else gathered[0] * 0

    def incoming_state(self, m: Tensor, s: Tensor) -> Optional[Tensor]:
        dk = m.shape[-1]
        both = _GatherSequence.apply(torch.cat([m, s], dim=-1), self.group)  # (cp, B, h, dk, dk + dv)
        state = both[0][..., dk:] * 0  # the first rank's: zero
        for j in range(self.rank):
            state = both[j][..., :dk] @ state + both[j][..., dk:]
        return state


# --------------------------------------------------------------------------------------------
# Entry points
# --------------------------------------------------------------------------------------------


def apply_cp(
    model: nn.Module, cp_mesh: DeviceMesh, *, impl: str, load_balance: str, attention_mask: str
) -> int:
    """Step 3 of ``parallelize``: swap every default attention core for the all-gather core
    (one instance shared by the model's layers). ``impl=ring`` leaves the model alone (torch's
    ring attention replaces SDPA inside the step context, see ``cp_contexts``). Returns the
    number of attention modules changed."""
    if impl == "ring":
        return 0
    core = AllGatherAttention(cp_mesh, load_balance=load_balance, attention_mask=attention_mask)
    latent_core = LatentAllGatherAttention(cp_mesh, load_balance=load_balance, attention_mask=attention_mask)
    handoff = AllGatherHandoff(cp_mesh)
    changed = 0
    for module in list(model.modules()):
        current = getattr(module, "core", None)
        if isinstance(current, AttentionCore):
            module.core = core
            changed += 1
        elif isinstance(current, LatentAttentionCore):  # MLA: gather the latents, expand locally
            module.core = latent_core
            changed += 1
        elif isinstance(current, RecurrentCore):  # linear attention: the state crosses the ranks
            current.handoff = handoff
            changed += 1
    if changed == 0:
        raise ConfigError(
            f"context parallel found no attention core to replace in {type(model).__name__}: its attention "
            "modules must keep their attention in a `core` attribute (models/attention.py AttentionCore)."
        )
    return changed


def cp_contexts(cp_mesh: DeviceMesh, *, impl: str, load_balance: str) -> list[Callable[[], ContextManager]]:
    """Context factories a step enters: torch's ring-attention dispatch for ``impl=ring``
    (the batch is already sharded head-tail by ``cp_batch_sharder``), nothing for allgather."""
    if impl != "ring":
        return []
    from torch.distributed.tensor.experimental import context_parallel
    from torch.distributed.tensor.experimental._attention import _cp_options

    # torch's ring attention assumes its own head-tail layout when load balancing is on; ours is
    # the same zigzag (chunks r and 2cp-1-r), so the two must agree.
    _cp_options.enable_load_balance = load_balance == "headtail"

    def ring() -> ContextManager:
        return context_parallel(cp_mesh)

    return [ring]
