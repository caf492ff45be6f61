"""What the ``Trainer`` (``trainer/train.py``) builds, as functions of their inputs: the device
(``resolve_device``), the launch memory check (``check_memory``), the process group
(``init_process_group``), the run's data (``load_data``: the tokenizer, the training and validation
loaders, the named validation sets, the task evaluator), the parallelised model of this rank
(``build_model``: the meta model, the step context with context parallelism, ``parallelize`` or the
pipeline, the chunked loss's head, the parameter list) and the start-up summary (``log_summary``).
None of them holds a reference to the Trainer: it calls them in its fixed order and keeps what they
return (a rehearsal, ``trainer/rehearse_trainer.py``, overrides the Trainer's methods around them)."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Optional, Union

import torch
import torch.distributed as dist
from torch import nn

from models.common import OutputHead
from models.cpu_gemm import resolve_cpu_gemm, use_onednn_linears
from models.errors import ConfigError
from parallelisms.parallel_dims import MESH_DIM_NAMES
from parallelisms.parallelize import PartOptions, model_parts, parallelize, parallelize_pipeline
from trainer.data import DataLoader, build_dataloader
from trainer.data.tokenizer import Tokenizer, build_tokenizer, check_vocab_size
from trainer.eval.config import validation_sources
from trainer.eval.evaluator import TaskEvaluator
from trainer.eval.validation import build_validation_loaders
from trainer.resilience.watchdog import configure_flight_recorder
from trainer.step import StepContext, TokenLoss

if TYPE_CHECKING:
    from models.spec import ModelSpec
    from parallelisms.config import ParallelismConfig
    from parallelisms.fault_tolerance import ReplicaReducer
    from parallelisms.float8 import Float8Plan
    from parallelisms.parallel_dims import ParallelDims
    from parallelisms.pipeline_parallel import Pipeline
    from trainer.config import TrainConfig
    from trainer.data.batch_ramp import BatchRamp

__all__ = [
    "BuiltModel",
    "RunData",
    "build_model",
    "check_memory",
    "defer_heads",
    "init_process_group",
    "load_data",
    "log_summary",
    "resolve_device",
]

logger = logging.getLogger("meshwright")


def resolve_device(kind: str, local_rank: int) -> torch.device:
    """The device this rank computes on."""
    if kind == "cuda" or (kind == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise ConfigError("training.device=cuda but no CUDA device is visible; use training.device=cpu.")
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def check_memory(
    cfg: TrainConfig, parallelism: ParallelismConfig, dims: ParallelDims, device: torch.device
) -> None:
    """Plan the layout ``parallelism`` (validated as ``dims``) in-process (trainer/planner/fit.py) and
    stop (exit 2), or warn, before any collective when a rank needs more than its GPU or its share of
    the host RAM."""
    import dataclasses

    from trainer.planner.fit import run_check

    resolved = dataclasses.replace(parallelism, dp_shard=dims.dp_shard)  # dp_shard=-1 resolved
    cfg = dataclasses.replace(cfg, parallelism=resolved)
    result = run_check(cfg, device, logger.warning, dims=dims)  # the layout validated once
    if result is not None and result.fits:
        logger.info(f"memory check: the plan needs {result.need_bytes / 2**30:.2f} GiB per rank (fits)")


def init_process_group(cfg: TrainConfig, device: torch.device) -> bool:
    """Deterministic algorithms when ``training.deterministic``, then the default process group unless
    one exists (torchrun's, or a one-process group for plain ``python trainer/main.py``); returns
    whether this call created it (its owner destroys it at the end)."""
    if cfg.training.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
    owns = not dist.is_initialized()
    if owns:
        backend = "nccl" if device.type == "cuda" else "gloo"
        # before any group exists: the flight recorder reads its settings at group creation
        configure_flight_recorder(cfg.job.dump_folder, cfg.comm.trace_buffer_size)
        if "MASTER_ADDR" in os.environ:
            dist.init_process_group(backend, timeout=timedelta(seconds=cfg.comm.init_timeout_s))
        else:  # plain `python trainer/main.py`: a one-process group, no network
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    return owns


@dataclass
class RunData:
    """The run's data, read and tokenized before any collective (a bad path fails on every rank)."""

    tokenizer: Tokenizer
    train_loader: DataLoader
    val_loader: Optional[DataLoader]  # training.eval_freq > 0
    named_val_loaders: dict[str, tuple[DataLoader, int]]  # eval.validation: name -> (loader, batches)
    task_evaluator: Optional[TaskEvaluator]  # eval.tasks


def load_data(
    cfg: TrainConfig, dims: ParallelDims, rank: int, batch_size: int, ramp: Optional[BatchRamp]
) -> RunData:
    """The tokenizer and the loaders: training (``batch_size`` sequences per step over the dp ranks,
    ``ramp``: training.batch_ramp), validation, named validation sets and tasks."""
    t = cfg.training
    tokenizer = build_tokenizer(cfg.data.tokenizer)
    check_vocab_size(tokenizer, cfg.model.vocab_size)
    dp_rank = dims.dp_rank_of(rank)  # the mesh confirms it once built
    train_loader = build_dataloader(
        cfg.data,
        tokenizer,
        split="train",
        seq_len=t.seq_len,
        global_batch_size=batch_size,
        dp_rank=dp_rank,
        dp_size=dims.dp,
        seed=t.seed,
        ramp=ramp,
    )
    val_loader: Optional[DataLoader] = None
    if t.eval_freq > 0:
        val_loader = build_dataloader(
            cfg.data,
            tokenizer,
            split="validation",
            seq_len=t.seq_len,
            global_batch_size=t.micro_batch_size * dims.dp,
            dp_rank=dp_rank,
            dp_size=dims.dp,
            seed=t.seed,
        )
    # Named validation sets (eval.validation), each its own loss, at the same steps.
    named_val_loaders = (
        build_validation_loaders(
            validation_sources(cfg.eval),
            cfg.data,
            tokenizer,
            seq_len=t.seq_len,
            batch_size=t.micro_batch_size * dims.dp,
            dp_rank=dp_rank,
            dp_size=dims.dp,
            seed=t.seed,
            default_steps=t.eval_steps,
        )
        if t.eval_freq > 0
        else {}
    )
    # Downstream tasks (eval.tasks): read and tokenized here, so a bad file fails on every rank.
    # Rows are padded to a multiple of what context / sequence parallelism split.
    align = dims.seq_len_divisor(cfg.parallelism.cp_load_balance, cfg.parallelism.sequence_parallel)
    task_evaluator = TaskEvaluator.build(
        cfg.eval, tokenizer, max_seq_len=cfg.model.max_seq_len, align=align, default_freq=t.eval_freq
    )
    return RunData(tokenizer, train_loader, val_loader, named_val_loaders, task_evaluator)


@dataclass
class BuiltModel:
    """This rank's parallelised model. ``model`` runs the step: the module (DDP-wrapped when
    replicated) or, under PP, this rank's ``pipeline`` (its stages + the schedule). ``model_parts``:
    the unwrapped modules (one without PP, this rank's stages with PP) that everything else takes:
    train/eval mode, the optimizer, gradient clipping, the load balancer and the checkpointer."""

    model: Union[nn.Module, Pipeline]
    pipeline: Optional[Pipeline]
    model_parts: list[nn.Module]
    parameters: list[nn.Parameter]  # every parameter of the parts, each once
    step_context: StepContext
    full_shapes: dict[str, torch.Size]  # the full (unsharded) shapes of the state, for the checkpointer


def build_model(
    cfg: TrainConfig,
    spec: ModelSpec,
    dims: ParallelDims,
    p: ParallelismConfig,
    device: torch.device,
    *,
    init_weights: Callable[[nn.Module], None],
    float8: Optional[Float8Plan],
    replica_reducer: Optional[ReplicaReducer],
    attention_mask: str,
    local_batch_size: int,
) -> BuiltModel:
    """The model on meta -> parallelize (or the pipeline) under the layout ``p`` -> materialised on
    ``device`` with ``init_weights``; in training mode."""
    t = cfg.training
    with torch.device("meta"):
        model = spec.build(cfg.model)
    if resolve_cpu_gemm(
        t.cpu_gemm, device.type
    ):  # before the wrappers: float8 / TP / FSDP see ordinary nn.Linear subclasses
        logger.info("training.cpu_gemm: %d linears run oneDNN's fp32 GEMMs", use_onednn_linears(model))
    full_shapes = {k: v.shape for k, v in model.state_dict().items()}  # before any wrapper renames
    options = PartOptions(
        device=device,
        init_weights=init_weights,
        activation_checkpoint=t.activation_checkpoint,
        ac_selective=t.ac_selective,
        ac_layer_interval=t.ac_layer_interval,
        compile=t.compile,
        attention_mask=attention_mask,
        replica_reducer=replica_reducer,
        float8=float8,
    )
    step_context = StepContext(
        device_type=device.type,
        autocast_dtype=torch.bfloat16 if t.mixed_precision == "bf16" else None,
        loss_parallel=dims.tp > 1 and p.loss_parallel,
        loss=TokenLoss(t.z_loss_weight),
    )
    if dims.cp > 1:
        # Context parallel: every batch is cut to this rank's (head-tail) share of each
        # sequence, and ring attention (cp_impl=ring) enters with the step.
        from parallelisms.context_parallel import cp_batch_sharder, cp_contexts

        cp_mesh = dims.cp_mesh
        step_context.batch_sharder = cp_batch_sharder(cp_mesh, p.cp_load_balance)
        step_context.extra.extend(cp_contexts(cp_mesh, impl=p.cp_impl, load_balance=p.cp_load_balance))
    pipeline: Optional[Pipeline] = None
    runner: Union[nn.Module, Pipeline]
    if dims.pp > 1:
        pipeline = parallelize_pipeline(
            model,
            spec,
            dims,
            p,
            options,
            micro_batch_size=t.micro_batch_size,
            local_batch_size=local_batch_size,
            seq_len=t.seq_len,
            autocast_dtype=step_context.autocast_dtype,
            loss_fn=step_context.loss,
            step_context=step_context,
        )
        runner = pipeline
    else:
        runner = parallelize(model, spec, dims, p, options)
    parts = model_parts(runner)
    if t.loss_chunk_size > 0:  # the loss runs the (deferred) head chunk by chunk: no (B, S, V) logits
        # one head per rank (DeepSeek-V3's MTP shares it); None: a pipeline stage without the head
        head = next((m for part in parts for m in part.modules() if isinstance(m, OutputHead)), None)
        step_context.loss.chunk_size = t.loss_chunk_size
        step_context.loss.head = head
        defer_heads(step_context.loss, True)
    for part in parts:
        part.train(True)
    parameters = list(dict.fromkeys(q for part in parts for q in part.parameters()))
    return BuiltModel(runner, pipeline, parts, parameters, step_context, full_shapes)


def defer_heads(loss: TokenLoss, deferred: bool) -> None:
    """``training.loss_chunk_size``: the models return hidden states for the chunked loss (True) or
    logits (False: task evaluation scores the logits themselves)."""
    head = loss.head
    if isinstance(head, OutputHead):
        head.deferred = deferred


def log_summary(
    cfg: TrainConfig,
    spec: ModelSpec,
    dims: ParallelDims,
    world_size: int,
    device: torch.device,
    accumulation: str,
    float8: Optional[Float8Plan],
) -> Optional[dict[str, object]]:
    """Log the run at start-up: the model, the layout in the mesh's order, the batch and
    ``accumulation`` (the pipeline's microbatches or the accumulation steps), the device; under
    ``training.float8`` which linears run in float8. Returns the float8 summary (None when off)."""
    t = cfg.training
    counts = spec.param_counts(cfg.model)
    active = f" ({counts.active / 1e6:.2f}M active)" if counts.active != counts.total else ""
    degrees = " x ".join(f"{name} {getattr(dims, name)}" for name in MESH_DIM_NAMES)  # the mesh's order
    logger.info(
        f"model {cfg.model.name} ({spec.family}): {counts.total / 1e6:.2f}M params{active} | world "
        f"{world_size} = {degrees} | global batch "
        f"{t.global_batch_size} x {t.seq_len} tokens, micro batch "
        f"{t.micro_batch_size}, {accumulation} | device {device}"
    )
    if float8 is None:
        return None
    f8 = float8.summary()
    logger.info(
        f"float8 {f8['recipe']} (emulate={f8['emulate']}, fsdp_float8_all_gather="
        f"{f8['fsdp_float8_all_gather']}): {f8['converted']} linears converted: "
        + ", ".join(float8.linears)
        + (f"; {f8['experts_converted']} stacked experts: " + ", ".join(float8.experts))
        * bool(float8.experts)
    )
    return f8
