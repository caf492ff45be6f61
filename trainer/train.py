"""The Trainer: builds everything in the fixed order (config -> dims -> process group ->
model -> parallelize -> optimizer -> checkpoint) and runs the loop."""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional

import torch
import torch.distributed as dist
from torch import nn

from models import get_spec
from models.cpu_gemm import resolve_cpu_gemm
from parallelisms.float8 import Float8Plan, plan_float8
from parallelisms.utils import clip_grad_norm_, complete_partial_grads, copy_full_into
from parallelisms.validate import validated_dims
from trainer.checkpoint.checkpointer import Checkpointer, describe_layout, model_info
from trainer.checkpoint.seed import seed_parallelism, validate_checkpoint_config
from trainer.config import CheckpointConfig, TrainConfig, to_yaml
from trainer.data import DataLoader
from trainer.data.step_shape import StepShape
from trainer.eval.evaluator import TaskResult
from trainer.eval.scoring import ROW_STATS, row_stats
from trainer.hooks import HookContext, build_step_hooks
from trainer.observe.metrics import MetricsLogger, setup_logging
from trainer.observe.profiling import StepProfiler
from trainer.optim import build_lr_scheduler, build_optimizer, check_optimizer_layout, optimizer_layout
from trainer.resilience.fault_tolerance import (
    FaultTolerance,
    check_environment,
    group_batch_size,
    group_parallelism,
)
from trainer.resilience.guards import install_test_nan_hook, non_finite_message
from trainer.resilience.preemption import PreemptionHandler
from trainer.resilience.watchdog import CommMonitor
from trainer.stability import SpikeWindow
from trainer.step import (
    StepBatch,
    StepState,
    count_targets,
    document_positions,
)
from trainer.train_build import (
    build_model,
    check_memory,
    defer_heads,
    init_process_group,
    load_data,
    log_summary,
    resolve_device,
)

if TYPE_CHECKING:  # imported when pp > 1 (torch.distributed.pipelining costs ~1 s to import)
    from torch.distributed.checkpoint.stateful import Stateful

    from parallelisms.pipeline_parallel import Pipeline

logger = logging.getLogger("meshwright")


class TrainingError(RuntimeError):
    """The run cannot continue (e.g. a non-finite loss); raised on every rank together."""


@dataclass
class TrainState:
    """What the loop has done so far (checkpointed)."""

    step: int = 0
    tokens_seen: int = 0
    history: list[dict[str, Any]] = field(default_factory=list)
    spike: Optional[SpikeWindow] = None  # training.spike: the window of accepted steps (trainer/stability.py)


def _env_int(name: str, default: int) -> int:
    return int(os.environ.get(name, default))


class Trainer:
    """One training run. Construction validates and builds; ``train()`` runs the loop."""

    def __init__(self, cfg: TrainConfig) -> None:
        self.cfg = cfg
        self.rank = _env_int("RANK", 0)
        self.world_size = _env_int("WORLD_SIZE", 1)
        setup_logging(self.rank)
        self.spec = get_spec(cfg.model.family)
        self._validate_and_load_data()  # 1. everything that needs no process group
        self._init_process_group()  # 2. process group and mesh
        self.ft: Optional[FaultTolerance] = (
            None  # torchft replica groups (trainer/resilience/fault_tolerance.py)
        )
        if cfg.parallelism.fault_tolerance.enable:
            self.ft = FaultTolerance(
                cfg,
                rank=self.rank,
                world_size=self.world_size,
                device=self.device,
                dump_folder=cfg.job.dump_folder,
            )
        self._build_operations()  # timeouts, preemption, profiling
        self._write_run_folder()  # 3. run folder, identical on every rank
        full_shapes = self._build_model()  # 4. model on meta -> parallelize -> deterministic weights
        self._build_optimizer()  # 5. optimizer and schedule
        self._build_checkpointer(full_shapes)  # 6. resume from the newest complete checkpoint
        self._build_metrics()
        self._log_summary()

    # -- construction ---------------------------------------------------------------
    def _validate_and_load_data(self) -> None:
        """Every check that needs no process group, then the data (read and tokenized before any
        collective, so a bad path fails on every rank)."""
        cfg, t = self.cfg, self.cfg.training
        validate_checkpoint_config(cfg.checkpoint, self.world_size)
        self.parallelism = (
            seed_parallelism(cfg.parallelism) if cfg.checkpoint.create_seed else cfg.parallelism
        )
        # Fault tolerance: this process is one replica group; dp_replicate counts the groups.
        check_environment(cfg)
        self.parallelism = group_parallelism(self.parallelism)
        self.batch_size = group_batch_size(
            cfg.parallelism, t.global_batch_size
        )  # this group's sequences per step
        self.device = resolve_device(t.device, _env_int("LOCAL_RANK", 0))
        self.dims = validated_dims(
            self.parallelism,
            self.world_size,
            spec=self.spec,
            model_args=cfg.model,
            seq_len=t.seq_len,
            global_batch_size=self.batch_size,
            micro_batch_size=t.micro_batch_size,
            compile=t.compile,
            device_type=self.device.type,
        )
        self.spec.device_check(cfg.model, self.device.type)  # e.g. an optional kernel forced without CUDA
        resolve_cpu_gemm(
            t.cpu_gemm, self.device.type
        )  # training.cpu_gemm=onednn refused where torch lacks it
        # The optimizer registry: does this optimizer run under this layout? (before any process group)
        check_optimizer_layout(
            cfg.optimizer.name, optimizer_layout(self.dims, self.parallelism), cfg.optimizer
        )
        _ = self.float8  # training.float8: every check (before any process group), the linears to convert
        self.grad_accum_steps = self.dims.grad_accum_steps(self.batch_size, t.micro_batch_size)
        # training.batch_ramp / training.seq_len_warmup: each step's rows and their cut
        divisor = self.dims.seq_len_divisor(
            self.parallelism.cp_load_balance, self.parallelism.sequence_parallel
        )
        self.step_shape = StepShape(t, self.batch_size, self.dims.dp, divisor)
        if not cfg.checkpoint.create_seed:  # metrics.memory_check: will this layout fit on this host?
            check_memory(cfg, self.parallelism, self.dims, self.device)
        self._load_data()

    def _load_data(self) -> None:
        """The tokenizer and the loaders: training, validation, named validation sets and tasks
        (``trainer/train_build.py``; a rehearsal, ``trainer/rehearse_trainer.py``, replaces them with
        synthetic batches of the same shapes)."""
        data = load_data(self.cfg, self.dims, self.rank, self.batch_size, self.step_shape.ramp)
        self.tokenizer, self.train_loader = data.tokenizer, data.train_loader
        self.val_loader: Optional[DataLoader] = data.val_loader
        self.named_val_loaders, self.task_evaluator = data.named_val_loaders, data.task_evaluator

    def _init_process_group(self) -> None:
        self._owns_process_group = init_process_group(self.cfg, self.device)  # trainer/train_build.py
        self.dims.build_mesh(self.device.type)
        torch.manual_seed(self.cfg.training.seed)

    def _build_operations(self) -> None:
        """Collective timeouts + hang reports (trainer/resilience/watchdog.py), SIGTERM/SIGUSR1
        (trainer/resilience/preemption.py,
        collective: every rank builds it) and the profiler."""
        cfg = self.cfg
        self.comm = CommMonitor(
            cfg.comm, rank=self.rank, world_size=self.world_size, dump_folder=cfg.job.dump_folder
        )
        self.preemption = PreemptionHandler(
            rank=self.rank, world_size=self.world_size, timeout_s=cfg.comm.init_timeout_s
        )
        self.profiler = StepProfiler(
            cfg.profiling, dump_folder=cfg.job.dump_folder, rank=self.rank, device=self.device
        )

    def _write_run_folder(self) -> None:
        """Only rank 0 writes into the run folder (the same path on every rank); a replica group
        writes its config and metrics into its own subfolder."""
        self.log_folder = self.ft.folder if self.ft is not None else self.cfg.job.dump_folder
        if self.rank == 0:
            os.makedirs(self.log_folder, mode=0o750, exist_ok=True)
            with open(os.path.join(self.log_folder, "config.yaml"), "w", encoding="utf-8") as f:
                f.write(to_yaml(self.cfg))

    @property
    def local_batch_size(self) -> int:
        """Sequences per step on this rank (this group's batch over the data-parallel ranks)."""
        return self.dims.local_batch_size(self.batch_size)

    def _step_tokens(self) -> int:
        """Tokens of the step just taken: fault tolerance's count, a batch ramp's stage, or the batch's."""
        if self.ft is not None:
            return self.ft.step_tokens
        tokens = self.step_shape.step_tokens(self.train_loader.last_step_samples)
        if tokens is None:
            return self.tokens_per_step
        self.metrics.tokens_per_step = tokens  # tokens/s at a stage boundary: the new stage's size
        return tokens

    @property
    def tokens_per_step(self) -> int:
        """Tokens of this replica group's batch per step."""
        return self.batch_size * self.cfg.training.seq_len

    @property
    def attention_mask(self) -> str:
        """The attention mask of the family's args (``ModelSpec.attention_mask``: causal by default)."""
        return self.spec.attention_mask(self.cfg.model)

    @functools.cached_property
    def float8(self) -> Optional[Float8Plan]:
        """``training.float8``'s plan (None when off): checked on the meta model; the linears to convert."""
        t = self.cfg.training
        return plan_float8(
            t.float8,
            self.parallelism,
            self.dims,
            self.device,
            self.spec,
            self.cfg.model,
            compute_dtype=torch.bfloat16 if t.mixed_precision == "bf16" else torch.float32,
        )

    def _build_model(self) -> dict[str, torch.Size]:
        """This rank's parallelised model (``trainer/train_build.py``); returns the full (unsharded)
        shapes of the model's state, for the checkpointer."""
        built = build_model(
            self.cfg,
            self.spec,
            self.dims,
            self.parallelism,
            self.device,
            init_weights=self._init_weights,
            float8=self.float8,
            replica_reducer=self.ft.replica_reducer if self.ft is not None else None,
            attention_mask=self.attention_mask,
            local_batch_size=self.local_batch_size,
        )
        self.step_context, self.model = built.step_context, built.model
        self.pipeline: Optional[Pipeline] = built.pipeline
        self.model_parts, self.parameters = built.model_parts, built.parameters
        return built.full_shapes

    def _init_weights(self, model: nn.Module) -> None:
        """The deterministic initialisation of a materialised part (the same weights under any layout)."""
        model.init_weights(seed=self.cfg.training.seed, copy_fn=copy_full_into)

    def _build_optimizer(self) -> None:
        p = self.parallelism
        shard_mesh = (
            self.dims.get_mesh("dp_replicate")
            if (self.dims.ddp_enabled and p.ddp.sharded_optimizer)
            else None
        )
        self.optimizer = build_optimizer(
            self.model_parts,
            self.cfg.optimizer,
            device_type=self.device.type,
            shard_mesh=shard_mesh,
            adamw_modules=self.spec.first_modules + self.spec.last_modules,
            layout=optimizer_layout(self.dims, p),
            lr_scale=self.spec.lr_scale(self.cfg.model),  # µP's per-group LRs (model.mup); None: off
        )
        self.lr_scheduler = build_lr_scheduler(self.optimizer, self.cfg.lr_scheduler, self.cfg.training.steps)
        spike = self.cfg.training.spike
        self.state = TrainState(spike=SpikeWindow(spike) if spike.enable else None)
        # test-only (trainer/resilience/guards.py): MESHWRIGHT_TEST_NAN_AT=<rank>@<step> injects a NaN
        install_test_nan_hook(self.model, self.rank, lambda: self.state.step + 1)

    def _build_checkpointer(self, full_shapes: dict[str, torch.Size]) -> None:
        if self.ft is not None:  # semi_sync: DiLoCo over the inner optimizer (its state is checkpointed)
            self.ft.build_semi_sync(self.model_parts, self.optimizer, self.device)
        self.checkpointer = self._make_checkpointer(self.cfg.checkpoint, full_shapes)
        if self.checkpointer.load():
            self.lr_scheduler.sync_lr()  # this run's schedule at the restored step (WSD decay_start_step)
        if self.ft is not None:  # healing payload; the torchft step from a resumed checkpoint
            self.ft.attach(self)

    def _make_checkpointer(self, ckpt: CheckpointConfig, full_shapes: dict[str, torch.Size]) -> Checkpointer:
        """The run's ``Checkpointer`` under the checkpoint options ``ckpt`` (a rehearsal builds it with
        the options that need peers off, ``trainer/rehearse_trainer.py``)."""
        cfg = self.cfg
        extra: dict[str, Stateful] = {"spike": self.state.spike} if self.state.spike is not None else {}
        own_root = self.ft.checkpoint_root if self.ft is not None else None  # semi_sync: per group
        if self.ft is not None and self.ft.semi is not None:
            from trainer.resilience.semi_sync import SemiSyncState

            extra["semi_sync"] = SemiSyncState(self.ft.semi)
        return Checkpointer(
            ckpt,
            dump_folder=own_root or self.cfg.job.dump_folder,
            model_parts=self.model_parts,
            optimizer=self.optimizer,
            lr_scheduler=self.lr_scheduler,
            dataloader=self.train_loader,
            train_state=self.state,
            seed=cfg.training.seed,
            device=self.device,
            info=model_info(cfg.model, cfg.data.tokenizer, describe_layout(self.dims, self.parallelism)),
            full_shapes=full_shapes,
            hf_target=(self.spec, cfg.model),
            shared_folder=self.ft is not None and own_root is None,
            extra_states=extra or None,
        )

    def _build_metrics(self) -> None:
        cfg, t = self.cfg, self.cfg.training
        self.metrics = MetricsLogger(
            self.log_folder,
            cfg.metrics,
            is_writer=self.rank == 0,
            device=self.device,
            flops_per_token=self.spec.flops_per_token(cfg.model, t.seq_len),
            tokens_per_step=self.tokens_per_step,
            world_size=self.world_size,
            total_steps=t.steps,
            resume_step=self.state.step,
            run_name=cfg.job.name,
        )
        self._build_hooks()

    def _build_hooks(self) -> None:
        """The per-step extras (MoE load balancing, QK-clip, MTP statistics, the ledgers, fault
        tolerance), run from one ordered list at the step's hook points (trainer/hooks.py)."""
        cfg, t = self.cfg, self.cfg.training
        self.hooks = build_step_hooks(
            HookContext(
                cfg=cfg,
                spec=self.spec,
                dims=self.dims,
                model=self.model,
                model_parts=self.model_parts,
                parameters=self.parameters,
                optimizer=self.optimizer,
                device=self.device,
                tokens_per_step=t.global_batch_size * t.seq_len,
                forwards_per_step=(
                    self.pipeline.n_microbatches if self.pipeline is not None else self.grad_accum_steps
                ),
                ft=self.ft,
                spike=self.state.spike,
                loss=self.step_context.loss,
            )
        )

    def _log_summary(self) -> None:
        accumulation = (
            f"{self.pipeline.n_microbatches} pipeline microbatches ({self.parallelism.pp_schedule})"
            if self.pipeline is not None
            else f"grad accumulation {self.grad_accum_steps}"
        )
        f8 = log_summary(
            self.cfg, self.spec, self.dims, self.world_size, self.device, accumulation, self.float8
        )
        if f8 is not None:  # training.float8: which linears run in float8, also metrics.jsonl's header
            self.metrics.write_header(self.state.step, {"float8": f8})

    # -- helpers --------------------------------------------------------------------
    def _train_mode(self, mode: bool) -> None:
        for part in self.model_parts:
            part.train(mode)

    def _global_sum(self, local: torch.Tensor) -> torch.Tensor:
        """Sum a local count or loss over the data/context-parallel ranks (no host sync)."""
        if self.dims.dp_cp == 1:
            return local
        total = local.clone()
        dist.all_reduce(total, group=self.dims.loss_mesh.get_group())
        return total

    def _next_batch(self, loader: DataLoader, *, training: bool = False) -> StepBatch:
        batch = loader.next_batch()
        # Per-document positions (restarting at each document) only go with document masking;
        # with plain causal attention across packed documents, positions run 0..S-1. The
        # loader's positions (from the prepared index) win; else they are derived from the
        # BOS/EOS boundaries, before context-parallel sharding.
        block_causal = self.attention_mask == "block_causal"
        loader_positions = getattr(batch, "positions", None) if block_causal else None
        step_batch = StepBatch(
            inputs=batch.inputs.to(self.device, non_blocking=True),
            labels=batch.labels.to(self.device, non_blocking=True),
        )
        if loader_positions is not None:
            step_batch.positions = loader_positions.to(self.device, non_blocking=True)
        elif block_causal:
            step_batch.positions = document_positions(
                step_batch.inputs, self.tokenizer.bos_id, self.tokenizer.eos_id
            )
        if training:  # training.seq_len_warmup: rows cut into k shorter ones
            step_batch.inputs, step_batch.labels, step_batch.positions = self.step_shape.cut(
                self.state.step + 1, step_batch.inputs, step_batch.labels, step_batch.positions
            )
        if training:  # the family's extra inputs (MTP ids/targets), on the whole sequence (before CP)
            step_batch.extras = self.spec.batch_inputs(
                self.cfg.model, step_batch.inputs, step_batch.labels, step_batch.positions
            )
        return self.step_context.shard_batch(step_batch)

    def _forward_loss_sum(self, batch: StepBatch) -> torch.Tensor:
        """Summed token loss of one (micro)batch; call inside ``self.step_context()``."""
        logits = self.model(
            batch.inputs, **batch.model_kwargs()
        )  # (b, S, V); vocab-sharded under loss parallel
        return self.step_context.loss(logits, batch.labels)

    # -- the step -------------------------------------------------------------------
    def _accumulate_gradients(self, batch: StepBatch, scale: torch.Tensor) -> torch.Tensor:
        """Forward/backward over ``grad_accum_steps`` microbatches; DDP communicates only on the
        last one and is waited for here. Returns the summed (unscaled) token loss."""
        loss_sum = torch.zeros((), device=self.device)
        no_sync = getattr(self.model, "no_sync", None)
        n = self.step_shape.micro_batches(batch.inputs.size(0), self.grad_accum_steps)  # training.batch_ramp
        for i, micro in enumerate(batch.chunk(n)):
            last = i == n - 1
            sync = no_sync() if (no_sync is not None and not last) else contextlib.nullcontext()
            with sync, self.step_context():
                micro_loss = self._forward_loss_sum(micro)
                (micro_loss * scale).backward()
            loss_sum += micro_loss.detach()
        finish = getattr(self.model, "finish_gradient_sync", None)
        if finish is not None:
            finish()
        return loss_sum

    def _forward_backward(self, batch: StepBatch, scale: torch.Tensor) -> torch.Tensor:
        """The step's forward and backward: the pipeline schedule (its microbatches replace the
        accumulation loop; the loss runs on the last stage and is reported everywhere) or the
        accumulation loop. Returns the summed (unscaled) token loss."""
        if self.pipeline is not None:
            loss = self.pipeline.step(batch.inputs, batch.labels, loss_scale=scale, **batch.model_kwargs())
        else:
            loss = self._accumulate_gradients(batch, scale)
        complete_partial_grads(self.parameters)  # TP's pending sums, once (FSDP / DDP did theirs)
        return loss

    def train_step(self) -> StepState:
        """One optimizer step over ``grad_accum_steps`` microbatches, with the hooks at their points
        (``trainer/hooks.py``); returns the step's state (``loss_sum``, ``num_tokens``, pre-clip
        ``grad_norm``); ``discard`` is set when a hook dropped the step (fault tolerance: a group failed;
        spike skipping: an outlier, with ``skipped``), nothing applied."""
        s = StepState(step=self.state.step + 1, loader=self.train_loader, tokens_seen=self.state.tokens_seen)
        self.hooks.run("begin_step", s)
        s.step, s.tokens_seen = self.state.step + 1, self.state.tokens_seen  # a heal may have moved them
        batch = self._next_batch(self.train_loader, training=True)
        # The loss is normalised by the GLOBAL number of target tokens, and the gradient
        # reducers (DDP, FSDP) average over dp ranks, so each rank scales by dp_cp: the
        # result equals the single-process mean over the whole global batch.
        s.num_tokens = self._global_sum(count_targets(batch.labels))
        self.hooks.run("count_tokens", s)
        s.num_tokens = s.num_tokens.clamp(min=1)
        s.loss_sum = self._forward_backward(batch, self.dims.dp_cp * s.replicas / s.num_tokens)
        self.hooks.run("after_backward", s)
        pp_mesh = self.dims.get_mesh("pp") if self.dims.pp > 1 else None
        s.grad_norm = clip_grad_norm_(self.parameters, self.cfg.training.grad_clip, pp_mesh=pp_mesh)
        self.hooks.run("after_clip", s)
        if s.discard:
            self.optimizer.zero_grad(set_to_none=True)
            return s
        self._check_finite(s)
        self.hooks.run("before_optimizer_step", s)
        self.optimizer.step()
        self.hooks.run("after_optimizer_step", s)
        self.lr_scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return s

    def _check_finite(self, s: StepState) -> None:
        """Every rank sees the same global grad norm, so all stop together, before the optimizer step
        (one host sync; a rehearsal, whose tensors have no values, answers it without one)."""
        assert s.grad_norm is not None and s.loss_sum is not None
        message = non_finite_message(s.grad_norm, s.loss_sum, s.step)  # names the rank(s)
        if message is not None:
            raise TrainingError(message)

    @torch.no_grad()
    def evaluate(self, loader: Optional[DataLoader] = None, steps: Optional[int] = None) -> tuple[float, int]:
        """Mean token loss over ``steps`` (default ``training.eval_steps``) batches of ``loader``
        (default the validation split), weighted by tokens over every rank (same on every rank)."""
        loader = loader if loader is not None else self.val_loader
        if loader is None:
            raise RuntimeError("evaluate() needs training.eval_freq > 0")
        self._train_mode(False)
        loader.reset()
        loss_sum = torch.zeros((), device=self.device)
        count = torch.zeros((), device=self.device)
        for _ in range(steps or self.cfg.training.eval_steps):
            batch = self._next_batch(loader)
            if self.pipeline is not None:
                loss_sum += self.pipeline.forward_loss_sum(batch.inputs, batch.labels, **batch.model_kwargs())
            else:
                with self.step_context():
                    loss_sum += self._forward_loss_sum(batch)
            count += count_targets(batch.labels)
        self._train_mode(True)
        totals = self._global_sum(torch.stack([loss_sum, count]))
        return (totals[0] / totals[1].clamp(min=1)).item(), int(totals[1].item())

    def _row_stats(self, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Per-row task statistics (``trainer.eval.scoring.ROW_STATS``) of one (B, S) batch: this
        rank's share (its context-parallel shard), on every pp rank."""
        batch = self.step_context.shard_batch(StepBatch(inputs, labels))
        # row statistics read the logits (no backward: memory as evaluation's)
        defer_heads(self.step_context.loss, False)
        try:
            return self._row_stats_of(batch)
        finally:
            defer_heads(self.step_context.loss, self.cfg.training.loss_chunk_size > 0)

    def _row_stats_of(self, batch: StepBatch) -> torch.Tensor:
        if self.pipeline is not None:
            return self.pipeline.forward_loss_sum(
                batch.inputs,
                batch.labels,
                loss_fn=row_stats,
                out_shape=(len(batch.inputs), len(ROW_STATS)),
                **batch.model_kwargs(),
            )
        with self.step_context():
            logits = self.model(batch.inputs, **batch.model_kwargs())
            return row_stats(logits, batch.labels)

    @torch.no_grad()
    def evaluate_tasks(self) -> dict[str, TaskResult]:
        """Score ``eval.tasks`` on the model as it is sharded (collective; the same on every rank)."""
        if self.task_evaluator is None:
            raise RuntimeError("evaluate_tasks() needs eval.tasks")
        self._train_mode(False)
        try:
            return self.task_evaluator.run(
                self._row_stats,
                dp_rank=self.dims.dp_rank_of(self.rank),
                dp_size=self.dims.dp,
                device=self.device,
                reduce_group=self.dims.loss_mesh.get_group() if self.dims.dp_cp > 1 else None,
            )
        finally:
            self._train_mode(True)

    def _evaluate_more(self, step: int) -> None:
        """The named validation sets (at the validation steps) and the tasks (``eval.freq``), logged."""
        t = self.cfg.training
        if self.named_val_loaders and (step % t.eval_freq == 0 or step == t.steps):
            named = {
                name: self.evaluate(loader, steps) for name, (loader, steps) in self.named_val_loaders.items()
            }
            self.state.history.append(self.metrics.log_validation(step, named))
        if self.task_evaluator is not None and self.task_evaluator.due(step, t.steps):
            start = time.perf_counter()
            results = {name: r.metrics for name, r in self.evaluate_tasks().items()}
            self.state.history.append(self.metrics.log_tasks(step, results, time.perf_counter() - start))

    # -- the loop -------------------------------------------------------------------
    def _is_logged(self, step: int) -> bool:
        return step % self.cfg.metrics.log_freq == 0 or step == self.cfg.training.steps or step == 1

    def _log_step(self, s: StepState) -> None:
        """The training record of logged step ``s.step``: loss, grad norm, lr and every hook's entries
        (some are collectives: every rank logs the same steps)."""
        assert s.loss_sum is not None and s.num_tokens is not None and s.grad_norm is not None
        # Losses are local sums over this rank's tokens: add them up over dp/cp.
        global_loss = self._global_sum((s.loss_sum / s.num_tokens).detach())
        extra = self.train_loader.pop_metrics()  # data_wait_s (+ mixture shares)
        extra.update(self.hooks.metrics(s, self.device))
        lr = self.lr_scheduler.get_last_lr()[0]
        record = self.metrics.log_step(s.step, global_loss.item(), s.grad_norm.item(), lr, extra=extra)
        self.state.history.append(record)

    def _log_skipped(self, s: StepState) -> None:
        """A step skipped as a loss spike (trainer/stability.py): its batch counts as read (the data
        position), its record is logged; too many in a row stop the run on every rank."""
        assert s.skipped is not None
        self.state.tokens_seen += self.tokens_per_step if self.ft is None else self.ft.step_tokens
        record = {"step": s.step, **{k: v for k, v in s.skipped.items() if k != "spike/stop"}}
        self.metrics.write(record, s.step)
        self.state.history.append(record)
        if "spike/stop" in s.skipped:
            raise TrainingError(s.skipped["spike/stop"])

    def _after_step(self, step: int, stop: int) -> None:
        """Evaluation, checkpoint and the preemption check after step ``step`` was applied."""
        t = self.cfg.training
        if self.val_loader is not None and (step % t.eval_freq == 0 or step == t.steps):
            eval_loss, eval_tokens = self.evaluate()
            self.state.history.append(self.metrics.log_eval(step, eval_loss, eval_tokens))
        self._evaluate_more(step)  # eval.validation sets and eval.tasks (trainer/eval/)
        writer = self.ft is None or self.ft.writes_checkpoints  # one replica group writes DCP
        if writer:
            self.checkpointer.maybe_save(step, last=step == stop)
        # Preemption: one all-reduce of a flag per step; if any rank was signalled, all
        # checkpoint this step and raise Preempted (exit 75).
        if step < stop and self.preemption.should_stop(step):
            self.preemption.stop(step, self.checkpointer, self.cfg.checkpoint.enable and writer)

    def train(self, until_step: Optional[int] = None) -> list[dict[str, Any]]:
        """Run until ``training.steps`` (or stop early after ``until_step``, saving a checkpoint
        there if checkpoints are on); return the logged records (also written to disk)."""
        if self.cfg.checkpoint.create_seed:
            self.checkpointer.save_seed()
            return []
        stop = self.cfg.training.steps if until_step is None else min(until_step, self.cfg.training.steps)
        self.metrics.reset_timer(self.state.step)
        start = time.perf_counter()
        try:
            while self.state.step < stop:
                step = self.state.step + 1
                self.comm.begin_step(step)  # a hang report names this step
                self.profiler.begin(step)
                # metrics.comm_ledger / memory_ledger measure logged steps (each step: the same collectives)
                with self.hooks.measuring() if self._is_logged(step) else contextlib.nullcontext():
                    s = self.train_step()
                if s.discard:  # fault tolerance: retried with the next quorum; a spike: its batch is consumed
                    if s.skipped is not None:
                        self._log_skipped(s)
                    continue
                step = self.state.step = s.step  # the step taken (a fault-tolerance heal may have moved it)
                self.state.tokens_seen += self._step_tokens()
                self.profiler.end(step)
                if self._is_logged(step):
                    self._log_step(s)
                self._after_step(step, stop)
                self.comm.end_step(step)  # after the first step: comm.train_timeout_s
            self.checkpointer.wait()
        finally:
            self.metrics.close()
        logger.info(f"training done: {self.state.step} steps in {time.perf_counter() - start:.1f}s")
        return self.state.history

    def close(self) -> None:
        """Finish a pending checkpoint, then tear down the process group if this trainer created it."""
        self.checkpointer.close()
        if self.ft is not None:
            self.ft.close()
        self.profiler.close()
        self.preemption.close()
        self.comm.close()
        if self._owns_process_group and dist.is_initialized():
            dist.destroy_process_group()
