"""Pipeline splitting and option checks, pure (no torch.distributed.pipelining import): which
modules each stage owns, which stages each rank owns, microbatch counts (the checks, ``validate_pp``, are in
``parallelisms/validate.py``).
``parallelisms/pipeline_parallel.py`` builds the stages and schedules from these.
"""

from __future__ import annotations

from typing import Optional

from models.errors import ConfigError
from models.spec import ModelArgs, ModelSpec, decoder_args
from parallelisms.config import ParallelismConfig

__all__ = [
    "SCHEDULE_SPECS",
    "ZERO_BUBBLE",
    "canonical_schedule",
    "num_microbatches",
    "schedule_kind",
    "stage_ids_of_rank",
    "stage_module_names",
    "stage_names",
    "stages_per_rank",
]

# Schedule name -> (torch class name, kind). "single": one stage per rank; "loop": v stages per
# rank, stage s on rank s % pp; "v": exactly 2 stages per rank, V-shaped (rank r owns r and
# 2*pp-1-r, so rank 0 holds both the first and the last stage).
SCHEDULE_SPECS: dict[str, tuple[str, str]] = {
    "GPipe": ("ScheduleGPipe", "single"),
    "1F1B": ("Schedule1F1B", "single"),
    "Interleaved1F1B": ("ScheduleInterleaved1F1B", "loop"),
    "LoopedBFS": ("ScheduleLoopedBFS", "loop"),
    "InterleavedZeroBubble": ("ScheduleInterleavedZeroBubble", "loop"),
    "ZBVZeroBubble": ("ScheduleZBVZeroBubble", "v"),
}
# Zero-bubble schedules split backward into input (B) and weight (W) gradients; torch cannot
# do that split through torch.compile'd modules.
ZERO_BUBBLE = ("InterleavedZeroBubble", "ZBVZeroBubble")


def canonical_schedule(name: str) -> str:
    """The schedule's canonical name (case-insensitive match), or a ConfigError listing them."""
    by_lower = {k.lower(): k for k in SCHEDULE_SPECS}
    if not isinstance(name, str) or name.lower() not in by_lower:
        raise ConfigError(
            f"parallelism.pp_schedule={name!r} is not a known pipeline schedule; choose one of "
            f"{sorted(SCHEDULE_SPECS)}."
        )
    return by_lower[name.lower()]


def schedule_kind(schedule: str) -> str:
    """single | loop | v (how stages map onto ranks)."""
    return SCHEDULE_SPECS[canonical_schedule(schedule)][1]


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
            f"model.n_layers={n_layers} < {num_stages} pipeline stages (parallelism.pp x "
            "pp_stages_per_rank): "
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


def stage_names(spec: ModelSpec, args: ModelArgs, cfg: ParallelismConfig, num_stages: int) -> list[list[str]]:
    """The configured split: ``pp_module_names`` if set (checked), else ``stage_module_names``."""
    n_layers = decoder_args(args).n_layers
    if cfg.pp_module_names is None:
        return stage_module_names(spec, n_layers, num_stages, cfg.pp_layers_per_stage)
    names = [list(stage) for stage in cfg.pp_module_names]
    canonical = spec.module_names(args)
    flat = [n for stage in names for n in stage]
    if len(names) != num_stages or any(not stage for stage in names) or flat != canonical:
        raise ConfigError(
            f"parallelism.pp_module_names must be {num_stages} non-empty lists (pp x pp_stages_per_rank) "
            f"that together list, in order, {canonical[0]!r}, '{spec.blocks}.0' ... "
            f"'{spec.blocks}.{n_layers - 1}', {', '.join(repr(m) for m in spec.last_modules)} exactly "
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
    return 1 if schedule_kind(cfg.pp_schedule) == "single" else 2


def num_microbatches(cfg: ParallelismConfig, *, local_batch_size: int, micro_batch_size: int) -> int:
    """Pipeline microbatches per step: ``pp_microbatches``, or local batch / ``micro_batch_size``
    (the non-pipelined trainer's gradient-accumulation count) when it is null."""
    if cfg.pp_microbatches is not None:
        return cfg.pp_microbatches
    return max(1, local_batch_size // max(1, micro_batch_size))
