"""The single ordered entry that turns a meta-device model into a parallel one.

Order (fixed), each step applied only when its axis is active:

1. pipeline split           (pp)           -- parallelisms/pipeline_parallel.py
   float8 / MXFP8 linears   (training.float8) -- parallelisms/float8.py (before TP and FSDP wrap them)
2. tensor / sequence par.   (tp)           -- parallelisms/tensor_parallel.py
3. context parallel         (cp)           -- parallelisms/context_parallel.py (swaps the attention core)
4. expert parallel          (ep)           -- parallelisms/expert_parallel.py
5. activation checkpointing                -- parallelisms/activation_checkpoint.py
6. torch.compile per block                 -- parallelisms/compile.py
7. FSDP2 / HSDP             (dp_shard x cp [, dp_replicate])  -- parallelisms/fsdp.py
8. materialise: ``to_empty`` + the caller's deterministic ``init_weights``
9. DDP                      (dp_replicate [x cp], not under PP) -- parallelisms/ddp.py
   or, with fault tolerance, across torchft replica groups     -- parallelisms/fault_tolerance.py

Steps 1-7 run on the meta device so no rank ever holds the whole model; DDP comes last
because it broadcasts real weights from the replicate group's first rank.

Steps 2-9 are ``parallelize_part``: ``parallelize`` applies it to the whole model, and
``parallelize_pipeline`` (pp > 1) to each pipeline stage this rank owns, so a stage is
tensor-parallel and sharded exactly like a whole model would be (3-D / 4-D: pp x dp x tp).
Replicated pipeline stages are not DDP-wrapped: the ``Pipeline`` averages their gradients
over ``dp_replicate`` once per step, after all microbatches (a DDP wrapper would sync after
each of them). Every strategy takes the model's ``ModelSpec``, never a concrete model class.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import torch
from torch import nn

from models.spec import ModelSpec
from parallelisms.config import ParallelismConfig
from parallelisms.parallel_dims import ParallelDims

if TYPE_CHECKING:
    from parallelisms.fault_tolerance import ReplicaReducer
    from parallelisms.float8 import Float8Plan
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
    attention_mask: str = "causal"  # the model's mask, for the context-parallel attention core
    # Fault tolerance: the collective across torchft replica groups. A group that only replicates
    # (no FSDP, no PP) gets BucketedDDP with it; other layouts all-reduce after backward instead.
    replica_reducer: Optional[ReplicaReducer] = None
    float8: Optional[Float8Plan] = None  # training.float8: the linears to convert (parallelisms/float8.py)


def reshard_after_forward(cfg: ParallelismConfig, dims: ParallelDims) -> bool:
    """FSDP's ``reshard_after_forward``: as configured, else true without PP and false under PP
    (every microbatch reuses a stage's parameters; re-gathering them M times costs M x the
    all-gathers -- torchtitan's default too)."""
    if cfg.fsdp.reshard_after_forward is not None:
        return cfg.fsdp.reshard_after_forward
    return dims.pp == 1


def parallelize(
    model: nn.Module, spec: ModelSpec, dims: ParallelDims, cfg: ParallelismConfig, options: PartOptions
) -> nn.Module:
    """Apply every active parallelism to ``model`` (built on meta) and materialise it on ``options.device``.

    Without pipeline parallelism this is ``parallelize_part`` on the whole model; with pp > 1
    use ``parallelize_pipeline``.
    """
    if dims.pp > 1:
        raise ValueError("parallelize() handles pp == 1; call parallelize_pipeline() for parallelism.pp > 1")
    return parallelize_part(model, spec, dims, cfg, options)


def parallelize_part(
    model: nn.Module,
    spec: ModelSpec,
    dims: ParallelDims,
    cfg: ParallelismConfig,
    options: PartOptions,
    *,
    wrap_ddp: bool = True,
) -> nn.Module:
    """Steps 2-9 on one module (a whole model or a pipeline stage, on meta): TP -> CP -> EP -> AC ->
    compile -> FSDP -> to_empty + init_weights -> DDP (when ``wrap_ddp``). Meshes come from ``dims``."""
    device = options.device
    if options.float8 is not None:
        from parallelisms.float8 import convert_to_low_precision

        convert_to_low_precision(model, options.float8, spec)
    if dims.tp > 1:
        from parallelisms.tensor_parallel import apply_tp

        apply_tp(model, spec, dims.get_mesh("tp"), cfg, device_type=device.type)
    if dims.cp > 1:
        from parallelisms.context_parallel import apply_cp

        apply_cp(
            model,
            dims.cp_mesh,
            impl=cfg.cp_impl,
            load_balance=cfg.cp_load_balance,
            attention_mask=options.attention_mask,
        )
    if dims.ep > 1:
        from parallelisms.expert_parallel import apply_ep

        apply_ep(model, spec, dims)
    if options.activation_checkpoint != "none":
        from parallelisms.activation_checkpoint import apply_ac

        apply_ac(
            model,
            spec,
            options.activation_checkpoint,
            selective=options.ac_selective,
            layer_interval=options.ac_layer_interval,
        )
    if options.compile:
        from parallelisms.compile import apply_compile

        apply_compile(model, spec)
    if dims.fsdp_enabled:
        from parallelisms.fsdp import apply_fsdp

        apply_fsdp(
            model,
            spec,
            dims.fsdp_mesh,
            cfg.fsdp,
            reshard_after_forward=reshard_after_forward(cfg, dims),
            expert_mesh=dims.expert_fsdp_mesh if dims.ep > 1 else None,
        )

    # With CPU offload FSDP keeps the sharded parameters on the host.
    model.to_empty(device="cpu" if (dims.fsdp_enabled and cfg.fsdp.cpu_offload) else device)
    options.init_weights(model)
    if dims.tp > 1 and not dims.fsdp_enabled:
        from parallelisms.tensor_parallel import keep_gradients_sharded

        keep_gradients_sharded(model)

    return _wrap_data_parallel(model, dims, cfg, options) if wrap_ddp else model


def _wrap_data_parallel(
    model: nn.Module, dims: ParallelDims, cfg: ParallelismConfig, options: PartOptions
) -> nn.Module:
    """Step 9: DDP over ``dp_replicate`` (or the fault-tolerant replica groups' reducer)."""
    if dims.ddp_enabled:
        from parallelisms.ddp import apply_ddp
        from parallelisms.utils import to_dtype

        model = apply_ddp(
            model,
            dims.ddp_mesh,
            impl=cfg.ddp.impl,
            bucket_mb=cfg.ddp.bucket_mb,
            grad_dtype=to_dtype(cfg.ddp.grad_dtype) if cfg.ddp.grad_dtype else None,
        )
    elif options.replica_reducer is not None and not dims.fsdp_enabled:
        from parallelisms.ddp import apply_replica_ddp
        from parallelisms.utils import to_dtype

        model = apply_replica_ddp(
            model,
            options.replica_reducer,
            bucket_mb=cfg.ddp.bucket_mb,
            grad_dtype=to_dtype(cfg.ddp.grad_dtype) if cfg.ddp.grad_dtype else None,
        )
    return model


def parallelize_pipeline(
    model: nn.Module,
    spec: ModelSpec,
    dims: ParallelDims,
    cfg: ParallelismConfig,
    options: PartOptions,
    *,
    micro_batch_size: int,
    local_batch_size: int,
    seq_len: int,
    autocast_dtype: Optional[torch.dtype],
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    step_context: Callable[[], AbstractContextManager[object]],
) -> Pipeline:
    """Step 1 (pp > 1): split ``model`` (on meta) into this rank's stages, ``parallelize_part``
    each (without DDP wrappers), and build the schedule. ``local_batch_size`` = global batch /
    dp sequences per step; ``seq_len`` the whole sequence (before context parallelism);
    ``loss_fn(logits, labels)`` is the token-loss sum and ``step_context()`` the context every
    forward/backward runs in (autocast in ``autocast_dtype``, loss parallel)."""
    from parallelisms.pipeline_parallel import apply_pp

    def part_fn(part: nn.Module) -> nn.Module:
        return parallelize_part(part, spec, dims, cfg, options, wrap_ddp=False)

    return apply_pp(
        model,
        spec,
        dims,
        cfg,
        device=options.device,
        micro_batch_size=micro_batch_size,
        local_batch_size=local_batch_size,
        seq_len=seq_len,
        autocast_dtype=autocast_dtype,
        parallelize_part=part_fn,
        loss_fn=loss_fn,
        step_context=step_context,
    )


def model_parts(model: nn.Module | Pipeline) -> list[nn.Module]:
    """The model as a list of parts under the model's own parameter names: the one module without
    pipeline parallelism, this rank's stage modules with it; DDP wrappers (``BucketedDDP``, torch's
    ``DistributedDataParallel``) stripped. The one place that knows the wrappers: the trainer and
    the checkpointer work on these parts (FSDP / TP / compile / checkpoint-wrapped blocks stay
    inside them; ``get_model_state_dict`` names them without those prefixes)."""
    from parallelisms.ddp import BucketedDDP

    parts = [model] if isinstance(model, nn.Module) else list(model.model_parts)  # a Pipeline is no Module
    ddp_types = (BucketedDDP, torch.nn.parallel.DistributedDataParallel)
    return [part.module if isinstance(part, ddp_types) else part for part in parts]
