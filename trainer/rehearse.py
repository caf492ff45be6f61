"""Rehearse a run at its real size on one CPU, and check it against the planner.

``python -m trainer.rehearse +experiment=NAME [key=value ...] [--ranks=R,...] [--steps=N] [--json]
[--report-only]``

It runs the real code, not a model of it: the config is composed and validated as training does
(``trainer/config.py``); the mesh is built at the preset's intended world size (the experiment YAML's
``# intended world size: N`` comment) under torch's fake process group (backend ``"fake"``, any
world size, no data moved) as each rehearsed rank in turn; the ``Trainer`` builds the model on meta
through the family's spec and applies the real ``parallelize`` outside ``FakeTensorMode``, then
materialises it and runs N real ``Trainer.train_step`` calls inside ``FakeTensorMode`` (shapes and
dtypes, no storage) with synthetic batches of the real shapes. torch's ``MemTracker`` measures the
memory (peak and categories) and our ``CommLedger`` (``trainer/observe/comm_ledger.py``) counts every
collective by mesh axis. Each term is set next to ``trainer.plan``'s for the same rank; the command
exits 1 when one differs by more than 5% (unless ``--report-only``), 2 on a bad argument.

What the rehearsal replaces or does not trace (``REPLACED``) is printed with every report.
"""

from __future__ import annotations

import inspect
import json
import math
import os
import re
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Optional, TypedDict

import torch
import torch.distributed as dist

from models.errors import ConfigError
from parallelisms.parallel_dims import DP_REPLICATE_CP, ParallelDims
from trainer.config import CONFIG_DIR
from trainer.rehearse_trace import (
    flop_counter,
    forget_meshes,
    fused_attention_stand_in,
    gathered_units_tagged,
    mem_tracker,
    propagation_marked,
)
from trainer.rehearse_trainer import RehearsalTrainer, StateProbe, local_bytes
from trainer.train import Trainer

if TYPE_CHECKING:
    from parallelisms.pipeline_parallel import Pipeline
    from trainer.config import TrainConfig
    from trainer.planner.context import Plan

__all__ = ["REPLACED", "TOLERANCE", "RankReport", "intended_world_size", "main", "rehearse_rank"]

TOLERANCE = 0.05  # a term whose rehearsed / planned ratio leaves [0.95, 1.05] fails the rehearsal

# Overrides every rehearsal adds: trace eager on the CPU; the planner's launch check is what we compare
# against, not a gate; no ledger hooks of the run's own (the rehearsal installs its ledger).
REHEARSAL_OVERRIDES = (
    "training.device=cpu",
    "training.compile=false",
    "training.cpu_gemm=torch",  # the target devices' F.linear (fake tensors would take it anyway)
    "metrics.memory_check=off",
    "metrics.comm_ledger=false",
    "metrics.memory_ledger=false",
)

# What the rehearsal replaces, or does not trace (shown in every report).
REPLACED = (
    "data: synthetic token ids of the real (local batch, seq_len) shapes replace the loader and tokenizer "
    "(block-causal documents start at stand-in BOS/EOS ids: fake ids have no values); the steady state is "
    "rehearsed: the final batch of training.batch_ramp, no training.seq_len_warmup split (both lighter)",
    "weights: the deterministic init_weights is skipped (fake tensors have no values)",
    "guards: the non-finite check (a host sync) is answered 'finite'",
    "checkpoint: one save after the steps is planned by DCP (local, global and final plans; the other ranks' "
    "local plans derived from this rank's DTensors), its files sized from the plans, nothing written; the "
    "Checkpointer is built without its disk check and async group, nothing is loaded; the data loader's "
    "state is the map-style loader's counters; under pipeline parallelism the other stages' plans hold "
    "only the entries every stage saves, and the rows count the data files (rank 0's .metadata lists "
    "every stage's entries); not with ZeRO-1 or Muon over dp_replicate (other ranks save other entries)",
    "operations: preemption agreement, comm watchdog, profiler, metrics logger not built",
    "compile: training.compile=false (eager); CUDA-only branches (compile, async TP, ring CP, CUDA streams, "
    "NCCL reduce ops) are not traced",
    "attention: causal SDPA is traced as is; masked attention (block-causal, context parallel) as SDPA's "
    "fused kernel, standing for FlexAttention on the GPU (no dense S x S mask); unlike q/v head sizes "
    "(MLA) as the memory-efficient kernel, not the CPU's math path",
    "optimizer: optimizer.implementation=auto traces the CPU's foreach AdamW (the GPU's is fused); its "
    "temporaries are in the peak",
    "evaluation: validation and tasks are not rehearsed",
    "pipeline: torch's first-step vote on static shapes (one int32 send/recv per boundary and a "
    "host read) is answered 'static' on each rank, as every rank computes it (trainer/rehearse_pp.py)",
    "MoE routing: balanced, copy j of a forward's token copies to expert j mod E (tokens x top_k / "
    "num_experts each, as torchtitan's and Megatron's forced load balance): the token counts, the "
    "expert-parallel all_to_all splits and the experts' group sizes follow on the host, with no "
    ".tolist(); the load balancer's all_reduce and bias update run on it; its logged statistics are "
    "not traced (no step is logged)",
    "float8 all-gather: torchao's float8 weight tests its precomputed scale on the host (`if scale:` in "
    "its __tensor_flatten__, read by the memory tracker); each scale the step hook precomputes is answered "
    "'nonzero' (its real value, float8's max over a clamped amax, always is)",
    "backend: the fake group has none; ZeRO-1 re-replicates as on the planned cluster's (NCCL: one "
    "all-gather; gloo: a broadcast per owner), DDP reduces with SUM then divides (NCCL: AVG)",
)

_OPTIONS = ("--ranks=", "--steps=", "--json", "--report-only", "--world=")


def intended_world_size(experiment: str) -> int:
    """The world size an experiment preset is written for: its ``# intended world size: N`` comment."""
    path = os.path.join(CONFIG_DIR, "experiment", f"{experiment}.yaml")
    if not os.path.isfile(path):
        raise ConfigError(f"+experiment={experiment!r}: no preset {path}; pick one of configs/experiment/.")
    with open(path, encoding="utf-8") as f:
        match = re.search(r"intended world size:\s*(\d+)", f.read())
    if match is None:
        raise ConfigError(f"{path} states no '# intended world size: N'; add the comment or pass --world=N.")
    return int(match.group(1))


# -- one rank ---------------------------------------------------------------------------------------


class Row(TypedDict):
    """One term of a rank's report; ``checked`` terms fail the rehearsal outside ``1 +- TOLERANCE``."""

    kind: str  # memory | comm | checkpoint
    what: str
    planned: float
    rehearsed: float
    ratio: float  # rehearsed / planned
    checked: bool


@dataclass
class RankReport:
    """One rehearsed rank next to its plan: ``rows`` of (kind, what, planned, rehearsed, ratio)."""

    rank: int
    world_size: int
    steps: int
    wall_s: float
    rows: list[Row] = field(default_factory=list)

    def failures(self, tolerance: float = TOLERANCE) -> list[Row]:
        """The checked rows whose ratio leaves ``1 +- tolerance``."""
        return [r for r in self.rows if r["checked"] and not abs(r["ratio"] - 1) <= tolerance]


def _row(kind: str, what: str, planned: float, rehearsed: float, checked: bool = True) -> Row:
    ratio = rehearsed / planned if planned else (1.0 if not rehearsed else math.inf)
    return Row(kind=kind, what=what, planned=planned, rehearsed=rehearsed, ratio=ratio, checked=checked)


def _run_steps(
    trainer: RehearsalTrainer, steps: int
) -> tuple[dict[str, float], dict[str, object], StateProbe]:
    """``steps`` real training steps under MemTracker and the CommLedger: (memory at the peak by
    category, the ledger's collectives per step, the model-state probe)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    from trainer.hooks import StepHooks
    from trainer.observe.comm_ledger import CommLedger, axis_names_of_groups

    probe = StateProbe(trainer)
    trainer.hooks = StepHooks([*trainer.hooks.hooks, probe])
    dims = trainer.dims
    ledger = CommLedger(
        axis_names_of_groups(dims.mesh, (*dims.mesh_dim_names, *dims.flat_views, DP_REPLICATE_CP))
    )
    tracker = mem_tracker(MemTracker)
    tracker.track_external(*trainer.model_parts, trainer.optimizer)
    probe.tracker = tracker
    trainer.probe = probe
    parts = trainer.model_parts if trainer.pipeline is not None else []
    handles = [part.register_forward_hook(probe.forward_done) for part in parts]
    if trainer.pipeline is not None:  # the last stage's loss runs inside torch's schedule, after the
        handles.append(_after_pipeline_loss(trainer.pipeline, probe.record_saved))  # part's forward
    handles += gathered_units_tagged(tracker, trainer.model_parts)
    flops = flop_counter()
    with propagation_marked(), fused_attention_stand_in(), trainer.fake, tracker, flops:
        for _ in range(steps):
            with ledger:
                trainer.train_step()
                trainer.state.step += 1
    probe.flops = flops.total / steps
    for h in handles:
        h.remove()
    counts = ledger.pop()
    probe.axes = _canonical_axes(dims)
    peak = tracker.get_tracker_snapshot("peak")
    by_category = (
        {str(getattr(k, "value", k)): float(v) for k, v in next(iter(peak.values())).items()} if peak else {}
    )
    return by_category, counts, probe


class _Restore:
    """A handle that undoes an attribute replacement (``remove()``, like a hook's)."""

    def __init__(self, obj: object, name: str, value: object) -> None:
        self.obj, self.name, self.value = obj, name, value

    def remove(self) -> None:
        setattr(self.obj, self.name, self.value)


def _after_pipeline_loss(pipeline: Pipeline, record: Callable[[], None]) -> _Restore:
    """Call ``record`` each time the pipeline's loss returns on the last stage (what backward reads
    then includes the loss's log-softmax, as the plan's saved term does)."""
    loss_fn = pipeline.loss_fn

    def recorded(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        out = loss_fn(logits, labels)
        record()
        return out

    pipeline.loss_fn = recorded
    return _Restore(pipeline, "loss_fn", loss_fn)


# The planner's names of the axes, first: axes that span the same ranks are one group of collectives
# (with cp = 1, dp_shard and dp_shard_cp; with dp_shard = 1, cp and dp_shard_cp), and the mesh may have
# made them one process group: both sides are compared under the first name of these that spans them.
_PLANNER_AXES = ("dp_shard_cp", "dp_replicate_cp", "dp_replicate", "cp", "tp", "pp", "ep", "dp_shard_mod_ep")


def _canonical_axes(dims: ParallelDims) -> dict[str, str]:
    """``{axis: the first of _PLANNER_AXES (or of the mesh's names) spanning the same ranks}``."""
    names = [*_PLANNER_AXES, *dims.mesh_dim_names, *dims.flat_views, DP_REPLICATE_CP]
    by_ranks: dict[tuple[int, ...], str] = {}
    canonical: dict[str, str] = {}
    for name in names:
        try:
            ranks = tuple(dist.get_process_group_ranks(dims.get_mesh(name).get_group()))
        except (KeyError, RuntimeError, ValueError):
            continue
        canonical[name] = by_ranks.setdefault(ranks, name)
    # the plan's ``world`` (Muon's all_to_all over the default group), which the ledger names after a
    # mesh view that spans the world, if one does
    everyone = tuple(range(dist.get_world_size()))
    spanning = next((name for ranks, name in by_ranks.items() if tuple(sorted(ranks)) == everyone), None)
    if spanning is not None:
        canonical["world"] = spanning
    return canonical


def _memory_rows(
    plan: Plan, pp_rank: int, peak: dict[str, float], probe: StateProbe, trainer: Trainer, steps: int
) -> list[Row]:
    """Model states when each is defined (checked), the saved activations when the forward returns
    (checked), and the peak: its total (checked where the plan's peak is one instant of the step,
    ``StageMemory.peak_instant``) and MemTracker's categories at that instant next to the planner's
    nearest terms (shown). The first step's forward and backward run before the optimizer has any
    state: rehearsing one step, the planned peak is compared without it."""
    stage = plan.stages[pp_rank]
    planned_peak = stage.total_bytes - (stage.optimizer_bytes if steps == 1 else 0.0)
    params = local_bytes(trainer.parameters)
    gathered = stage.buffers.get("fsdp_unsharded_params", 0.0)
    other_buffers = sum(v for k, v in stage.buffers.items() if k != "fsdp_unsharded_params")
    # Under PP the stages' receive buffers and kept outputs are live when a forward returns and are
    # booked as activations; the plan holds them as buffers: they join the saved bytes (like for like)
    pipeline = sum(v for k, v in stage.buffers.items() if k.startswith("pp_"))
    return [
        _row("memory", "params", stage.params_bytes, params),
        _row("memory", "grads", stage.grads_bytes, probe.grads),
        _row("memory", "optimizer", stage.optimizer_bytes, probe.optimizer),
        _row("memory", "activations saved (end of forward)", stage.peak_saved + pipeline, probe.saved),
        _row("memory", "peak: total", planned_peak, peak.get("Total", 0.0), stage.peak_instant),
        _row(
            "memory",
            "at peak: parameters (+ gathered)",
            stage.params_bytes + gathered,
            peak.get("Parameter", 0.0),
            False,
        ),
        _row("memory", "at peak: gradients", stage.grads_bytes, peak.get("Gradient", 0.0), False),
        _row("memory", "at peak: optimizer state", stage.optimizer_bytes, peak.get("Optstate", 0.0), False),
        _row(
            "memory",
            "at peak: activations + temporaries",
            stage.activations_bytes + other_buffers,
            peak.get("Activation", 0.0) + peak.get("Temp", 0.0),
            False,
        ),
    ]


def _compute_rows(plan: Plan, probe: StateProbe) -> list[Row]:
    """The step's matmul and attention FLOPs on this rank against the planner's executed FLOPs
    (checked without pipeline parallelism: the planner spreads them evenly over the ranks, where
    stages differ), and the MFU convention's figure beside them (shown)."""
    executed = plan.compute["executed_flops_per_rank"]
    return [
        _row("compute", "FLOPs executed", executed, probe.flops, plan.layout["pp"] == 1),
        _row("compute", "FLOPs (MFU convention)", plan.compute["flops_per_rank"], probe.flops, False),
    ]


def _comm_rows(plan: Plan, pp_rank: int, counts: dict[str, object], axes: dict[str, str]) -> list[Row]:
    """Per (collective, mesh axis): bytes and calls per step, planned vs rehearsed, axes spanning the
    same ranks merged (``axes``). Scalars (token counts, the grad norm's partial sums) are not planned:
    rows under 1 MB a step are shown unchecked."""
    planned: dict[tuple[str, str], list[float]] = {}
    for x in plan.pp_rank_collectives[pp_rank]:
        slot = planned.setdefault((x.op, axes.get(x.axis, x.axis)), [0.0, 0.0])
        slot[0] += x.logical_bytes
        slot[1] += x.calls
    measured: dict[tuple[str, str], list[float]] = {}
    for op, by_axis in counts.items():
        if not isinstance(by_axis, dict):  # total_bytes
            continue
        for axis, v in by_axis.items():
            slot = measured.setdefault((op, axes.get(axis, axis)), [0.0, 0.0])
            slot[0] += v["bytes"]
            slot[1] += v["calls"]
    rows = []
    for op, axis in sorted(set(planned) | set(measured)):
        want, got = planned.get((op, axis), [0.0, 0.0]), measured.get((op, axis), [0.0, 0.0])
        significant = max(want[0], got[0]) >= 1e6
        rows.append(_row("comm", f"{op} {axis} bytes", want[0], got[0], significant))
        rows.append(_row("comm", f"{op} {axis} calls", want[1], got[1], False))
    return rows


def _checkpoint_rows(plan: Plan, rank: int, trainer: Trainer) -> list[Row]:
    """One save of the rehearsed state (``Checkpointer.save_state``) planned by DCP for this rank
    (``trainer/checkpoint/footprint.py``), next to the planner's checkpoint term for the same rank.
    Under pipeline parallelism the data files only (rank 0's ``.metadata`` lists every stage's entries)."""
    from parallelisms.sharded_optimizer import ShardedOptimizer
    from trainer.checkpoint.checkpointer import completed_marker, every_stage, peer_path
    from trainer.checkpoint.footprint import save_footprint
    from trainer.checkpoint.storage import CheckpointWriter, step_dir

    # ZeRO-1 keeps a parameter's optimizer state on its owner, Muon a replicated piece's momentum on
    # its primary: the other ranks' plans hold other optimizer entries than this rank's
    zero1 = isinstance(trainer.optimizer, ShardedOptimizer)
    per_rank_state = zero1 or (trainer.cfg.optimizer.name == "muon" and trainer.dims.dp_replicate > 1)
    if plan.checkpoint is None or per_rank_state:
        return []  # other ranks' optimizer state: not derivable here (REPLACED)
    ckpt, step = trainer.checkpointer, trainer.state.step
    marker = ckpt.marker(step, model_only=False)
    got = save_footprint(
        ckpt.save_state(),
        rank=rank,
        world_size=trainer.world_size,
        writer=CheckpointWriter(f"{step_dir(ckpt.folder, step)}.tmp-{'0' * 12}", step),
        peer_path=peer_path,
        coordinates=trainer.dims.coordinates,
        every_stage=every_stage,
        marker=lambda files: completed_marker(marker, files, {n: f"{0:08x}" for n in files}),
    )
    ck = plan.checkpoint
    planned, files = ck.rank_bytes[rank], ck.rank_files[rank]
    if not got.complete and rank == 0:  # the data files only
        planned, files = planned - ck.metadata_bytes - ck.marker_bytes, files - 2
    return [
        _row("checkpoint", "checkpoint bytes", planned, float(got.bytes)),
        _row("checkpoint", "checkpoint files", files, float(len(got.files))),
        _row("checkpoint", "checkpoint entries", ck.rank_entries[rank], float(got.entries), False),
    ]


def rehearse_rank(
    cfg: TrainConfig,
    world_size: int,
    rank: int,
    steps: int,
    plan: Plan,
    inspect: Optional[Callable[[RehearsalTrainer, dict[str, object]], None]] = None,
) -> RankReport:
    """Rehearse ``steps`` training steps of ``cfg`` as ``rank`` of ``world_size`` under the fake
    process group, and set every term next to ``plan``'s for the same rank. ``inspect(trainer,
    collectives)``, if given, sees the rehearsed trainer and its ledger's collectives per step
    after the steps (the checks against real runs read the optimizer's plans there)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from trainer.planner.compare import pp_rank_of

    start = time.perf_counter()
    saved_env = {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK="0")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        trainer = RehearsalTrainer(cfg, FakeTensorMode(allow_non_fake_inputs=True), plan.cluster.backend)
        peak, counts, probe = _run_steps(trainer, steps)
        if inspect is not None:
            inspect(trainer, counts)
        pp_rank = pp_rank_of(plan, rank)
        rows = _memory_rows(plan, pp_rank, peak, probe, trainer, steps) + _compute_rows(plan, probe)
        rows += _comm_rows(plan, pp_rank, counts, probe.axes)
        rows += _checkpoint_rows(plan, rank, trainer)
    finally:
        dist.destroy_process_group()
        forget_meshes()
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return RankReport(rank, world_size, steps, time.perf_counter() - start, rows)


# -- the command ------------------------------------------------------------------------------------


@dataclass
class _Args:
    overrides: list[str]
    ranks: Optional[list[int]]
    steps: int
    world: Optional[int]
    as_json: bool
    report_only: bool


def _int_option(arg: str) -> int:
    name, _, value = arg.partition("=")
    try:
        out = int(value)
    except ValueError:
        raise ConfigError(f"{arg!r}: {name} takes a whole number, e.g. {name}=1.") from None
    if out < 1:
        raise ConfigError(f"{arg!r}: {name} must be >= 1.")
    return out


def _parse(argv: list[str]) -> _Args:
    """The command line; a bad option is a ConfigError naming it (exit 2)."""
    args = _Args([], None, 1, None, "--json" in argv, "--report-only" in argv)
    for a in argv:
        if a.startswith("--ranks="):
            try:
                args.ranks = [int(r) for r in a.split("=", 1)[1].split(",")]
            except ValueError:
                raise ConfigError(
                    f"{a!r}: --ranks takes comma-separated rank numbers, e.g. --ranks=0,31."
                ) from None
        elif a.startswith("--steps="):
            args.steps = _int_option(a)
        elif a.startswith("--world="):
            args.world = _int_option(a)
        elif a.startswith("-") and a not in ("--json", "--report-only"):
            raise ConfigError(
                f"unknown option {a!r}; the options are --ranks=R,..., --steps=N, --world=N, --json and "
                "--report-only; the rest are key=value overrides (e.g. +experiment=7b_hsdp)."
            )
        elif not a.startswith("-"):
            args.overrides.append(a)
    return args


def _plan_inputs(args: _Args) -> tuple[TrainConfig, int, list[int], str]:
    """(the composed and validated config, the world size, the ranks to rehearse, the experiment)."""
    from trainer.config import compose_config
    from trainer.rehearse_pp import default_ranks

    experiment = next((a.split("=", 1)[1] for a in args.overrides if a.startswith("+experiment=")), "")
    if args.world is None and not experiment:
        raise ConfigError("name the run: +experiment=NAME (its YAML states the world size) or --world=N.")
    world = args.world if args.world is not None else intended_world_size(experiment)
    cfg = compose_config(*args.overrides, *REHEARSAL_OVERRIDES)
    ranks = args.ranks if args.ranks is not None else default_ranks(world, cfg.parallelism.pp)
    bad = [r for r in ranks if not 0 <= r < world]
    if bad:
        raise ConfigError(
            f"--ranks: rank {bad[0]} is outside the world of {world} ranks; use 0..{world - 1}."
        )
    return cfg, world, ranks, experiment


def _dims_at(cfg: TrainConfig, world: int) -> ParallelDims:
    """The layout the run validates at ``world`` ranks (``dp_shard=-1`` resolved as the trainer does),
    so the plan is of the rehearsed world, not of the cluster preset's."""
    from trainer.planner.context import dims_of

    return dims_of(cfg, world)


def render_report(reports: list[RankReport], experiment: str, tolerance: float = TOLERANCE) -> str:
    """The reports as text: one table per rank, then what was replaced."""
    lines = []
    for rep in reports:
        lines.append(
            f"rehearsal: {experiment or '(overrides)'} rank {rep.rank} of {rep.world_size}, "
            f"{rep.steps} step(s) in {rep.wall_s:.1f} s "
            f"(ratio = rehearsed / planned; * = checked, +-{tolerance:.0%})"
        )
        lines.append(f"  {'kind':<7} {'what':<40} {'planned':>16} {'rehearsed':>16} {'ratio':>8}")
        for r in rep.rows:
            mark = ("*" if abs(r["ratio"] - 1) <= tolerance else "!") if r["checked"] else " "
            lines.append(
                f"  {r['kind']:<7} {r['what']:<40} {r['planned']:>16,.0f} {r['rehearsed']:>16,.0f} "
                f"{r['ratio']:>8.3f}{mark}"
            )
        lines.append("")
    lines.append("replaced / not traced:")
    lines.extend(f"  - {x}" for x in REPLACED)
    return "\n".join(lines)


def _failure_line(e: BaseException) -> str:
    """``Type: first line`` of an error, and of its root cause when a wrapper hides it (torch's
    pipeline schedules re-raise a stage's error as a RuntimeError whose first line is blank)."""

    def line(x: BaseException) -> str:
        text = next((ln.strip() for ln in str(x).splitlines() if ln.strip()), "")
        return f"{type(x).__name__}: {text}"

    root = e
    while root.__cause__ is not None:
        root = root.__cause__
    return line(e) if root is e else f"{line(e)} (caused by {line(root)})"


def main(argv: Optional[list[str]] = None) -> int:
    """``python -m trainer.rehearse +experiment=NAME [key=value ...] [--ranks=R,...] [--steps=N]
    [--world=N] [--json] [--report-only]``: rehearse the run at its intended world size as each rank
    (default: the first and the last) and compare every term with ``trainer.plan``'s; exit 1 when
    one differs by more than 5% (unless --report-only), 2 on a bad argument."""
    from trainer.planner.cluster import compose_cluster
    from trainer.planner.plan import build_plan

    argv = list(sys.argv[1:] if argv is None else argv)
    if "-h" in argv or "--help" in argv:
        print(inspect.cleandoc(main.__doc__ or ""))
        return 0
    rank: Optional[int] = None
    try:
        args = _parse(argv)
        cfg, world, ranks, experiment = _plan_inputs(args)
        cluster, dims = compose_cluster([]), _dims_at(cfg, world)
        reports = []
        for rank in ranks:  # the plan of each rank: ZeRO-1's and Muon's owners differ between ranks
            plan = build_plan(cfg, cluster, experiment, dims=dims, rank=rank)
            reports.append(rehearse_rank(cfg, world, rank, args.steps, plan))
    except ConfigError as e:
        where = f" (rehearsing rank {rank})" if rank is not None else ""
        print(f"config error{where}: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # the run's own code failed at this rank: name it, not DTensor's traceback
        first = _failure_line(e)
        print(
            f"rehearsal failed at rank {rank}: {first}; the real run fails there too "
            f"(rerun with --ranks={rank} under python -X dev for the traceback).",
            file=sys.stderr,
        )
        return 1
    if args.as_json:
        print(
            json.dumps(
                {"experiment": experiment, "ranks": [asdict(r) for r in reports], "replaced": REPLACED},
                indent=1,
            )
        )
    else:
        print(render_report(reports, experiment))
    failed = [(rep.rank, r["what"], r["ratio"]) for rep in reports for r in rep.failures()]
    if failed and not args.report_only:
        print(
            "rehearsal and plan disagree by more than 5%: "
            + "; ".join(f"rank {k} {w} ratio {x:.3f}" for k, w, x in failed),
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
