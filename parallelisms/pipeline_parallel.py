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
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager as ContextManager
from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining import schedules as _schedules

from models.errors import ConfigError
from models.spec import ModelSpec
from parallelisms.config import ParallelismConfig
from parallelisms.parallel_dims import ParallelDims

__all__ = [
    "SCHEDULES",
    "Pipeline",
    "apply_pp",
    "num_microbatches",
    "stage_module_names",
    "stage_ids_of_rank",
    "stages_per_rank",
    "validate_pp",
]

LossFn = Callable[[Tensor, Tensor], Tensor]  # (logits, labels) -> summed token loss

# Schedule name -> (torch class name, kind). "single": one stage per rank; "loop": v stages per
# rank, stage s on rank s % pp; "v": exactly 2 stages per rank, V-shaped (rank r owns r and
# 2*pp-1-r, so rank 0 holds both the first and the last stage).
_SCHEDULE_SPECS: dict[str, tuple[str, str]] = {
    "GPipe": ("ScheduleGPipe", "single"),
    "1F1B": ("Schedule1F1B", "single"),
    "Interleaved1F1B": ("ScheduleInterleaved1F1B", "loop"),
    "LoopedBFS": ("ScheduleLoopedBFS", "loop"),
    "InterleavedZeroBubble": ("ScheduleInterleavedZeroBubble", "loop"),
    "ZBVZeroBubble": ("ScheduleZBVZeroBubble", "v"),
}
# The schedules the installed torch provides, by canonical name.
SCHEDULES: dict[str, type] = {
    name: getattr(_schedules, cls) for name, (cls, _) in _SCHEDULE_SPECS.items() if hasattr(_schedules, cls)
}
# Zero-bubble schedules split backward into input (B) and weight (W) gradients; torch cannot
# do that split through torch.compile'd modules.
ZERO_BUBBLE = ("InterleavedZeroBubble", "ZBVZeroBubble")


def _canonical_schedule(name: str) -> str:
    by_lower = {k.lower(): k for k in SCHEDULES}
    if not isinstance(name, str) or name.lower() not in by_lower:
        missing = sorted(set(_SCHEDULE_SPECS) - set(SCHEDULES))
        extra = f" (not in this torch {torch.__version__}: {missing})" if missing else ""
        raise ConfigError(
            f"parallelism.pp_schedule={name!r} is not a known pipeline schedule; choose one of "
            f"{sorted(SCHEDULES)}{extra}."
        )
    return by_lower[name.lower()]


def _kind(schedule: str) -> str:
    return _SCHEDULE_SPECS[_canonical_schedule(schedule)][1]


# --------------------------------------------------------------------------------------------
# Splitting (pure)
# --------------------------------------------------------------------------------------------


def _distribute(total: int, num_stages: int) -> list[int]:
    """``total`` units over stages: equal shares, the remainder to middle stages first."""
    sizes = [total // num_stages] * num_stages
    order = list(range(1, num_stages - 1)) + [0, num_stages - 1]
    for i in order[: total % num_stages]:
        sizes[i] += 1
    return sizes


def stage_module_names(
    spec: ModelSpec, n_layers: int, num_stages: int, layers_per_stage: Optional[int]
) -> list[list[str]]:
    """Module names owned by each of ``num_stages`` stages, in pipeline order.

    Default (``layers_per_stage=None``): the spec's first modules (embedding) and last modules
    (final norm + head) each weigh as much as one block, so ``n_layers + 2`` units are spread
    evenly and the first and last stages get one block fewer, e.g. 126 blocks on 16 stages ->
    7, 8 x 14, 7. When that would leave the first or last stage without a block, blocks are
    spread evenly (the remainder to middle stages). ``layers_per_stage`` asks for exactly that
    many blocks on every stage, and must then multiply with ``num_stages`` to ``n_layers``.
    """
    if num_stages < 1:
        raise ConfigError(f"number of pipeline stages {num_stages} must be >= 1.")
    if n_layers < num_stages:
        raise ConfigError(
            f"model.n_layers={n_layers} < {num_stages} pipeline stages (parallelism.pp x pp_stages_per_rank): "
            f"every stage needs at least one block; use fewer stages or more layers."
        )
    if layers_per_stage is not None:
        if layers_per_stage < 1 or layers_per_stage * num_stages != n_layers:
            raise ConfigError(
                f"parallelism.pp_layers_per_stage={layers_per_stage} x {num_stages} stages != model.n_layers="
                f"{n_layers}; set it to {n_layers // num_stages if n_layers % num_stages == 0 else 'null'} "
                f"or null for the balanced default."
            )
        counts = [layers_per_stage] * num_stages
    elif num_stages == 1:
        counts = [n_layers]
    else:
        units = _distribute(n_layers + 2, num_stages)
        counts = [u - (i == 0) - (i == num_stages - 1) for i, u in enumerate(units)]
        if min(counts) < 1:
            counts = _distribute(n_layers, num_stages)
    names: list[list[str]] = []
    start = 0
    for i, count in enumerate(counts):
        stage = list(spec.first_modules) if i == 0 else []
        stage += [f"{spec.blocks}.{j}" for j in range(start, start + count)]
        if i == num_stages - 1:
            stage += list(spec.last_modules)
        names.append(stage)
        start += count
    return names


def _stage_names(spec: ModelSpec, args: object, cfg: ParallelismConfig, num_stages: int) -> list[list[str]]:
    """The configured split: ``pp_module_names`` if set (checked), else ``stage_module_names``."""
    if cfg.pp_module_names is None:
        return stage_module_names(spec, args.n_layers, num_stages, cfg.pp_layers_per_stage)
    names = [list(stage) for stage in cfg.pp_module_names]
    canonical = spec.module_names(args)
    flat = [n for stage in names for n in stage]
    if len(names) != num_stages or any(not stage for stage in names) or flat != canonical:
        raise ConfigError(
            f"parallelism.pp_module_names must be {num_stages} non-empty lists (pp x pp_stages_per_rank) "
            f"that together list, in order, {canonical[0]!r}, '{spec.blocks}.0' ... "
            f"'{spec.blocks}.{args.n_layers - 1}', {', '.join(repr(m) for m in spec.last_modules)} exactly "
            f"once; got {names}. Set it to null for the balanced default."
        )
    return names


def stage_ids_of_rank(pp_rank: int, pp: int, stages_per_rank: int, style: str) -> list[int]:
    """Global stage indices owned by ``pp_rank``: loop style ``r, r+pp, ...``; V style ``r, 2pp-1-r``."""
    if style == "v":
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + k * pp for k in range(stages_per_rank)]


def stages_per_rank(cfg: ParallelismConfig) -> int:
    """``pp_stages_per_rank``, or when unset 1 for GPipe / 1F1B and 2 for interleaved and ZBV."""
    if cfg.pp_stages_per_rank is not None:
        return cfg.pp_stages_per_rank
    return 1 if _kind(cfg.pp_schedule) == "single" else 2


def num_microbatches(cfg: ParallelismConfig, *, local_batch_size: int, micro_batch_size: int) -> int:
    """Pipeline microbatches per step: ``pp_microbatches``, or local batch / ``micro_batch_size``
    (the non-pipelined trainer's gradient-accumulation count) when it is null."""
    if cfg.pp_microbatches is not None:
        return cfg.pp_microbatches
    return max(1, local_batch_size // max(1, micro_batch_size))


def validate_pp(
    spec: ModelSpec,
    args: object,
    cfg: ParallelismConfig,
    *,
    pp: int,
    local_batch_size: int,
    micro_batch_size: int,
    compile: bool = False,
) -> None:
    """Check every pipeline option against the model and batch; raise ``ConfigError`` naming the fix.

    Pure: ``ParallelDims.from_config`` calls it before any process group exists.
    ``local_batch_size`` is the number of sequences one data-parallel rank processes per
    optimizer step (global batch / dp); ``compile`` is ``training.compile``.
    """
    if pp <= 1:
        return
    schedule = _canonical_schedule(cfg.pp_schedule)
    if compile and schedule in ZERO_BUBBLE:
        raise ConfigError(
            f"parallelism.pp_schedule={schedule} splits backward into input and weight gradients, which torch "
            f"cannot do through compiled blocks; set training.compile=false or use 1F1B / Interleaved1F1B."
        )
    if getattr(args, "tie_embeddings", False):
        raise ConfigError(
            f"model.tie_embeddings=true cannot be pipelined (parallelism.pp={pp}): the embedding lives on the "
            f"first stage and the output head on the last, so one shared weight would need its gradient summed "
            f"across stages. Set model.tie_embeddings=false or parallelism.pp=1."
        )
    _validate_stages_per_rank(cfg, schedule)
    _stage_names(spec, args, cfg, pp * stages_per_rank(cfg))
    _validate_microbatches(cfg, schedule, pp, local_batch_size, micro_batch_size)


def _validate_stages_per_rank(cfg: ParallelismConfig, schedule: str) -> None:
    v = cfg.pp_stages_per_rank
    if v is None:
        return
    low, high, text = {"single": (1, 1, "1"), "loop": (2, None, "2 or more"), "v": (2, 2, "2")}[
        _kind(schedule)
    ]
    if isinstance(v, bool) or not isinstance(v, int) or v < low or (high is not None and v > high):
        raise ConfigError(
            f"parallelism.pp_stages_per_rank={v!r} does not fit parallelism.pp_schedule={schedule}, which needs "
            f"{text} virtual stages per rank (GPipe / 1F1B: 1; interleaved schedules: 2 or more; ZBVZeroBubble: "
            f"2). Set pp_stages_per_rank={low}, or null to use that default."
        )


def _validate_microbatches(
    cfg: ParallelismConfig, schedule: str, pp: int, local_batch_size: int, micro_batch_size: int
) -> None:
    if cfg.pp_microbatches is None and (micro_batch_size < 1 or local_batch_size % micro_batch_size != 0):
        raise ConfigError(
            f"the local batch of {local_batch_size} sequences (global batch / dp) is not divisible by "
            f"training.micro_batch_size={micro_batch_size}; change either, or set parallelism.pp_microbatches."
        )
    m = num_microbatches(cfg, local_batch_size=local_batch_size, micro_batch_size=micro_batch_size)
    if isinstance(m, bool) or not isinstance(m, int) or m < pp:
        raise ConfigError(
            f"{m!r} pipeline microbatches (parallelism.pp_microbatches, or local batch {local_batch_size} / "
            f"training.micro_batch_size {micro_batch_size}) is fewer than parallelism.pp={pp} stages, so a "
            f"stage would always idle; use at least {pp} (e.g. lower training.micro_batch_size)."
        )
    if local_batch_size % m != 0:
        raise ConfigError(
            f"parallelism.pp_microbatches={m} does not divide the local batch of {local_batch_size} sequences "
            f"(global batch / dp); choose a divisor of {local_batch_size} that is >= {pp}."
        )
    if _kind(schedule) == "loop" and m % max(1, m // pp) != 0:
        raise ConfigError(
            f"parallelism.pp_schedule={schedule} with {m} microbatches and pp={pp} needs the microbatches to be "
            f"a multiple of the number of rounds max(1, M // pp) = {m // pp}; use a multiple of {pp}."
        )


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


_WIRE_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]  # send/recv header codes


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
        self.loss_fn = loss_fn
        self.step_context = step_context
        self.grad_sync_group = grad_sync_group
        self._loss_scale: Tensor | float = 1.0
        self._group = pp_mesh.get_group()
        self.pp_rank = pp_mesh.get_local_rank()
        pp = pp_mesh.size()
        style = "v" if _kind(self.schedule_name) == "v" else "loop"
        self.stage_to_rank = {
            s: r for r in range(pp) for s in stage_ids_of_rank(r, pp, num_stages // pp, style)
        }
        self.stage_ids = stage_ids
        # Shapes are inferred by torch on the first step (one extra forward/backward), which
        # covers DTensors under TP and any autocast dtype.
        self.stages = [
            PipelineStage(part, s, num_stages, device, group=self._group)
            for part, s in zip(model_parts, stage_ids)
        ]
        self.has_first_stage = 0 in stage_ids
        self.has_last_stage = num_stages - 1 in stage_ids
        cls = SCHEDULES[self.schedule_name]
        self.schedule = cls(
            self.stages if _kind(self.schedule_name) != "single" else self.stages[0],
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
        positions: Optional[Tensor] = None,
    ) -> Tensor:
        """One schedule step over a local batch (B, S); returns this dp rank's summed token loss
        (unscaled, identical on every pp rank). Backward runs on ``loss_sum * loss_scale``
        per microbatch; gradients accumulate into the parts' parameters.

        ``positions`` (B, S) (context-parallel shards, packed documents) reach EVERY stage:
        torch's schedules hand keyword arguments, split into microbatches along the batch, to
        each stage's forward, where the attention layers use them for RoPE and the mask."""
        if self.has_first_stage and inputs is None:
            raise ValueError("Pipeline.step: the rank holding the first stage needs the input tokens.")
        self._micro_sums.clear()
        self._loss_scale = loss_scale
        target = labels if self.has_last_stage else None
        args = (inputs,) if self.has_first_stage else ()
        kwargs = {"positions": _batched(positions, labels)} if positions is not None else {}
        with self.step_context():
            self.schedule.step(*args, target=target, return_outputs=False, **kwargs)
        if self.grad_sync_group is not None:
            for part in self.model_parts:
                _all_reduce_mean_grads(part, self.grad_sync_group)
        loss = torch.zeros((), device=self.device)
        if self.has_last_stage:
            # The first step's metadata inference also calls the loss: keep the last M sums.
            loss = torch.stack(self._micro_sums[-self.n_microbatches :]).sum().float()
        self._micro_sums.clear()
        dist.all_reduce(loss, group=self._group)  # only the last stage's rank contributes
        return loss

    @torch.no_grad()
    def forward_loss_sum(
        self, inputs: Optional[Tensor], labels: Tensor, positions: Optional[Tensor] = None
    ) -> Tensor:
        """Forward only: summed token loss of (B, S) ``labels`` on every pp rank.

        Runs the stages one after another with blocking send/recv (no microbatching), so any
        batch size works and the training schedule's state is untouched.
        """
        part_of = {stage.stage_index: stage.submod for stage in self.stages}
        h: Optional[Tensor] = None
        loss = torch.zeros((), device=self.device)
        with self.step_context():
            for s in range(self.num_stages):
                if self.stage_to_rank[s] != self.pp_rank:
                    continue
                if s == 0:
                    x = inputs
                elif self.stage_to_rank[s - 1] == self.pp_rank:
                    x = h
                else:
                    x = self._recv(self.stage_to_rank[s - 1])
                out = part_of[s](x) if positions is None else part_of[s](x, positions=positions)
                if s == self.num_stages - 1:
                    loss = self.loss_fn(out, labels).float()
                elif self.stage_to_rank[s + 1] != self.pp_rank:
                    self._send(out, self.stage_to_rank[s + 1])
                else:
                    h = out
        dist.all_reduce(loss, group=self._group)
        return loss

    def _send(self, t: Tensor, peer: int) -> None:
        t = t.detach().contiguous()
        header = torch.tensor(
            [_WIRE_DTYPES.index(t.dtype), t.dim(), *t.shape] + [0] * (6 - t.dim()), dtype=torch.long
        )
        dist.send(header.to(self.device), group=self._group, group_dst=peer)
        dist.send(t, group=self._group, group_dst=peer)

    def _recv(self, peer: int) -> Tensor:
        header = torch.zeros(8, dtype=torch.long, device=self.device)
        dist.recv(header, group=self._group, group_src=peer)
        dtype_code, ndim, *shape = header.tolist()
        t = torch.empty(shape[:ndim], dtype=_WIRE_DTYPES[dtype_code], device=self.device)
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
    for p in params:  # every rank must send the same layout
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    grads = [p.grad for p in params]
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
    parallelize_part: Callable[[nn.Module], nn.Module],
    loss_fn: LossFn,
    step_context: Callable[[], ContextManager],
) -> Pipeline:
    """Split the meta-device ``model`` into this pp rank's stages, parallelize each, build the schedule.

    ``ParallelDims.from_config`` has validated the options. ``parallelize_part`` gets each
    stage's module on meta and returns it materialised, initialised and sharded (TP / FSDP)
    like a whole model. Under pure replication (DDP layout) the Pipeline averages gradients
    over ``dp_replicate`` itself, once per step.
    """
    pp_mesh = dims.get_mesh("pp")
    schedule = _canonical_schedule(cfg.pp_schedule)
    v = stages_per_rank(cfg)
    num_stages = dims.pp * v
    names = _stage_names(spec, model.args, cfg, num_stages)
    style = "v" if _kind(schedule) == "v" else "loop"
    stage_ids = stage_ids_of_rank(pp_mesh.get_local_rank(), dims.pp, v, style)
    parts = [parallelize_part(_build_part(model, spec, names[s])) for s in stage_ids]
    return Pipeline(
        parts, stage_ids, pp_mesh, schedule=schedule, num_stages=num_stages,
        n_microbatches=num_microbatches(cfg, local_batch_size=local_batch_size, micro_batch_size=micro_batch_size),
        device=device, loss_fn=loss_fn, step_context=step_context,
        grad_sync_group=dims.ddp_mesh.get_group() if dims.ddp_enabled else None,
    )  # fmt: skip
