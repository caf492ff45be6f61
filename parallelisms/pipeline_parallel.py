"""Pipeline parallel: split the model by lists of module names, run a torch pipelining schedule.

Seed article section 6: the blocks are cut into K stages (embedding with the first, final norm
and head with the last); only boundary activations (B, S, H) and their gradients travel, point
to point. The batch is cut into M microbatches so that stages overlap; the idle share of a step
(the bubble) is ~(K-1)/(M+K-1) for GPipe and 1F1B, less for interleaved (v virtual stages per
rank) and zero-bubble schedules (the weight gradient W fills the gaps).

``apply_pp``: (1) ``stage_module_names`` lists each stage's modules from the model spec
(embedding and head weigh one block each, so the end stages get one block fewer); (2) every
stage of this rank is a deep copy of the meta model minus what it does not own -- no rank holds
the whole model, and state-dict keys stay global (``layers.17...``), so checkpoints are layout
independent; (3) the caller's ``parallelize_part`` applies TP / AC / compile / FSDP / init as for
a whole model (no DDP wrapper: replicated stages average their gradients once per step here);
(4) the ``PipelineStage`` objects and the schedule are built, with the caller's loss
(token-loss sum) times the step's ``loss_scale`` per microbatch and ``scale_grads=False``, so
gradients equal the non-pipelined trainer's (whose per-step loss is the single-process mean).

What crosses a boundary is known from the config (``StageShapes``): the residual stream of one
microbatch, (micro_batch, S / cp [/ tp under sequence parallel], dim), in the dtype the parameters
compute in (FSDP's ``param_dtype``, else the model's; autocast's outputs join the stream in its
dtype). Every stage is built with these static shapes, so torch runs no shape inference (no extra
forward/backward, no object exchange between ranks on the first step) and evaluation sends no
shape headers; a forward hook checks every sent activation against them (a mismatch is an error
at the sender, never a mis-sized receive).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager as ContextManager
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining import schedules as _schedules

from models.errors import ConfigError
from models.spec import ModelSpec, args_of, decoder_args
from parallelisms.config import ParallelismConfig
from parallelisms.parallel_dims import ParallelDims
from parallelisms.pipeline_split import (
    SCHEDULE_SPECS,
    canonical_schedule,
    num_microbatches,
    schedule_kind,
    stage_ids_of_rank,
    stage_module_names,
    stage_names,
    stages_per_rank,
)

__all__ = [
    "SCHEDULES",
    "Pipeline",
    "StageShapes",
    "apply_pp",
    "num_microbatches",
    "stage_module_names",
    "stage_ids_of_rank",
    "stages_per_rank",
]

LossFn = Callable[[Tensor, Tensor], Tensor]  # (logits, labels) -> summed token loss

# The schedules the installed torch provides, by canonical name.
SCHEDULES: dict[str, type] = {
    name: getattr(_schedules, cls) for name, (cls, _) in SCHEDULE_SPECS.items() if hasattr(_schedules, cls)
}


def _canonical_schedule(name: str) -> str:
    """``canonical_schedule``, also checking that the installed torch has the schedule's class."""
    schedule = canonical_schedule(name)
    if schedule not in SCHEDULES:
        raise ConfigError(
            f"parallelism.pp_schedule={schedule} is not in this torch {torch.__version__}; choose one of "
            f"{sorted(SCHEDULES)}."
        )
    return schedule


# --------------------------------------------------------------------------------------------
# Runtime
# --------------------------------------------------------------------------------------------


def _build_part(model: nn.Module, spec: ModelSpec, names: list[str]) -> nn.Module:
    """A deep copy of the (meta) model keeping only ``names``; module keys stay global."""
    part = copy.deepcopy(model)
    keep = set(names)
    for attr in (*spec.first_modules, *spec.last_modules):
        if attr not in keep:
            setattr(part, attr, None)
    blocks = getattr(part, spec.blocks)
    for key in list(blocks.keys()):
        if f"{spec.blocks}.{key}" not in keep:
            del blocks[key]
    return part


@dataclass(frozen=True)
class StageShapes:
    """What enters and leaves the stages, per microbatch, computed from the config on every rank
    (nothing is exchanged): token ids (micro_batch, S / cp) into the first stage; between stages the
    residual stream (micro_batch, S / cp / sp, dim) -- a plain tensor, sequence-sharded over tp under
    sequence parallel (``sp`` = tp then, else 1); logits (micro_batch, S / cp, vocab) out of the last
    stage (a vocab-sharded DTensor of that global shape under loss parallel: consumed by the loss on
    its own rank, never sent)."""

    micro_batch: int
    seq_len: int  # this rank's share of a sequence: seq_len / cp
    sp: int  # sequence-parallel degree of the residual stream: tp under sequence parallel, else 1
    dim: int
    vocab_size: int
    stream_dtype: torch.dtype  # the parameters' compute dtype (FSDP param_dtype, else the model's)
    logits_dtype: torch.dtype  # the head's output: autocast's dtype, else the stream's

    def boundary(self, rows: int, tokens: int) -> tuple[int, int, int]:
        """The residual stream's shape for ``rows`` sequences of ``tokens`` tokens (this rank's share
        of each: S / cp); evaluation batches have their own rows and lengths."""
        return (rows, tokens // self.sp, self.dim)

    def activation(self) -> Tensor:
        """One microbatch's boundary activation (meta)."""
        shape = self.boundary(self.micro_batch, self.seq_len)
        return torch.empty(shape, dtype=self.stream_dtype, device="meta", requires_grad=True)

    def stage_args(self, stage: int, num_stages: int) -> tuple[Tensor, Tensor]:
        """(input, output) meta tensors of virtual stage ``stage``: ``PipelineStage``'s static shapes."""
        if stage == 0:
            inputs = torch.empty((self.micro_batch, self.seq_len), dtype=torch.long, device="meta")
        else:
            inputs = self.activation()
        if stage == num_stages - 1:
            shape = (self.micro_batch, self.seq_len, self.vocab_size)
            outputs = torch.empty(shape, dtype=self.logits_dtype, device="meta", requires_grad=True)
        else:
            outputs = self.activation()
        return inputs, outputs


def stage_shapes(
    model: nn.Module,
    dims: ParallelDims,
    cfg: ParallelismConfig,
    *,
    micro_batch: int,
    seq_len: int,
    autocast_dtype: Optional[torch.dtype],
) -> StageShapes:
    """The ``StageShapes`` of ``model`` (on meta, before parallelisation) under this layout: FSDP
    casts every unit's parameters and floating inputs to ``fsdp.param_dtype``; without FSDP the
    stream keeps the parameters' dtype (autocast's lower-precision outputs are promoted when they
    are added to it)."""
    from parallelisms.utils import to_dtype

    args = decoder_args(args_of(model))
    param_dtype = next(model.parameters()).dtype
    stream = to_dtype(cfg.fsdp.param_dtype) if dims.fsdp_enabled else param_dtype
    return StageShapes(
        micro_batch=micro_batch,
        seq_len=seq_len // dims.cp,
        sp=dims.tp if dims.tp > 1 and cfg.sequence_parallel else 1,
        dim=args.dim,
        vocab_size=args.vocab_size,
        stream_dtype=stream,
        logits_dtype=autocast_dtype if autocast_dtype is not None else stream,
    )


def _check_sent(stage: int, shapes: StageShapes) -> Callable[[nn.Module, tuple[object, ...], object], None]:
    """A forward hook on a stage whose output goes to the next stage: the activation must have the
    boundary's shape for the stage's input (token ids into the first stage, the stream into the
    others) and its dtype, which is what the receiver allocates."""

    def hook(_module: nn.Module, inputs: tuple[object, ...], out: object) -> None:
        x = inputs[0] if inputs else None
        if not isinstance(x, Tensor):
            return  # not the pipeline's call
        tokens = x.shape[1] if stage == 0 else x.shape[1] * shapes.sp
        want = shapes.boundary(x.shape[0], tokens)
        if isinstance(out, Tensor) and tuple(out.shape) == want and out.dtype == shapes.stream_dtype:
            return
        got = f"{tuple(out.shape)} {out.dtype}" if isinstance(out, Tensor) else type(out).__name__
        raise RuntimeError(
            f"pipeline stage {stage} produced {got}, but its static boundary is {want} "
            f"{shapes.stream_dtype} (parallelisms/pipeline_parallel.py StageShapes): the receiving stage "
            "would read a wrong buffer. A model that changes the residual stream's shape or dtype needs "
            "StageShapes updated."
        )

    return hook


class Pipeline:
    """This rank's stages of a pipelined model and the schedule that runs them.

    ``step`` trains on one local batch; ``forward_loss_sum`` evaluates. Both run inside the
    caller's ``step_context()`` (autocast, loss parallel, ...) and compute the loss with the
    caller's ``loss_fn`` (summed token loss), the same objects the non-pipelined trainer uses.
    Optimise ``parameters()`` (the union of ``model_parts``). With ``grad_sync_group`` (pure
    data replication), gradients are averaged over it once per step after all microbatches.
    """

    def __init__(
        self,
        model_parts: list[nn.Module],
        stage_ids: list[int],
        pp_mesh: DeviceMesh,
        *,
        schedule: str,
        num_stages: int,
        n_microbatches: int,
        shapes: StageShapes,
        device: torch.device,
        loss_fn: LossFn,
        step_context: Callable[[], ContextManager],
        grad_sync_group: Optional[dist.ProcessGroup] = None,
    ) -> None:
        self.model_parts = model_parts
        self.pp_mesh = pp_mesh
        self.device = device
        self.schedule_name = _canonical_schedule(schedule)
        self.num_stages = num_stages
        self.n_microbatches = n_microbatches
        self.shapes = shapes
        self.loss_fn = loss_fn
        self.step_context = step_context
        self.grad_sync_group = grad_sync_group
        self._loss_scale: Tensor | float = 1.0
        self._group = pp_mesh.get_group()
        self.pp_rank = pp_mesh.get_local_rank()
        pp = pp_mesh.size()
        style = "v" if schedule_kind(self.schedule_name) == "v" else "loop"
        self.stage_to_rank = {
            s: r for r in range(pp) for s in stage_ids_of_rank(r, pp, num_stages // pp, style)
        }
        self.stage_ids = stage_ids
        # Static shapes (StageShapes): torch infers none on the first step and exchanges none.
        self.stages = []
        for part, s in zip(model_parts, stage_ids):
            inputs, outputs = shapes.stage_args(s, num_stages)
            if s < num_stages - 1:
                part.register_forward_hook(_check_sent(s, shapes))
            self.stages.append(
                PipelineStage(
                    part, s, num_stages, device, input_args=inputs, output_args=outputs, group=self._group
                )
            )
        self.has_first_stage = 0 in stage_ids
        self.has_last_stage = num_stages - 1 in stage_ids
        cls = SCHEDULES[self.schedule_name]
        self.schedule = cls(
            self.stages if schedule_kind(self.schedule_name) != "single" else self.stages[0],
            n_microbatches=n_microbatches,
            loss_fn=self._scaled_loss,
            scale_grads=False,  # the loss is already normalised by the global token count
        )
        self._micro_sums: list[Tensor] = []

    def parameters(self) -> Iterator[nn.Parameter]:
        """Every parameter of this rank's parts (each once)."""
        seen: set[int] = set()
        for part in self.model_parts:
            for p in part.parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    yield p

    def train(self, mode: bool = True) -> Pipeline:
        for part in self.model_parts:
            part.train(mode)
        return self

    def eval(self) -> Pipeline:
        return self.train(False)

    def _scaled_loss(self, logits: Tensor, labels: Tensor) -> Tensor:
        loss_sum = self.loss_fn(logits, labels)
        self._micro_sums.append(loss_sum.detach())
        return loss_sum * self._loss_scale

    def step(
        self,
        inputs: Optional[Tensor],
        labels: Tensor,
        *,
        loss_scale: Tensor | float,
        **model_kwargs: Tensor,
    ) -> Tensor:
        """One schedule step over a local batch (B, S); returns this dp rank's summed token loss
        (unscaled, identical on every pp rank). Backward runs on ``loss_sum * loss_scale``
        per microbatch; gradients accumulate into the parts' parameters.

        ``model_kwargs`` (the model's one call: ``positions`` (B, S) of context-parallel shards or
        packed documents, the family's extras) reach EVERY stage: torch's schedules hand keyword
        arguments, split into microbatches along the batch, to each stage's forward, where the
        attention layers use positions for RoPE and the mask."""
        if self.has_first_stage and inputs is None:
            raise ValueError("Pipeline.step: the rank holding the first stage needs the input tokens.")
        self._micro_sums.clear()
        self._loss_scale = loss_scale
        target = labels if self.has_last_stage else None
        args = (inputs,) if self.has_first_stage else ()
        kwargs = {k: _batched(v, labels) if k == "positions" else v for k, v in model_kwargs.items()}
        with self.step_context():
            self.schedule.step(*args, target=target, return_outputs=False, **kwargs)
        if self.grad_sync_group is not None:
            for part in self.model_parts:
                _all_reduce_mean_grads(part, self.grad_sync_group)
        loss = torch.zeros((), device=self.device)
        if self.has_last_stage:
            loss = torch.stack(self._micro_sums[-self.n_microbatches :]).sum().float()
        self._micro_sums.clear()
        dist.all_reduce(loss, group=self._group)  # only the last stage's rank contributes
        return loss

    @torch.no_grad()
    def forward_loss_sum(
        self,
        inputs: Optional[Tensor],
        labels: Tensor,
        *,
        loss_fn: Optional[LossFn] = None,
        out_shape: tuple[int, ...] = (),
        **model_kwargs: Tensor,
    ) -> Tensor:
        """Forward only: summed token loss of (B, S) ``labels`` on every pp rank.

        Runs the stages one after another with blocking send/recv (no microbatching), so any
        batch size works and the training schedule's state is untouched. ``loss_fn`` replaces
        the training loss (e.g. per-row evaluation statistics) and must return an fp32 tensor of
        ``out_shape``, which every pp rank then holds.
        """
        loss_fn = loss_fn or self.loss_fn
        part_of = {stage.stage_index: stage.submod for stage in self.stages}
        h: Optional[Tensor] = None
        loss = torch.zeros(out_shape, device=self.device)
        with self.step_context():
            for s in range(self.num_stages):
                if self.stage_to_rank[s] != self.pp_rank:
                    continue
                if s == 0:
                    x = inputs
                elif self.stage_to_rank[s - 1] == self.pp_rank:
                    x = h
                else:
                    x = self._recv(
                        self.stage_to_rank[s - 1], self.shapes.boundary(labels.shape[0], labels.shape[1])
                    )
                out = part_of[s](x, **model_kwargs)
                if s == self.num_stages - 1:
                    loss = loss_fn(out, labels).float()
                elif self.stage_to_rank[s + 1] != self.pp_rank:
                    self._send(out, self.stage_to_rank[s + 1])
                else:
                    h = out
        dist.all_reduce(loss, group=self._group)
        return loss

    def _send(self, t: Tensor, peer: int) -> None:
        dist.send(t.detach().contiguous(), group=self._group, group_dst=peer)

    def _recv(self, peer: int, shape: tuple[int, int, int]) -> Tensor:
        """The activation of ``shape`` from ``peer`` in the stream's dtype: both follow from the config
        and the batch every pp rank holds (``StageShapes``; the sender's forward hook checked them),
        so no header travels."""
        t = torch.empty(shape, dtype=self.shapes.stream_dtype, device=self.device)
        dist.recv(t, group=self._group, group_src=peer)
        return t


def _batched(positions: Tensor, labels: Tensor) -> Tensor:
    """Positions as (B, S), so the schedule can split them into microbatches like the labels."""
    return positions if positions.dim() == 2 else positions[None].expand(labels.shape[0], -1)


@torch.no_grad()
def _all_reduce_mean_grads(part: nn.Module, group: dist.ProcessGroup) -> None:
    """Average a replicated part's gradients over its replicate group in one coalesced all-reduce."""
    world = dist.get_world_size(group)
    params = [p for p in part.parameters() if p.requires_grad]
    if world == 1 or not params:
        return
    grads: list[Tensor] = []
    for p in params:  # every rank must send the same layout
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        grads.append(p.grad)
    flat = _flatten_dense_tensors(grads)
    dist.all_reduce(flat, group=group)
    flat.div_(world)
    for g, reduced in zip(grads, _unflatten_dense_tensors(flat, grads)):
        g.copy_(reduced)


def apply_pp(
    model: nn.Module,
    spec: ModelSpec,
    dims: ParallelDims,
    cfg: ParallelismConfig,
    *,
    device: torch.device,
    micro_batch_size: int,
    local_batch_size: int,
    seq_len: int,
    autocast_dtype: Optional[torch.dtype],
    parallelize_part: Callable[[nn.Module], nn.Module],
    loss_fn: LossFn,
    step_context: Callable[[], ContextManager],
) -> Pipeline:
    """Split the meta-device ``model`` into this pp rank's stages, parallelize each, build the schedule.

    ``validated_dims`` (parallelisms/validate.py) has validated the options. ``parallelize_part`` gets each
    stage's module on meta and returns it materialised, initialised and sharded (TP / FSDP)
    like a whole model. Under pure replication (DDP layout) the Pipeline averages gradients
    over ``dp_replicate`` itself, once per step. ``seq_len`` (the whole sequence, before context
    parallelism) and ``autocast_dtype`` (the step context's, None without autocast) give the stages'
    static shapes (``StageShapes``).
    """
    pp_mesh = dims.get_mesh("pp")
    schedule = _canonical_schedule(cfg.pp_schedule)
    v = stages_per_rank(cfg)
    num_stages = dims.pp * v
    names = stage_names(spec, args_of(model), cfg, num_stages)
    style = "v" if schedule_kind(schedule) == "v" else "loop"
    stage_ids = stage_ids_of_rank(pp_mesh.get_local_rank(), dims.pp, v, style)
    n_microbatches = num_microbatches(
        cfg, local_batch_size=local_batch_size, micro_batch_size=micro_batch_size
    )
    shapes = stage_shapes(
        model,
        dims,
        cfg,
        micro_batch=local_batch_size // n_microbatches,
        seq_len=seq_len,
        autocast_dtype=autocast_dtype,
    )
    parts = [parallelize_part(_build_part(model, spec, names[s])) for s in stage_ids]
    return Pipeline(
        parts,
        stage_ids,
        pp_mesh,
        schedule=schedule,
        num_stages=num_stages,
        n_microbatches=n_microbatches,
        shapes=shapes,
        device=device,
        loss_fn=loss_fn,
        step_context=step_context,
        grad_sync_group=dims.ddp_mesh.get_group() if dims.ddp_enabled else None,
    )
