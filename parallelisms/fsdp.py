"""FSDP2 (ZeRO-2/3) and HSDP via ``torch.distributed.fsdp.fully_shard``.

Each transformer block is its own FSDP unit (one all-gather / reduce-scatter per block,
overlapped with the neighbouring blocks' compute), the final norm and output head form one
unit (as in torchtitan; not with tied embeddings, whose shared weight stays in the root), and
the root wraps what is left. Apply on the meta device: parameters become sharded DTensors
before anything is allocated, so no rank ever holds the whole model;
the caller then runs ``to_empty`` + ``init_weights`` (see parallelize.py).
"""

from __future__ import annotations

from typing import Optional

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from models.spec import ModelSpec
from parallelisms.config import FSDPConfig
from parallelisms.utils import to_dtype


def apply_fsdp(
    model: nn.Module,
    spec: ModelSpec,
    mesh: DeviceMesh,
    cfg: FSDPConfig,
    *,
    reshard_after_forward: bool,
    expert_mesh: Optional[DeviceMesh] = None,
) -> nn.Module:
    """Shard ``model`` over ``mesh``: 1-D = FSDP on dp_shard(_cp); 2-D (replicate, shard) = HSDP.

    ``reshard_after_forward=True`` frees gathered parameters after each block's forward and
    gathers them again in backward (ZeRO-3); ``False`` keeps them until backward (ZeRO-2:
    less communication, more memory). The last block never reshards after forward since
    backward needs it immediately. The units are the spec's repeated blocks, then its last
    modules (final norm + head) together, then the root.

    With ``expert_mesh`` (expert parallel), each block's stacked experts
    (``spec.expert_modules``, DTensors on the ``ep`` mesh) first become their own unit sharded over
    ``expert_mesh`` (dp_shard x cp / ep, x dp_replicate for HSDP): experts and dense parameters
    are reduced over different groups.
    """
    mp_policy = MixedPrecisionPolicy(
        param_dtype=to_dtype(cfg.param_dtype), reduce_dtype=to_dtype(cfg.reduce_dtype)
    )
    offload: OffloadPolicy = CPUOffloadPolicy() if cfg.cpu_offload else OffloadPolicy()
    blocks = [block for _, block in spec.block_items(model)]
    for i, block in enumerate(blocks):
        reshard = reshard_after_forward and i < len(blocks) - 1
        if expert_mesh is not None:
            assert spec.expert_modules is not None  # an expert mesh exists only for an MoE family
            for experts in spec.expert_modules(block):
                fully_shard(
                    experts,
                    mesh=expert_mesh,
                    mp_policy=mp_policy,
                    offload_policy=offload,
                    reshard_after_forward=reshard,
                )
        fully_shard(
            block, mesh=mesh, mp_policy=mp_policy, offload_policy=offload, reshard_after_forward=reshard
        )
    # The head as its own unit: kept gathered after forward (backward needs it at once), and
    # needed by pipeline zero-bubble schedules, whose split weight-gradient pass (W after B)
    # loses the gradients of parameters held by the FSDP root of the last stage (torch 2.13).
    head = [m for m in (getattr(model, name, None) for name in spec.last_modules) if m is not None]
    first = {
        id(p)
        for name in spec.first_modules
        if getattr(model, name, None) is not None
        for p in getattr(model, name).parameters()
    }
    tied = any(id(p) in first for m in head for p in m.parameters())
    if head and not tied:
        fully_shard(head, mesh=mesh, mp_policy=mp_policy, offload_policy=offload, reshard_after_forward=False)
    fully_shard(
        model,
        mesh=mesh,
        mp_policy=mp_policy,
        offload_policy=offload,
        reshard_after_forward=reshard_after_forward,
    )
    return model
