"""The planner: per-rank memory and per-step communication of a layout, before launch.

``python -m trainer.plan +experiment=7b_hsdp [cluster=h100_node cluster.nodes=4 ...] [--json]``

It composes the same Hydra config as training (plus the planner-only ``cluster`` group,
``configs/cluster/``), validates the layout with ``validated_dims`` and answers the
two questions that decide every layout: does each rank's memory fit, and can communication
hide behind compute. Nothing is built: parameter counts come from ``spec.param_counts`` and
the model args, FLOPs from ``spec.flops_per_token``.

The model, in units of bytes (decimal GB = 1e9 in the formulas, GiB in the verdict):

- model states, per rank, for the parameters it holds after PP (its stages) and TP (1/tp of
  every matrix, norms replicated): fp32 parameters (4 B), gradients (4 B, or the DDP bucket
  dtype), AdamW's two fp32 moments (8 B) -- 16 B per parameter replicated (DDP); ZeRO-1
  divides the moments by the DDP degree; FSDP/HSDP divides all 16 B by dp_shard x cp;
- activations per layer and token (bf16): ``34 H`` bytes without checkpointing with SDPA (no
  S^2 scores stored): 10 H outside the TP regions (norm inputs, block inputs, dropout-style
  masks) and 24 H inside (Q/K/V, attention output, MLP intermediates); GQA shrinks K and V by
  ``n_kv_heads / n_heads``; TP divides the inside part by tp, sequence parallel the outside
  part too; CP divides the tokens by cp. Full checkpointing keeps the block input (2 H per
  token) plus one layer's full activations while it is recomputed;
- buffers: FSDP's two unsharded blocks in ``param_dtype`` (prefetch) and one block's unsharded
  gradient in ``reduce_dtype``; the DDP buckets (the whole flattened gradient, held until
  ``finish_gradient_sync``); PP in-flight microbatches per schedule; the last stage's logits;
- communication with the alpha-beta ring model: a collective over n ranks moves, per rank,
  ``2 (n-1)/n x size`` (all-reduce) or ``(n-1)/n x size`` (all-gather, reduce-scatter; size
  = the full tensor) and takes ``steps x alpha + bytes / bus_bandwidth``; a group that spans
  nodes runs at the inter-node bandwidth.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import math
import os
import sys
from dataclasses import dataclass, field
from typing import Any, Optional

from omegaconf import OmegaConf

from models import get_spec
from models.errors import ConfigError
from parallelisms.parallel_dims import ParallelDims
from parallelisms.validate import validated_dims
from trainer.config import CONFIG_DIR
from trainer.plan_params import ModuleParams, ParamTable, param_table

__all__ = [
    "ClusterConfig",
    "Collective",
    "Plan",
    "activation_bytes_per_token_layer",
    "build_plan",
    "compose_cluster",
    "main",
    "ring_steps",
    "ring_wire_bytes",
]

CLUSTER_DIR = os.path.join(CONFIG_DIR, "cluster")
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
GB = 1e9
GIB = 2**30
ADAM_BYTES = 8  # two fp32 moments per parameter
MESH_ORDER = ("pp", "dp_replicate", "dp_shard", "cp", "tp")  # outermost first


@dataclass
class ClusterConfig:
    """The ``cluster`` group (planner only): the machine a layout is planned for."""

    name: str = "h100_node"
    gpus_per_node: int = 8
    nodes: Optional[int] = None  # None = world size / gpus_per_node
    memory_gib: float = 79.6
    intra_bw_gbs: float = 300.0  # per-GPU collective bus bandwidth inside a node, GB/s
    inter_bw_gbs: float = 50.0  # per-GPU collective bus bandwidth across nodes, GB/s
    intra_latency_us: float = 3.0
    inter_latency_us: float = 10.0
    peak_tflops: float = 989.0
    mfu: float = 0.45  # fraction of peak the matmuls reach
    workspace_gib: float = 3.0
    backend: str = "nccl"  # nccl | gloo: the collectives a strategy picks (ZeRO-1 re-replicates by broadcast on gloo)


def compose_cluster(overrides: list[str]) -> ClusterConfig:
    """``cluster=<preset>`` picks ``configs/cluster/<preset>.yaml`` (default h100_node);
    ``cluster.<key>=<value>`` overrides a field (typed: unknown keys and bad types fail)."""
    preset, dotlist = "h100_node", []
    for o in overrides:
        key, _, value = o.partition("=")
        if key == "cluster":
            preset = value
        else:
            dotlist.append(f"{key[len('cluster.'):]}={value}")
    path = os.path.join(CLUSTER_DIR, f"{preset}.yaml")
    if not os.path.isfile(path):
        choices = sorted(p[:-5] for p in os.listdir(CLUSTER_DIR) if p.endswith(".yaml"))
        raise ConfigError(f"cluster={preset!r} is not a preset; choose one of {choices}.")
    try:
        merged = OmegaConf.merge(
            OmegaConf.structured(ClusterConfig), OmegaConf.load(path), OmegaConf.from_dotlist(dotlist)
        )
    except Exception as e:  # OmegaConf's own message names the key and the type
        bad = " ".join(f"cluster.{d}" for d in dotlist)
        raise ConfigError(
            f"bad cluster override {bad}: {str(e).splitlines()[0]}; the keys and their types are the fields "
            f"of ClusterConfig (trainer/plan.py), as in {path}."
        ) from e
    cluster = OmegaConf.to_object(merged)
    for key in ("gpus_per_node", "memory_gib", "intra_bw_gbs", "inter_bw_gbs", "peak_tflops", "mfu"):
        if not getattr(cluster, key) > 0:
            raise ConfigError(f"cluster.{key}={getattr(cluster, key)} must be > 0.")
    if cluster.mfu > 1:
        raise ConfigError(f"cluster.mfu={cluster.mfu} is a fraction of the peak; set it in (0, 1].")
    if cluster.nodes is not None and cluster.nodes < 1:
        raise ConfigError(f"cluster.nodes={cluster.nodes} must be >= 1 (unset: world / gpus_per_node).")
    return cluster


# ----------------------------------------------------------------------------------------------
# Pure formulas (the seed article's rules; tests check its worked figures against these)
# ----------------------------------------------------------------------------------------------


def ring_wire_bytes(op: str, size: float, n: int) -> float:
    """Bytes each rank sends per call of ``op`` over ``n`` ranks in a ring; ``size`` is the full
    (unsharded) tensor -- for all-reduce the tensor every rank holds."""
    if n <= 1:
        return 0.0
    if op == "all_reduce":
        return 2 * (n - 1) / n * size
    if op in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) / n * size
    if op == "broadcast":  # pipelined ring: every rank but the last forwards it; (n-1)/n on average over roots
        return (n - 1) / n * size
    if op in ("send", "send_recv"):
        return float(size)
    if op == "recv":
        return 0.0
    raise ValueError(f"unknown collective {op!r}")


def ring_steps(op: str, n: int) -> int:
    """Latency terms (alpha) per call: 2 (n-1) ring steps for all-reduce, n-1 for the halves."""
    if n <= 1:
        return 0
    return {"all_reduce": 2 * (n - 1), "send_recv": 1, "send": 1, "recv": 1}.get(op, n - 1)


def activation_bytes_per_token_layer(
    dim: int, n_heads: int, n_kv_heads: int, *, tp: int = 1, sequence_parallel: bool = False, act_bytes: int = 2
) -> float:
    """Activation bytes one layer saves for backward per token (no checkpointing, SDPA).

    The article's ``34 H`` (bf16): 10 H outside the TP regions, 24 H inside; with GQA the K and
    V parts (2 H each) scale by ``n_kv_heads / n_heads``; TP divides the inside part, SP the
    outside part as well. ``act_bytes=4`` (fp32 training) doubles everything.
    """
    inside = 24 - 4 * (1 - n_kv_heads / n_heads)
    outside = 10.0
    coeff = (outside + inside) / tp if (tp > 1 and sequence_parallel) else outside + inside / tp
    return coeff * dim * act_bytes / 2


def pp_bubble(schedule: str, pp: int, microbatches: int, stages_per_rank: int) -> float:
    """Idle fraction of a pipeline step: ``(K-1)/(M+K-1)``, divided by v when interleaved;
    zero-bubble schedules fill it with weight-gradient work (~0)."""
    if pp <= 1:
        return 0.0
    if "zerobubble" in schedule.lower():
        return 0.0
    bubble = (pp - 1) / (microbatches + pp - 1)
    return bubble / stages_per_rank


def pp_in_flight(schedule: str, pp: int, microbatches: int, stages_per_rank: int, pp_rank: int = 0) -> float:
    """Microbatches whose activations ``pp_rank`` holds at its peak, in units of its own layers:
    GPipe (and LoopedBFS) all M; 1F1B min(M, K - rank); interleaved 1F1B (K - rank) (1 + (K-1)/(K v))
    (Megatron's estimate); zero-bubble schedules as 1F1B."""
    if pp <= 1:
        return 1.0
    if schedule.lower() in ("gpipe", "loopedbfs"):
        return float(microbatches)
    warmup = float(pp - pp_rank)
    if stages_per_rank > 1:
        warmup *= 1 + (pp - 1) / (pp * stages_per_rank)
    return min(float(microbatches), warmup)


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

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2)


def _link(dims: ParallelDims, axes: tuple[str, ...], gpus_per_node: int) -> str:
    """intra when every group along ``axes`` (adjacent in the mesh, node-contiguous ranks) fits
    inside one node, else inter (the ring's slowest hop sets its pace)."""
    if axes == ("ep",):  # dp_shard_in_ep x cp, inside tp
        return "intra" if dims.ep * dims.tp <= gpus_per_node else "inter"
    if axes == ("dp_shard_mod_ep",):  # strided over the ep groups
        return "intra" if dims.dp_shard * dims.cp * dims.tp <= gpus_per_node else "inter"
    inner = 1
    for name in reversed(MESH_ORDER):
        if name in axes:
            break
        inner *= getattr(dims, name)
    span = inner * math.prod(getattr(dims, a) for a in axes)
    return "intra" if span <= gpus_per_node else "inter"


def _collective(
    cluster: ClusterConfig, name: str, op: str, axis: str, n: int, link: str, calls: int, size: float,
    overlap: str, window_s: float,
) -> Collective:  # fmt: skip
    bw = (cluster.intra_bw_gbs if link == "intra" else cluster.inter_bw_gbs) * GB
    alpha = (cluster.intra_latency_us if link == "intra" else cluster.inter_latency_us) * 1e-6
    wire = calls * ring_wire_bytes(op, size, n)
    t = calls * ring_steps(op, n) * alpha + wire / bw
    return Collective(
        name=name, op=op, axis=axis, group_size=n, link=link, calls=calls, size_bytes=size,
        logical_bytes=calls * size, wire_bytes=wire, time_s=t, overlap=overlap, window_s=window_s,
        hidden=window_s > 0 and t <= window_s,
    )  # fmt: skip


@dataclass
class _Stage:
    """One virtual pipeline stage: its global index, blocks and whether it holds the first/last modules."""

    index: int
    blocks: list[int]
    first: bool
    last: bool


@dataclass
class _Ctx:
    """Everything the sections of the plan share (derived once from the config)."""

    cfg: Any
    spec: Any
    dims: ParallelDims
    cluster: ClusterConfig
    table: ParamTable  # parameters per block / first / last modules, TP kinds
    ranks: list[list[_Stage]]  # per pp rank, its virtual stages
    micro_batch: int  # sequences of one microbatch on one rank
    micro_tokens: int  # tokens of one microbatch on one rank (after CP)
    accum: int  # microbatches per step on a dp rank (PP: pipeline microbatches)
    schedule: str
    stages_per_rank: int
    act_bytes: int
    sync_bytes: int  # gradient dtype on the wire of the data-parallel sync
    param_gather_bytes: int  # FSDP param_dtype
    reshard_after_forward: bool

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


def _world_size(cfg: Any, cluster: ClusterConfig) -> int:
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


def _stages(spec: Any, args: Any, p: Any, dims: ParallelDims, per_rank: int) -> list[list[_Stage]]:
    """Per pp rank, its virtual stages (the trainer's own split, ``parallelisms.pipeline_parallel``)."""
    if dims.pp == 1:
        return [[_Stage(0, list(range(args.n_layers)), True, True)]]
    from parallelisms.pipeline_split import stage_ids_of_rank, stage_names

    names = stage_names(spec, args, p, dims.pp * per_rank)
    style = "v" if p.pp_schedule.lower() == "zbvzerobubble" else "loop"
    prefix = f"{spec.blocks}."
    out = []
    for r in range(dims.pp):
        stages = []
        for i in stage_ids_of_rank(r, dims.pp, per_rank, style):
            mods = names[i]
            blocks = [int(m[len(prefix):]) for m in mods if m.startswith(prefix)]
            stages.append(_Stage(i, blocks, spec.first_modules[0] in mods, spec.last_modules[-1] in mods))
        out.append(stages)
    return out


def _context(cfg: Any, cluster: ClusterConfig) -> _Ctx:
    from parallelisms.pipeline_split import num_microbatches, stages_per_rank

    spec, t, p = get_spec(cfg.model.family), cfg.training, cfg.parallelism
    dims = validated_dims(
        p, _world_size(cfg, cluster), spec=spec, model_args=cfg.model, seq_len=t.seq_len,
        global_batch_size=t.global_batch_size, micro_batch_size=t.micro_batch_size, compile=t.compile,
        device_type="cpu" if cluster.backend == "gloo" else "cuda",
    )  # fmt: skip
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
    return _Ctx(
        cfg=cfg, spec=spec, dims=dims, cluster=cluster, table=param_table(spec, cfg.model),
        ranks=_stages(spec, cfg.model, p, dims, per_rank), micro_batch=micro_batch,
        micro_tokens=micro_batch * t.seq_len // dims.cp, accum=accum, schedule=p.pp_schedule,
        stages_per_rank=per_rank, act_bytes=2 if t.mixed_precision == "bf16" else 4,
        sync_bytes=DTYPE_BYTES[sync_dtype], param_gather_bytes=DTYPE_BYTES[p.fsdp.param_dtype],
        reshard_after_forward=(dims.pp == 1) if reshard is None else reshard,
    )  # fmt: skip


def _strategy(dims: ParallelDims, cfg: Any) -> str:
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


def _activations(c: _Ctx, layers: int, has_head: bool, pp_rank: int) -> float:
    """Activation bytes of ``layers`` blocks on one rank at its peak (in-flight microbatches)."""
    args, t = c.cfg.model, c.cfg.training
    tp, sp = c.tp_sp
    per_tok = activation_bytes_per_token_layer(
        args.dim, args.n_heads, args.kv_heads, tp=tp, sequence_parallel=sp, act_bytes=c.act_bytes
    )
    block_input = 2 * args.dim * c.act_bytes / 2 / (tp if sp else 1)
    in_flight = pp_in_flight(c.schedule, c.dims.pp, c.accum, c.stages_per_rank, pp_rank)
    tokens = c.micro_tokens
    if t.activation_checkpoint == "full":
        stored = layers * in_flight * tokens * block_input + tokens * per_tok  # + one layer recomputed
    elif t.activation_checkpoint == "selective" and t.ac_selective == "layer":
        k = t.ac_layer_interval
        ckpt = layers // k
        stored = in_flight * tokens * (ckpt * block_input + (layers - ckpt) * per_tok) + tokens * per_tok
    else:  # none, or selective op (SDPA already keeps no S^2 scores: about the same as none)
        stored = layers * in_flight * tokens * per_tok
    if has_head:  # fp32 logits for the loss, vocab-sharded under loss parallel
        vocab_split = tp if (tp > 1 and c.cfg.parallelism.loss_parallel) else 1
        stored += tokens * args.vocab_size / vocab_split * 4
    return stored


def _stage_memory(c: _Ctx, pp_rank: int) -> StageMemory:
    """Model states, activations and buffers of ``pp_rank``: parameters after TP (1/tp of the
    sharded kinds) and EP (1/ep of the experts); FSDP divides all by dp_shard x cp (experts: their
    ep share by dp_shard x cp / ep); DDP's gradients live in its flat buckets (param dtype)."""
    dims, p = c.dims, c.cfg.parallelism
    tp = dims.tp
    stages = c.ranks[pp_rank]
    group = c.group(pp_rank)
    local = group.local(tp, dims.ep)
    held = local  # parameters this rank stores: FSDP shards the dense ones over dp_shard x cp and the
    if dims.fsdp_enabled:  # experts' ep share over what is left of it (dp_shard x cp / ep)
        experts = group.experts / dims.ep
        held = (local - experts) / (dims.dp_shard * dims.cp) + experts / (dims.dp_shard * dims.cp // dims.ep)
    params_b, grads_b, opt_b = 4 * held, 4 * held, ADAM_BYTES * held
    buffers: dict[str, float] = {}
    if dims.ddp_enabled and p.ddp.sharded_optimizer:
        opt_b = ADAM_BYTES * local / dims.dp_replicate
    if dims.ddp_enabled and p.ddp.grad_dtype and DTYPE_BYTES[p.ddp.grad_dtype] != 4:
        buffers["ddp_wire_cast"] = min(local, p.ddp.bucket_mb * 1e6 / 4) * DTYPE_BYTES[p.ddp.grad_dtype]
    blocks = [b for st in stages for b in st.blocks]
    if dims.fsdp_enabled and blocks:
        block_local = max(c.table.blocks[b].local(tp, dims.ep) for b in blocks)
        gathered = (len(blocks) if not c.reshard_after_forward else min(2, len(blocks))) * block_local
        buffers["fsdp_unsharded_params"] = gathered * c.param_gather_bytes
        buffers["fsdp_grad_reduce"] = block_local * c.sync_bytes
    acts = _activations(c, len(blocks), any(st.last for st in stages), pp_rank)
    if dims.pp > 1:
        boundary = c.micro_tokens * c.cfg.model.dim * c.act_bytes / (tp if c.tp_sp[1] else 1)
        buffers["pp_p2p"] = 2 * boundary * c.stages_per_rank  # send + recv buffers per virtual stage
    total = params_b + grads_b + opt_b + acts + sum(buffers.values())
    return StageMemory(
        pp_rank=pp_rank, layers=len(blocks), params_local=local, params_bytes=params_b, grads_bytes=grads_b,
        optimizer_bytes=opt_b, activations_bytes=acts, buffers=buffers, total_bytes=total,
    )  # fmt: skip


# -- communication and compute ---------------------------------------------------------------


def _compute(c: _Ctx) -> dict[str, float]:
    """FLOPs and time of one step on one rank; full checkpointing recomputes the forward (+1/3)."""
    t, dims = c.cfg.training, c.dims
    tokens = t.global_batch_size * t.seq_len
    flops = c.spec.flops_per_token(c.cfg.model, t.seq_len) * tokens / dims.world_size
    recompute = 4 / 3 if c.recompute else 1.0
    seconds = flops * recompute / (c.cluster.peak_tflops * 1e12 * c.cluster.mfu)
    bubble = pp_bubble(c.schedule, dims.pp, c.accum, c.stages_per_rank)
    return {
        "tokens_per_step": float(tokens), "flops_per_rank": flops * recompute, "compute_s": seconds,
        "forward_s": seconds * (1 / 3 if recompute == 1 else 1 / 2), "backward_s": seconds * (2 / 3 if recompute == 1 else 1 / 2),
        "pp_bubble": bubble, "compute_with_bubble_s": seconds / (1 - bubble),
    }  # fmt: skip


def _verdict(plan: Plan) -> dict[str, Any]:
    cl, comp = plan.cluster, plan.compute
    peak = max(s.total_bytes for s in plan.stages) + cl.workspace_gib * GIB
    free = cl.memory_gib * GIB - peak

    def exposed_of(rows: list[Collective]) -> tuple[float, float]:
        overlappable = sum(x.time_s for x in rows if x.window_s > 0)
        critical = sum(x.time_s for x in rows if x.window_s == 0)
        return critical + max(0.0, overlappable - comp["compute_s"]), overlappable

    # the slowest pipeline rank sets the pace
    exposed, overlappable = max(exposed_of(rows) for rows in (plan.pp_rank_collectives or [plan.collectives]))
    step = comp["compute_with_bubble_s"] + exposed
    comm_share = exposed / step if step > 0 else 0.0
    memory = (f"fits with {free / GIB:.1f} GiB free" if free >= 0 else f"does not fit by {-free / GIB:.1f} GiB") + (
        f" (peak {peak / GIB:.1f} of {cl.memory_gib:.1f} GiB, incl. {cl.workspace_gib:g} GiB workspace)"
    )
    if comm_share > 0.05:
        comm = f"communication-bound by {100 * comm_share:.0f}% (exposed {exposed * 1e3:.0f} ms of a {step * 1e3:.0f} ms step)"
    else:
        comm = (f"compute-bound: {overlappable * 1e3:.0f} ms of overlappable communication hides behind "
                f"{comp['compute_s'] * 1e3:.0f} ms of compute; {exposed * 1e3:.0f} ms exposed")  # fmt: skip
    return {
        "fits": free >= 0, "peak_bytes": peak, "free_bytes": free, "memory": memory, "exposed_comm_s": exposed,
        "step_s": step, "comm_bound_fraction": comm_share, "communication": comm,
        "tokens_per_s": comp["tokens_per_step"] / step if step > 0 else 0.0,
    }  # fmt: skip


def build_plan(cfg: Any, cluster: ClusterConfig, experiment: str = "") -> Plan:
    """The plan of ``cfg`` (a validated ``TrainConfig``) on ``cluster``; builds the model only on the
    meta device (shapes, no storage) to classify its parameters."""
    c = _context(cfg, cluster)
    stages = [_stage_memory(c, r) for r in range(c.dims.pp)]
    comp = _compute(c)
    from trainer.plan_comm import rank_collectives

    by_rank = [rank_collectives(c, r, comp) for r in range(c.dims.pp)]
    args = cfg.model
    tp, sp = c.tp_sp
    per_tok = {
        "no_ac": activation_bytes_per_token_layer(args.dim, args.n_heads, args.kv_heads, tp=tp,
                                                  sequence_parallel=sp, act_bytes=c.act_bytes),
        "full_ac": 2 * args.dim * c.act_bytes / 2 / (tp if sp else 1),
    }  # fmt: skip
    d = c.dims
    layout = {
        "world_size": d.world_size, "nodes": math.ceil(d.world_size / cluster.gpus_per_node),
        "pp": d.pp, "dp_replicate": d.dp_replicate, "dp_shard": d.dp_shard, "cp": d.cp, "tp": d.tp,
        "microbatches": c.accum, "micro_tokens": c.micro_tokens, "pp_schedule": c.schedule if d.pp > 1 else None,
        "pp_stages_per_rank": c.stages_per_rank, "activation_checkpoint": cfg.training.activation_checkpoint,
        "mixed_precision": cfg.training.mixed_precision, "fsdp_reshard_after_forward": c.reshard_after_forward,
    }  # fmt: skip
    plan = Plan(
        experiment=experiment, model=args.name, cluster=cluster, layout=layout, strategy=_strategy(d, cfg),
        params_total=c.spec.param_counts(args).total, activation_per_token_layer=per_tok, stages=stages,
        collectives=by_rank[0], compute=comp, pp_rank_collectives=by_rank,
    )  # fmt: skip
    plan.verdict = _verdict(plan)
    return plan


# -- report ------------------------------------------------------------------------------------


def _gb(x: float) -> str:
    return f"{x / GB:9.2f}"


def _memory_table(plan: Plan) -> list[str]:
    lines = [f"{'pp rank':>7} {'blocks':>6} {'params':>9} {'grads':>9} {'optim':>9} {'activ.':>9} "
             f"{'buffers':>9} {'total':>9}   (GB per rank)"]  # fmt: skip
    stages = plan.stages
    shown = stages if len(stages) <= 6 else [*stages[:3], None, *stages[-2:]]
    for s in shown:
        if s is None:
            lines.append(f"{'...':>7}")
            continue
        lines.append(f"{s.pp_rank:>7} {s.layers:>6} {_gb(s.params_bytes)} {_gb(s.grads_bytes)} "
                     f"{_gb(s.optimizer_bytes)} {_gb(s.activations_bytes)} {_gb(sum(s.buffers.values()))} "
                     f"{_gb(s.total_bytes)}")  # fmt: skip
    first = stages[0]
    lines.append("buffers (pp rank 0): " + (", ".join(f"{k} {v / GB:.2f} GB" for k, v in first.buffers.items()) or "none"))
    return lines


def _comm_table(plan: Plan) -> list[str]:
    lines = [f"{'collective':<46} {'axis':<15} {'n':>4} {'link':<5} {'calls':>6} {'per call':>9} "
             f"{'logical':>9} {'wire':>9} {'time ms':>9}  hides"]  # fmt: skip
    for x in plan.collectives:
        hides = ("yes" if x.hidden else "no") + f" ({x.overlap})"
        lines.append(f"{x.name:<46} {x.axis:<15} {x.group_size:>4} {x.link:<5} {x.calls:>6} "
                     f"{x.size_bytes / 1e6:>7.1f}MB {_gb(x.logical_bytes)} {_gb(x.wire_bytes)} {x.time_s * 1e3:>9.1f}  {hides}")  # fmt: skip
    for link in ("intra", "inter"):
        wire = sum(x.wire_bytes for x in plan.collectives if x.link == link)
        lines.append(f"  {link}-node wire bytes per rank per step: {wire / GB:.2f} GB")
    return lines


def render(plan: Plan) -> str:
    """The plan as a readable report (GB = 1e9 bytes; the verdict in GiB)."""
    lay, comp, cl, v = plan.layout, plan.compute, plan.cluster, plan.verdict
    act = plan.activation_per_token_layer
    out = [
        f"plan: {plan.experiment or '(overrides)'}  model {plan.model} ({plan.params_total / 1e9:.2f}B params)  "
        f"on {lay['nodes']} x {cl.gpus_per_node} {cl.name}",
        f"layout: {plan.strategy}  (world {lay['world_size']}: pp {lay['pp']} x dp_replicate {lay['dp_replicate']} "
        f"x dp_shard {lay['dp_shard']} x cp {lay['cp']} x tp {lay['tp']}); {lay['microbatches']} microbatch(es) "
        f"of {lay['micro_tokens']} tokens per rank; AC {lay['activation_checkpoint']}; {lay['mixed_precision']}",
        f"activations per layer per token: {act['no_ac'] / 1e3:.2f} KB without AC, {act['full_ac'] / 1e3:.2f} KB "
        "kept with full AC",
        "",
        "memory",
        *_memory_table(plan),
        "",
        "communication per step (ring model)",
        *_comm_table(plan),
        "",
        f"compute: {comp['flops_per_rank'] / 1e12:.1f} TFLOP per rank per step -> {comp['compute_s'] * 1e3:.0f} ms at "
        f"{cl.mfu:.0%} of {cl.peak_tflops:g} TFLOP/s"
        + (f"; PP bubble {comp['pp_bubble']:.1%} ({lay['pp_schedule']}, M={lay['microbatches']}, "
           f"v={lay['pp_stages_per_rank']})" if lay["pp"] > 1 else ""),  # fmt: skip
        f"verdict: {v['memory']}",
        f"         {v['communication']}; predicted step {v['step_s'] * 1e3:.0f} ms, {v['tokens_per_s']:,.0f} tokens/s",
    ]
    return "\n".join(out)


def main(argv: Optional[list[str]] = None) -> int:
    """``python -m trainer.plan +experiment=NAME [cluster=... cluster.key=...] [key=value ...] [--json]``;
    ``python -m trainer.plan --run=RUN_FOLDER`` compares a run's plan with its communication ledger;
    ``--recommend`` proposes a layout for the config's model on the cluster."""
    from trainer.config import compose_config

    argv = list(sys.argv[1:] if argv is None else argv)
    if "-h" in argv or "--help" in argv:
        print(inspect.cleandoc(main.__doc__ or ""))
        return 0
    as_json = "--json" in argv
    wants_recommendation = "--recommend" in argv
    run_dir = next((a.split("=", 1)[1] for a in argv if a.startswith("--run=")), None)
    rest = [a for a in argv if a not in ("--json", "--recommend") and not a.startswith("--run=")]
    flags = [a for a in rest if a.startswith("-")]
    if flags or run_dir == "":
        print(f"config error: unknown option {(flags or ['--run='])[0]!r}; the options are --json, --recommend and "
              "--run=RUN_FOLDER, the rest are key=value overrides (e.g. +experiment=debug).", file=sys.stderr)  # fmt: skip
        return 2
    cluster_args = [a for a in rest if a.startswith("cluster=") or a.startswith("cluster.")]
    overrides = [a for a in rest if a not in cluster_args]
    experiment = next((a.split("=", 1)[1] for a in overrides if a.startswith("+experiment=")), "")
    try:
        if run_dir is not None:
            from trainer.plan_compare import main_run

            return main_run(run_dir, cluster_args, as_json)
        cluster = compose_cluster(cluster_args)
        if wants_recommendation:
            return _main_recommend(compose_config(*overrides), cluster, as_json)
        plan = build_plan(compose_config(*overrides), cluster, experiment)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    print(plan.to_json() if as_json else render(plan))
    return 0


def _main_recommend(cfg: Any, cluster: ClusterConfig, as_json: bool) -> int:
    """``--recommend``: walk the decision order (``trainer/plan_recommend.py``) for the config's model."""
    from trainer.plan_recommend import recommend, render_recommendation

    chosen, tried = recommend(cfg, cluster)
    if as_json:
        print(json.dumps({
            "recommended": None if chosen is None else {"layout": chosen.label, "activation_checkpoint": chosen.ac,
                                                        "plan": dataclasses.asdict(chosen.plan)},
            "tried": [{"step": c.step, "layout": c.label, "activation_checkpoint": c.ac, "reason": c.reason} for c in tried],
        }, indent=2))  # fmt: skip
    else:
        print(render_recommendation(chosen, tried))
    return 0 if chosen is not None else 1


if __name__ == "__main__":
    sys.exit(main())
