"""The Trainer: builds everything in the order of DESIGN.md section 2 and runs the loop."""

from __future__ import annotations

import contextlib
import logging
import os
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from models.errors import ConfigError
from models.llama import Transformer, num_flops_per_token, param_count
from parallelisms.parallel_dims import ParallelDims, mesh_view
from parallelisms.parallelize import PartOptions, parallelize, parallelize_pipeline
from parallelisms.pipeline_parallel import Pipeline, validate_pp
from parallelisms.utils import clip_grad_norm_, copy_full_into
from trainer.checkpoint import (
    Checkpointer,
    describe_layout,
    model_info,
    seed_parallelism,
    validate_checkpoint_config,
)
from trainer.config import TrainConfig, to_yaml
from trainer.data import DataLoader, build_dataloader
from trainer.metrics import MetricsLogger, setup_logging
from trainer.optim import build_lr_scheduler, build_optimizer
from trainer.tokenizer import build_tokenizer, check_vocab_size

logger = logging.getLogger("meshwright")

IGNORE_INDEX = -100


class TrainingError(RuntimeError):
    """The run cannot continue (e.g. a non-finite loss); raised on every rank together."""


@dataclass
class TrainState:
    """What the loop has done so far (checkpointed)."""

    step: int = 0
    tokens_seen: int = 0
    history: list[dict[str, Any]] = field(default_factory=list)


def _env_int(name: str, default: int) -> int:
    return int(os.environ.get(name, default))


def resolve_device(kind: str, local_rank: int) -> torch.device:
    """The device this rank computes on."""
    if kind == "cuda" or (kind == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise ConfigError("training.device=cuda but no CUDA device is visible; use training.device=cpu.")
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class Trainer:
    """One training run. Construction validates and builds; ``train()`` runs the loop."""

    def __init__(self, cfg: TrainConfig) -> None:
        self.cfg = cfg
        t = cfg.training
        self.rank = _env_int("RANK", 0)
        self.world_size = _env_int("WORLD_SIZE", 1)
        self.local_rank = _env_int("LOCAL_RANK", 0)
        setup_logging(self.rank)

        # 1. Validate everything that needs no process group.
        validate_checkpoint_config(cfg.checkpoint, self.world_size)
        p = seed_parallelism(cfg.parallelism) if cfg.checkpoint.create_seed else cfg.parallelism
        self.dims = ParallelDims(p.dp_replicate, p.dp_shard, p.cp, p.tp, p.pp, p.ep, self.world_size)
        self.dims.validate_model(cfg.model, seq_len=t.seq_len, sequence_parallel=p.sequence_parallel)
        self.grad_accum_steps = self.dims.grad_accum_steps(t.global_batch_size, t.micro_batch_size)
        self.local_batch_size = t.global_batch_size // self.dims.dp
        if self.dims.pp > 1:
            validate_pp(
                cfg.model, p, pp=self.dims.pp, local_batch_size=self.local_batch_size,
                micro_batch_size=t.micro_batch_size, compile=t.compile,
            )  # fmt: skip
        self.tokenizer = build_tokenizer(cfg.data.tokenizer)
        check_vocab_size(self.tokenizer, cfg.model.vocab_size)
        self.device = resolve_device(t.device, self.local_rank)
        # Data is read and tokenized before any collective, so a bad path fails on every rank.
        dp_rank = self._dp_rank_from_global_rank()
        self.train_loader = build_dataloader(
            cfg.data, self.tokenizer, split="train", seq_len=t.seq_len, global_batch_size=t.global_batch_size,
            dp_rank=dp_rank, dp_size=self.dims.dp, seed=t.seed,
        )  # fmt: skip
        self.val_loader: Optional[DataLoader] = None
        if t.eval_freq > 0:
            self.val_loader = build_dataloader(
                cfg.data, self.tokenizer, split="validation", seq_len=t.seq_len,
                global_batch_size=t.micro_batch_size * self.dims.dp, dp_rank=dp_rank, dp_size=self.dims.dp,
                seed=t.seed,
            )  # fmt: skip

        # 2. Process group and mesh.
        if t.deterministic:
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
            torch.use_deterministic_algorithms(True)
        self._owns_process_group = not dist.is_initialized()
        if self._owns_process_group:
            backend = "nccl" if self.device.type == "cuda" else "gloo"
            if "MASTER_ADDR" in os.environ:
                dist.init_process_group(backend, timeout=timedelta(minutes=10))
            else:  # plain `python trainer/main.py`: a one-process group, no network
                dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
        self.mesh = self.dims.build_mesh(self.device.type)
        self.dp_cp_mesh = mesh_view(self.mesh, "dp_cp")
        torch.manual_seed(t.seed)

        # 3. Run folder, identical on every rank; only rank 0 writes into it.
        self.dump_folder = cfg.job.dump_folder
        if self.rank == 0:
            os.makedirs(self.dump_folder, mode=0o750, exist_ok=True)
            with open(os.path.join(self.dump_folder, "config.yaml"), "w", encoding="utf-8") as f:
                f.write(to_yaml(cfg))

        # 4. Model on meta -> parallelize -> materialise with deterministic weights.
        with torch.device("meta"):
            model = Transformer(cfg.model)
        full_shapes = {k: v.shape for k, v in model.state_dict().items()}  # before any wrapper renames
        part_options = PartOptions(
            device=self.device,
            init_weights=lambda m: m.init_weights(seed=t.seed, copy_fn=copy_full_into),
            activation_checkpoint=t.activation_checkpoint,
            ac_selective=t.ac_selective,
            ac_layer_interval=t.ac_layer_interval,
            compile=t.compile,
        )
        # Under PP the "model" is this rank's Pipeline (its stages' parts + the schedule); it
        # offers parameters()/train()/eval() and the Checkpointer merges its parts' names.
        self.pipeline: Optional[Pipeline] = None
        self.pp_mesh = None
        if self.dims.pp > 1:
            self.pipeline = parallelize_pipeline(
                model, self.dims, self.mesh, p, part_options, micro_batch_size=t.micro_batch_size,
                local_batch_size=self.local_batch_size,
            )  # fmt: skip
            if t.mixed_precision == "bf16":
                self.pipeline.autocast_dtype = torch.bfloat16
            self.pp_mesh = self.pipeline.pp_mesh
            self.model = self.pipeline
        else:
            self.model = parallelize(model, self.dims, self.mesh, p, part_options)
        self.model.train()
        self.loss_parallel = self.dims.tp > 1 and p.loss_parallel

        # 5. Optimizer, schedule, metrics.
        shard_mesh = (
            mesh_view(self.mesh, "dp_replicate")
            if (self.dims.ddp_enabled and p.ddp.sharded_optimizer)
            else None
        )
        self.optimizer = build_optimizer(
            self.model, cfg.optimizer, device_type=self.device.type, shard_mesh=shard_mesh
        )
        self.lr_scheduler = build_lr_scheduler(self.optimizer, cfg.lr_scheduler, t.steps)
        self.state = TrainState()

        # 6. Checkpoints: resume from the newest complete one (or start from initial weights).
        self.checkpointer = Checkpointer(
            cfg.checkpoint, dump_folder=self.dump_folder, model=self.model, optimizer=self.optimizer,
            lr_scheduler=self.lr_scheduler, dataloader=self.train_loader, train_state=self.state, seed=t.seed,
            device=self.device, info=model_info(cfg.model, cfg.data.tokenizer, describe_layout(self.dims, p)),
            full_shapes=full_shapes,
        )  # fmt: skip
        self.checkpointer.load()
        self.autocast = (
            torch.autocast(self.device.type, dtype=torch.bfloat16)
            if t.mixed_precision == "bf16"
            else contextlib.nullcontext()
        )
        self.tokens_per_step = t.global_batch_size * t.seq_len
        self.metrics = MetricsLogger(
            self.dump_folder, cfg.metrics, is_writer=self.rank == 0, device=self.device,
            flops_per_token=num_flops_per_token(cfg.model, t.seq_len), tokens_per_step=self.tokens_per_step,
            world_size=self.world_size, total_steps=t.steps,
        )  # fmt: skip
        n_params = param_count(cfg.model)
        accumulation = (
            f"{self.pipeline.n_microbatches} pipeline microbatches ({p.pp_schedule})"
            if self.pipeline is not None
            else f"grad accumulation {self.grad_accum_steps}"
        )
        logger.info(
            f"model {cfg.model.name}: {n_params / 1e6:.2f}M params | world {self.world_size} = "
            f"pp {self.dims.pp} x dp_replicate {self.dims.dp_replicate} x dp_shard {self.dims.dp_shard} x "
            f"cp {self.dims.cp} x tp {self.dims.tp} | global batch {t.global_batch_size} x {t.seq_len} tokens, "
            f"micro batch {t.micro_batch_size}, {accumulation} | device {self.device}"
        )

    # -- helpers --------------------------------------------------------------------
    def _dp_rank_from_global_rank(self) -> int:
        """Data-parallel rank from the global rank and the mesh order (pp, dp_r, dp_s, cp, tp)."""
        d = self.dims
        rest = self.rank // (d.tp * d.cp)  # drop tp, cp (innermost)
        dp_shard_idx = rest % d.dp_shard
        dp_rep_idx = (rest // d.dp_shard) % d.dp_replicate
        return dp_rep_idx * d.dp_shard + dp_shard_idx

    def _loss_sum(self, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Sum of token cross-entropies of one microbatch (call under ``self._loss_context()``)."""
        with self.autocast:
            logits = self.model(inputs)  # (b, S, V); a vocab-sharded DTensor under loss parallel
        loss = F.cross_entropy(
            logits.flatten(0, 1).float(), labels.flatten(0, 1), ignore_index=IGNORE_INDEX, reduction="sum"
        )
        return loss.full_tensor() if isinstance(loss, DTensor) else loss

    def _loss_context(self) -> contextlib.AbstractContextManager:
        """Cross-entropy on vocab-sharded logits (TP loss parallel) must run, forward and
        backward, inside torch's ``loss_parallel()`` context."""
        return loss_parallel() if self.loss_parallel else contextlib.nullcontext()

    def _global_count(self, local: torch.Tensor) -> torch.Tensor:
        """Sum a local count over the data/context-parallel ranks (no host sync)."""
        if self.dims.dp_cp == 1:
            return local
        total = local.clone()
        dist.all_reduce(total, group=self.dp_cp_mesh.get_group())
        return total

    # -- the step -------------------------------------------------------------------
    def _accumulate_gradients(
        self, inputs: torch.Tensor, labels: torch.Tensor, scale: torch.Tensor
    ) -> torch.Tensor:
        """Forward/backward over ``grad_accum_steps`` microbatches; DDP communicates only on the
        last one and is waited for here. Returns the summed (unscaled) token loss."""
        loss_sum = torch.zeros((), device=self.device)
        no_sync = getattr(self.model, "no_sync", None)
        for i, (mi, ml) in enumerate(
            zip(inputs.chunk(self.grad_accum_steps), labels.chunk(self.grad_accum_steps))
        ):
            last = i == self.grad_accum_steps - 1
            ctx = no_sync() if (no_sync is not None and not last) else contextlib.nullcontext()
            with ctx, self._loss_context():
                micro_loss = self._loss_sum(mi, ml)
                (micro_loss * scale).backward()
            loss_sum += micro_loss.detach()
        finish = getattr(self.model, "finish_gradient_sync", None)
        if finish is not None:
            finish()
        return loss_sum

    def train_step(self) -> tuple[torch.Tensor, torch.Tensor]:
        """One optimizer step over ``grad_accum_steps`` microbatches; returns (loss, grad_norm) tensors."""
        batch = self.train_loader.next_batch()
        inputs = batch.inputs.to(self.device, non_blocking=True)
        labels = batch.labels.to(self.device, non_blocking=True)
        # The loss is normalised by the GLOBAL number of target tokens, and the gradient
        # reducers (DDP, FSDP) average over dp ranks, so each rank scales by dp_cp: the
        # result equals the single-process mean over the whole global batch.
        num_tokens = self._global_count((labels != IGNORE_INDEX).sum())
        scale = self.dims.dp_cp / num_tokens.clamp(min=1)
        if self.pipeline is not None:
            # The schedule splits the local batch into its microbatches (they replace the
            # accumulation loop), runs the loss on the last stage and reports it everywhere.
            self.pipeline.loss_scale = scale
            loss_sum = self.pipeline.step(inputs, labels)
        else:
            loss_sum = self._accumulate_gradients(inputs, labels, scale)
        grad_norm = clip_grad_norm_(
            self.model.parameters(), self.cfg.training.grad_clip, pp_mesh=self.pp_mesh
        )
        # Every rank sees the same global grad norm, so all stop together, before the step.
        if not torch.isfinite(grad_norm):
            raise TrainingError(
                f"non-finite gradient norm ({grad_norm.item()}) at step {self.state.step + 1}: the loss or "
                f"gradients overflowed. Nothing was applied. Lower optimizer.lr, keep training.grad_clip > 0, "
                f"use training.mixed_precision=fp32, or resume from an earlier checkpoint."
            )
        self.optimizer.step()
        self.lr_scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss_sum / num_tokens.clamp(min=1), grad_norm

    @torch.no_grad()
    def evaluate(self) -> tuple[float, int]:
        """Mean token loss over ``training.eval_steps`` validation batches (same on every rank)."""
        assert self.val_loader is not None  # only called when eval is configured
        self.model.eval()
        self.val_loader.reset()
        loss_sum = torch.zeros((), device=self.device)
        count = torch.zeros((), device=self.device)
        for _ in range(self.cfg.training.eval_steps):
            batch = self.val_loader.next_batch()
            inputs, labels = batch.inputs.to(self.device), batch.labels.to(self.device)
            if self.pipeline is not None:
                loss_sum += self.pipeline.forward_loss_sum(inputs, labels)
            else:
                with self._loss_context():
                    loss_sum += self._loss_sum(inputs, labels)
            count += (labels != IGNORE_INDEX).sum()
        self.model.train()
        totals = torch.stack([loss_sum, count])
        dist.all_reduce(totals, group=self.dp_cp_mesh.get_group())
        return (totals[0] / totals[1].clamp(min=1)).item(), int(totals[1].item())

    # -- the loop -------------------------------------------------------------------
    def train(self, until_step: Optional[int] = None) -> list[dict[str, Any]]:
        """Run until ``training.steps`` (or stop early after ``until_step``, saving a checkpoint
        there if checkpoints are on); return the logged records (also written to disk)."""
        t = self.cfg.training
        if self.cfg.checkpoint.create_seed:
            self.checkpointer.save_seed()
            return []
        stop = t.steps if until_step is None else min(until_step, t.steps)
        log_freq = self.cfg.metrics.log_freq
        self.metrics.reset_timer(self.state.step)
        start = time.perf_counter()
        try:
            while self.state.step < stop:
                loss, grad_norm = self.train_step()
                self.state.step += 1
                self.state.tokens_seen += self.tokens_per_step
                step = self.state.step
                if step % log_freq == 0 or step == t.steps or step == 1:
                    # Losses are local sums over this rank's tokens: add them up over dp/cp.
                    global_loss = self._global_count(loss.detach())
                    record = self.metrics.log_step(
                        step,
                        global_loss.item(),
                        grad_norm.item(),
                        self.lr_scheduler.get_last_lr()[0],
                        extra=self.train_loader.pop_metrics(),  # data_wait_s (+ mixture shares)
                    )
                    self.state.history.append(record)
                if self.val_loader is not None and (step % t.eval_freq == 0 or step == t.steps):
                    eval_loss, eval_tokens = self.evaluate()
                    self.state.history.append(self.metrics.log_eval(step, eval_loss, eval_tokens))
                self.checkpointer.maybe_save(step, last=step == stop)
            self.checkpointer.wait()
        finally:
            self.metrics.close()
        logger.info(f"training done: {self.state.step} steps in {time.perf_counter() - start:.1f}s")
        return self.state.history

    def close(self) -> None:
        """Finish a pending checkpoint, then tear down the process group if this trainer created it."""
        self.checkpointer.close()
        if self._owns_process_group and dist.is_initialized():
            dist.destroy_process_group()
