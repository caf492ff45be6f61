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

Steps 2-8 are ``parallelize_part``: ``parallelize`` applies it to the whole model, and
``parallelize_pipeline`` (pp > 1) to each pipeline stage this rank owns, so a stage is
tensor-parallel, sharded and replicated exactly like a whole model would be (3-D / 4-D:
pp x dp x tp, with FSDP on this pp rank's dp_shard_cp sub-mesh).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from parallelisms.config import ParallelismConfig
from parallelisms.parallel_dims import ParallelDims, mesh_view

if TYPE_CHECKING:
    from parallelisms.pipeline_parallel import Pipeline


@dataclass
class PartOptions:
    """How to build each part: device, deterministic init, and the per-block steps (AC, compile)."""

    device: torch.device
    init_weights: Callable[[nn.Module], None]
    activation_checkpoint: str = "none"  # none | full | selective
    ac_selective: str = "layer"  # layer | op
    ac_layer_interval: int = 2
    compile: bool = False


def parallelize(
    model: nn.Module, dims: ParallelDims, mesh: DeviceMesh, cfg: ParallelismConfig, options: PartOptions
) -> nn.Module:
    """Apply every active parallelism to ``model`` (built on meta) and materialise it on ``options.device``.

    Without pipeline parallelism this is ``parallelize_part`` on the whole model; with pp > 1
    use ``parallelize_pipeline``.
    """
    if dims.pp > 1:
        raise ValueError("parallelize() handles pp == 1; call parallelize_pipeline() for parallelism.pp > 1")
    return parallelize_part(model, dims, mesh, cfg, options)


def parallelize_part(
    model: nn.Module, dims: ParallelDims, mesh: DeviceMesh, cfg: ParallelismConfig, options: PartOptions
) -> nn.Module:
    """Steps 2-8 on one module (a whole model or a pipeline stage, on meta): TP -> AC -> compile
    -> FSDP -> to_empty + init_weights -> DDP. Mesh views are this rank's sub-meshes."""
    device = options.device
    if dims.tp > 1:
        from parallelisms.tensor_parallel import apply_tp

        apply_tp(
            model,
            mesh_view(mesh, "tp"),
            sequence_parallel=cfg.sequence_parallel,
            loss_parallel=cfg.loss_parallel,
            async_tp=cfg.async_tp,
            compile=options.compile,
            device_type=device.type,
        )
    if options.activation_checkpoint != "none":
        from parallelisms.activation_checkpoint import apply_ac

        apply_ac(
            model,
            options.activation_checkpoint,
            selective=options.ac_selective,
            layer_interval=options.ac_layer_interval,
        )
    if options.compile:
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
    options.init_weights(model)

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


def parallelize_pipeline(
    model: nn.Module,
    dims: ParallelDims,
    mesh: DeviceMesh,
    cfg: ParallelismConfig,
    options: PartOptions,
    *,
    micro_batch_size: int,
    local_batch_size: int,
) -> Pipeline:
    """Step 1 (pp > 1): split ``model`` (on meta) into this rank's stages, ``parallelize_part``
    each, and build the schedule. ``local_batch_size`` = global batch / dp sequences per step.

    FSDP keeps ``cfg.fsdp.reshard_after_forward`` as configured: ``true`` re-gathers a stage's
    parameters for every microbatch's backward (less memory, M times the all-gathers; torchtitan
    turns it off under PP), ``false`` keeps them gathered from forward to backward.
    """
    from parallelisms.pipeline_parallel import apply_pp, validate_pp

    validate_pp(
        model.args, cfg, pp=dims.pp, local_batch_size=local_batch_size, micro_batch_size=micro_batch_size,
        compile=options.compile,
    )  # fmt: skip

    def part_fn(part: nn.Module) -> nn.Module:
        return parallelize_part(part, dims, mesh, cfg, options)

    return apply_pp(
        model, mesh_view(mesh, "pp"), cfg, device=options.device, micro_batch_size=micro_batch_size,
        local_batch_size=local_batch_size, parallelize_part=part_fn,
    )  # fmt: skip
