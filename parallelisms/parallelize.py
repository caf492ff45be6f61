"""The single ordered entry that turns a meta-device model into a parallel one.

Order (DESIGN.md section 2), each step applied only when its axis is active:

1. pipeline split           (pp)           -- parallelisms/pipeline_parallel.py
2. tensor / sequence par.   (tp)           -- parallelisms/tensor_parallel.py
3. expert parallel          (ep)           -- parallelisms/expert_parallel.py
4. activation checkpointing                -- parallelisms/activation_checkpoint.py
5. torch.compile per block
6. FSDP2 / HSDP             (dp_shard[, dp_replicate])  -- parallelisms/fsdp.py
7. materialise: ``to_empty`` + the caller's deterministic ``init_weights``
8. DDP                      (dp_replicate only)         -- parallelisms/ddp.py

Steps 1-6 run on the meta device so no rank ever holds the whole model; DDP comes last
because it broadcasts real weights from the replicate group's first rank.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from parallelisms.config import ParallelismConfig
from parallelisms.parallel_dims import ParallelDims, mesh_view


def parallelize(
    model: nn.Module,
    dims: ParallelDims,
    mesh: DeviceMesh,
    cfg: ParallelismConfig,
    *,
    device: torch.device,
    init_weights: Callable[[nn.Module], None],
    activation_checkpoint: str = "none",
    ac_selective: str = "layer",
    ac_layer_interval: int = 2,
    compile: bool = False,
) -> nn.Module:
    """Apply every active parallelism to ``model`` (built on meta) and materialise it on ``device``."""
    if dims.tp > 1:
        from parallelisms.tensor_parallel import apply_tp

        apply_tp(
            model,
            mesh_view(mesh, "tp"),
            sequence_parallel=cfg.sequence_parallel,
            loss_parallel=cfg.loss_parallel,
            async_tp=cfg.async_tp,
            compile=compile,
            device_type=device.type,
        )
    if activation_checkpoint != "none":
        from parallelisms.activation_checkpoint import apply_ac

        apply_ac(model, activation_checkpoint, selective=ac_selective, layer_interval=ac_layer_interval)
    if compile:
        from parallelisms.compile import apply_compile

        apply_compile(model)
    if dims.fsdp_enabled:
        from parallelisms.fsdp import apply_fsdp

        dp_mesh = (
            mesh_view(mesh, "dp_replicate", "dp_shard_cp")
            if dims.dp_replicate > 1
            else mesh_view(mesh, "dp_shard_cp")
        )
        apply_fsdp(model, dp_mesh, cfg.fsdp, device_type=device.type)

    # With CPU offload FSDP keeps the sharded parameters on the host.
    model.to_empty(device="cpu" if (dims.fsdp_enabled and cfg.fsdp.cpu_offload) else device)
    init_weights(model)

    if dims.ddp_enabled:
        from parallelisms.ddp import apply_ddp
        from parallelisms.utils import to_dtype

        grad_dtype = to_dtype(cfg.ddp.grad_dtype) if cfg.ddp.grad_dtype else None
        model = apply_ddp(
            model,
            mesh_view(mesh, "dp_replicate"),
            impl=cfg.ddp.impl,
            bucket_mb=cfg.ddp.bucket_mb,
            grad_dtype=grad_dtype,
        )
    return model
