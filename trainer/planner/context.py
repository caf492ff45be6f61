"""The planner's shared types and context: ``Collective``, ``StageMemory``, ``Plan``, the per-run
``PlanContext`` (derived once from the config) and the collective/link helpers every section uses."""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional

from models import get_spec
from models.errors import ConfigError
from models.spec import ModelArgs, ModelSpec, PlannerTerms
from parallelisms.parallel_dims import MESH_DIM_NAMES, ParallelDims
from parallelisms.validate import validated_dims
from trainer.planner.cluster import DTYPE_BYTES, GB, ClusterConfig, ring_steps, ring_wire_bytes
from trainer.planner.params import ModuleParams, ParamTable, param_table

if TYPE_CHECKING:
    from trainer.config import TrainConfig

# ----------------------------------------------------------------------------------------------
# The plan
# ----------------------------------------------------------------------------------------------


@dataclass
class Collective:
    """One kind of collective of a step, on one rank."""

    name: str  # what it moves, e.g. "FSDP all_gather (params, fwd+bwd)"
    op: str  # all_reduce | all_gather | reduce_scatter | send_recv | all_to_all
    axis: str  # mesh axis / flattened view it runs on
    group_size: int
    link: str  # intra | inter
    calls: int  # per optimizer step
    size_bytes: float  # per call, the full tensor (logical size)
    logical_bytes: float  # calls x size
    wire_bytes: float  # what this rank sends per step (ring)
    time_s: float  # alpha-beta time per step
    overlap: str  # what it can hide behind ("backward", "forward+backward", "none: critical path")
    window_s: float  # compute time available to hide it (0 when it cannot hide)
    hidden: bool


@dataclass
class StageMemory:
    """Bytes held by one pipeline rank (every rank of a stage holds the same)."""

    pp_rank: int
    layers: int
    params_local: float  # parameters this rank computes with (after PP and TP), count
    params_bytes: float
    grads_bytes: float
    optimizer_bytes: float
    activations_bytes: float
    buffers: dict[str, float]
    total_bytes: float
    saved_per_step: dict[str, float] = field(default_factory=dict)  # saved for backward per step, by scope
    peak_saved: float = 0.0  # live saved bytes at the rank's peak (in-flight microbatches)
    recompute_bytes: float = 0.0  # full AC: one block recomputed in backward (transient)
    sac_cache_bytes: float = 0.0  # op-level AC: matmul outputs cached by torch's checkpoint
    loss_backward_bytes: float = 0.0  # last stage: the loss's backward, two fp32 (tokens x vocab) gradients
    # total_bytes is the most live at one instant of the step (a schedule walk, FSDP's backward
    # instants, or -- one process, DDP -- the larger of the loss's backward and the states' sum): the
    # rehearsal checks it; false for zero-bubble schedules (bounded, not walked)
    peak_instant: bool = False


@dataclass
class CheckpointPlan:
    """One checkpoint save (``trainer/planner/checkpoint.py``): what each rank writes, by global rank."""

    rank_bytes: list[float]  # its files' bytes (rank 0: with DCP's .metadata and the marker)
    rank_files: list[int]  # files in the committed step folder (rank 0: + .metadata, checkpoint.json)
    rank_entries: list[int]  # DCP entries (tensor chunks, objects) it writes after de-duplication
    metadata_bytes: float  # rank 0's .metadata
    marker_bytes: float  # rank 0's checkpoint.json
    entries: int  # distinct DCP entries of the whole checkpoint
    files_per_rank: int  # data files each rank writes (FileSystemWriter's thread_count; 0: one per entry)

    @property
    def total_bytes(self) -> float:
        return sum(self.rank_bytes)

    def ranks_of(self, pp_rank: int, pp: int) -> range:
        """The global ranks of pipeline rank ``pp_rank`` (pp is the outermost mesh dim)."""
        n = len(self.rank_bytes) // pp
        return range(pp_rank * n, (pp_rank + 1) * n)


@dataclass
class Plan:
    experiment: str
    model: str
    cluster: ClusterConfig
    layout: dict[str, Any]
    strategy: str
    params_total: int
    activation_per_token_layer: dict[str, float]
    stages: list[StageMemory]
    collectives: list[Collective]  # pp rank 0's (every rank of a pp stage issues the same)
    compute: dict[str, float]
    pp_rank_collectives: list[list[Collective]] = field(default_factory=list)  # per pp rank
    verdict: dict[str, Any] = field(default_factory=dict)
    checkpoint: Optional[CheckpointPlan] = None  # one save per rank (None: not planned, the launch check)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2)


def link_kind(dims: ParallelDims, axes: tuple[str, ...], gpus_per_node: int) -> str:
    """intra when every group along ``axes`` (adjacent in the mesh, node-contiguous ranks) fits
    inside one node, else inter (the ring's slowest hop sets its pace)."""
    if axes == ("ep",):  # dp_shard_in_ep x cp, inside tp
        return "intra" if dims.ep * dims.tp <= gpus_per_node else "inter"
    if axes == ("dp_shard_mod_ep",):  # strided over the ep groups
        return "intra" if dims.dp_shard * dims.cp * dims.tp <= gpus_per_node else "inter"
    inner = 1
    for name in reversed(MESH_DIM_NAMES):
        if name in axes:
            break
        inner *= getattr(dims, name)
    span = inner * math.prod(getattr(dims, a) for a in axes)
    return "intra" if span <= gpus_per_node else "inter"


def make_collective(
    cluster: ClusterConfig,
    name: str,
    op: str,
    axis: str,
    n: int,
    link: str,
    calls: int,
    size: float,
    overlap: str,
    window_s: float,
) -> Collective:
    bw = (cluster.intra_bw_gbs if link == "intra" else cluster.inter_bw_gbs) * GB
    alpha = (cluster.intra_latency_us if link == "intra" else cluster.inter_latency_us) * 1e-6
    wire = calls * ring_wire_bytes(op, size, n)
    t = calls * ring_steps(op, n) * alpha + wire / bw
    return Collective(
        name=name,
        op=op,
        axis=axis,
        group_size=n,
        link=link,
        calls=calls,
        size_bytes=size,
        logical_bytes=calls * size,
        wire_bytes=wire,
        time_s=t,
        overlap=overlap,
        window_s=window_s,
        hidden=window_s > 0 and t <= window_s,
    )


@dataclass
class PlannedStage:
    """One virtual pipeline stage: its global index, blocks and whether it holds the first/last modules."""

    index: int
    blocks: list[int]
    first: bool
    last: bool


@dataclass
class PlanContext:
    """Everything the sections of the plan share (derived once from the config)."""

    cfg: TrainConfig
    spec: ModelSpec
    terms: PlannerTerms  # the family's view of its blocks (``spec.planner_terms(cfg.model)``)
    dims: ParallelDims
    cluster: ClusterConfig
    table: ParamTable  # parameters per block / first / last modules, TP kinds
    ranks: list[list[PlannedStage]]  # per pp rank, its virtual stages
    micro_batch: int  # sequences of one microbatch on one rank
    local_batch: int  # sequences per step on one dp rank
    micro_tokens: int  # tokens of one microbatch on one rank (after CP)
    accum: int  # microbatches per step on a dp rank (PP: pipeline microbatches)
    schedule: str
    stages_per_rank: int
    act_bytes: int
    sync_bytes: int  # gradient dtype on the wire of the data-parallel sync
    param_gather_bytes: int  # FSDP param_dtype
    reshard_after_forward: bool
    # The global rank whose owner-assigned terms (ZeRO-1's optimizer state, Muon's momentum and
    # exchange: ``trainer/planner/owners.py``) the plan gives for its stage; None: their mean.
    rank: Optional[int] = None

    @property
    def tp_sp(self) -> tuple[int, bool]:
        return self.dims.tp, self.dims.tp > 1 and self.cfg.parallelism.sequence_parallel

    @property
    def recompute(self) -> bool:
        return self.cfg.training.activation_checkpoint == "full"

    def group(self, pp_rank: int) -> ModuleParams:
        """The parameters of ``pp_rank``'s stages (before any sharding)."""
        out = ModuleParams()
        for st in self.ranks[pp_rank]:
            for b in st.blocks:
                out = out.add(self.table.blocks[b])
            out = out.add(self.table.first) if st.first else out
            out = out.add(self.table.last) if st.last else out
        return out


def dims_of(cfg: TrainConfig, world_size: int, device_type: str = "cuda") -> ParallelDims:
    """The layout ``cfg`` validates to at ``world_size`` ranks on ``device_type`` (``dp_shard=-1``
    resolved), every layout check included: what a launch of that size gets."""
    t = cfg.training
    return validated_dims(
        cfg.parallelism,
        world_size,
        spec=get_spec(cfg.model.family),
        model_args=cfg.model,
        seq_len=t.seq_len,
        global_batch_size=t.global_batch_size,
        micro_batch_size=t.micro_batch_size,
        compile=t.compile,
        device_type=device_type,
    )


def world_size_of(cfg: TrainConfig, cluster: ClusterConfig) -> int:
    p = cfg.parallelism
    others = p.dp_replicate * p.cp * p.tp * p.pp
    if p.dp_shard != -1:
        return others * p.dp_shard
    if cluster.nodes is None:
        raise ConfigError(
            "parallelism.dp_shard=-1 leaves the world size open; give it with cluster.nodes=N "
            f"(x cluster.gpus_per_node={cluster.gpus_per_node}) or set parallelism.dp_shard."
        )
    return cluster.nodes * cluster.gpus_per_node


def stages_of(spec: Any, args: Any, p: Any, dims: ParallelDims, per_rank: int) -> list[list[PlannedStage]]:
    """Per pp rank, its virtual stages (the trainer's own split, ``parallelisms.pipeline_parallel``)."""
    if dims.pp == 1:
        return [[PlannedStage(0, list(range(args.n_layers)), True, True)]]
    from parallelisms.pipeline_split import stage_ids_of_rank, stage_names

    names = stage_names(spec, args, p, dims.pp * per_rank)
    style = "v" if p.pp_schedule.lower() == "zbvzerobubble" else "loop"
    prefix = f"{spec.blocks}."
    out = []
    for r in range(dims.pp):
        stages = []
        for i in stage_ids_of_rank(r, dims.pp, per_rank, style):
            mods = names[i]
            blocks = [int(m[len(prefix) :]) for m in mods if m.startswith(prefix)]
            stages.append(
                PlannedStage(i, blocks, spec.first_modules[0] in mods, spec.last_modules[-1] in mods)
            )
        out.append(stages)
    return out


def planner_terms_of(spec: ModelSpec, args: ModelArgs) -> PlannerTerms:
    """The family's planner terms (``ModelSpec.planner_terms``); a ConfigError when it declares none."""
    if spec.planner_terms is None:
        raise ConfigError(
            f"model.family={spec.family!r} declares no planner_terms on its ModelSpec: the planner cannot "
            "plan its blocks; add them (models/spec.py, PlannerTerms) or set metrics.memory_check=off."
        )
    return spec.planner_terms(args)


def build_context(
    cfg: TrainConfig, cluster: ClusterConfig, dims: Optional[ParallelDims] = None, rank: Optional[int] = None
) -> PlanContext:
    """The plan's shared context for ``cfg`` on ``cluster``. ``dims``: the run's layout when the caller
    has validated it already against ``cfg`` (the trainer's launch check); None validates it here.
    ``rank``: plan the owner-assigned terms of this global rank (default: their mean)."""
    from parallelisms.pipeline_split import num_microbatches, stages_per_rank

    spec, t, p = get_spec(cfg.model.family), cfg.training, cfg.parallelism
    if dims is None:
        dims = dims_of(cfg, world_size_of(cfg, cluster), "cpu" if cluster.backend == "gloo" else "cuda")
    local_batch = dims.local_batch_size(t.global_batch_size)
    if dims.pp > 1:
        accum = num_microbatches(p, local_batch_size=local_batch, micro_batch_size=t.micro_batch_size)
        micro_batch = local_batch // accum
    else:
        accum = dims.grad_accum_steps(t.global_batch_size, t.micro_batch_size)
        micro_batch = t.micro_batch_size
    grad_wire = p.ddp.grad_dtype if (dims.ddp_enabled and p.ddp.grad_dtype) else "float32"
    sync_dtype = p.fsdp.reduce_dtype if dims.fsdp_enabled else grad_wire
    reshard = p.fsdp.reshard_after_forward
    per_rank = stages_per_rank(p) if dims.pp > 1 else 1
    return PlanContext(
        cfg=cfg,
        spec=spec,
        terms=planner_terms_of(spec, cfg.model),
        dims=dims,
        cluster=cluster,
        table=param_table(spec, cfg.model),
        ranks=stages_of(spec, cfg.model, p, dims, per_rank),
        micro_batch=micro_batch,
        local_batch=local_batch,
        micro_tokens=micro_batch * t.seq_len // dims.cp,
        accum=accum,
        schedule=p.pp_schedule,
        stages_per_rank=per_rank,
        act_bytes=2 if t.mixed_precision == "bf16" else 4,
        sync_bytes=DTYPE_BYTES[sync_dtype],
        param_gather_bytes=DTYPE_BYTES[p.fsdp.param_dtype],
        reshard_after_forward=(dims.pp == 1) if reshard is None else reshard,
        rank=rank,
    )


def strategy_of(dims: ParallelDims, cfg: TrainConfig) -> str:
    parts = []
    if dims.pp > 1:
        parts.append(f"PP{dims.pp}")
    if dims.ddp_enabled:
        parts.append(f"DDP{dims.dp_replicate}" + ("+ZeRO-1" if cfg.parallelism.ddp.sharded_optimizer else ""))
    elif dims.hsdp_enabled:
        parts.append(f"HSDP{dims.dp_replicate}x{dims.dp_shard}")
    elif dims.fsdp_enabled:
        parts.append(f"FSDP{dims.dp_shard * dims.cp}")
    if dims.cp > 1:
        parts.append(f"CP{dims.cp}")
    if dims.ep > 1:
        parts.append(f"EP{dims.ep}")
    if dims.tp > 1:
        parts.append(f"TP{dims.tp}" + ("+SP" if cfg.parallelism.sequence_parallel else ""))
    return " x ".join(parts) or "single device"


# -- memory ----------------------------------------------------------------------------------
