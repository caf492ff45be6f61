"""Will it fit? The trainer's own start-up check (``metrics.memory_check``): before any process
group exists it plans its layout in-process (``build_plan``, nothing allocated) and compares what a
rank needs with what it gets -- the GPU's memory, or on CPU the host's RAM shared by the ranks
started on it -- and, when it does not fit, names the numbers and the cheapest fixes (each one
re-planned): full activation checkpointing, a smaller micro batch, more sharding.

``error`` (the default) stops every rank with a ConfigError (exit 2) before the first step;
``warn`` logs the same text and trains anyway (the plan may be pessimistic: under
``training.compile`` the compiled graph saves less than the eager one planned here); ``off``
skips it.
"""

from __future__ import annotations

import copy
import dataclasses
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

from models.errors import ConfigError
from trainer.planner.cluster import GIB, ClusterConfig

if TYPE_CHECKING:
    import torch

    from parallelisms.parallel_dims import ParallelDims
    from trainer.config import TrainConfig
    from trainer.planner.context import StageMemory

__all__ = ["Budget", "FitCheck", "check_memory", "host_memory_bytes", "process_rss_bytes", "rank_budget"]


def host_memory_bytes() -> int:
    """The host's RAM (``MemTotal`` of /proc/meminfo; 0 where there is none to read)."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def process_rss_bytes() -> int:
    """This process's resident set now (interpreter, torch, libraries): what a CPU rank holds
    before its model exists (``VmRSS`` of /proc/self/status; 0 where there is none)."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


@dataclass
class Budget:
    """What one rank may use: ``per_rank_bytes`` of ``what`` (shared by ``sharing`` ranks), and the
    fixed overhead a rank carries besides what the plan counts (``overhead_bytes``)."""

    what: str  # e.g. "this host's 23.4 GiB of RAM (MemTotal), shared by 8 ranks"
    per_rank_bytes: float
    overhead_bytes: float
    sharing: int
    total_bytes: float
    cluster: ClusterConfig


def rank_budget(device: torch.device, local_world_size: int, world_size: Optional[int] = None) -> Budget:
    """The memory one rank of this host gets: the GPU's (split among the ranks that share one), or
    the host RAM split among ``local_world_size`` CPU ranks."""
    import torch

    if device.type == "cuda":
        total = float(torch.cuda.get_device_properties(device).total_memory)
        sharing = max(1, -(-local_world_size // max(1, torch.cuda.device_count())))
        cluster = ClusterConfig(name="this GPU", gpus_per_node=local_world_size, memory_gib=total / GIB)
        what = f"{torch.cuda.get_device_name(device)}'s {total / GIB:.1f} GiB"
        overhead = cluster.workspace_gib * GIB  # CUDA context, NCCL, allocator slack
    else:
        total = float(host_memory_bytes())
        sharing = max(1, local_world_size)
        cluster = ClusterConfig(
            name="this host", gpus_per_node=sharing, memory_gib=total / GIB, backend="gloo"
        )
        what = f"this host's {total / GIB:.1f} GiB of RAM (MemTotal)"
        overhead = float(process_rss_bytes())  # measured: interpreter + torch + libraries
    if sharing > 1:
        what += f", shared by {sharing} ranks"
    world = world_size or local_world_size  # the planner's nodes resolve parallelism.dp_shard=-1
    cluster = dataclasses.replace(cluster, nodes=max(1, -(-world // max(1, cluster.gpus_per_node))))
    return Budget(what, total / sharing, overhead, sharing, total, cluster)


@dataclass
class FitCheck:
    fits: bool
    need_bytes: float  # per rank: the plan's largest pp rank + the overhead
    message: str  # empty when it fits


def _need(
    cfg: TrainConfig, budget: Budget, dims: Optional[ParallelDims] = None
) -> tuple[float, StageMemory, ParallelDims]:
    """Per-rank need of ``cfg``: the plan's largest pp rank plus the budget's overhead; that rank's
    memory; the layout planned (``dims`` when given: already validated against ``cfg``)."""
    from trainer.planner.context import build_context
    from trainer.planner.plan import plan_of

    c = build_context(cfg, dataclasses.replace(budget.cluster, workspace_gib=0.0), dims)
    worst = max(plan_of(c, checkpoint=False).stages, key=lambda s: s.total_bytes)
    return worst.total_bytes + budget.overhead_bytes, worst, c.dims


def _try(cfg: TrainConfig, budget: Budget, apply: Callable[[Any], None]) -> Optional[float]:
    """Per-rank need of ``cfg`` changed by ``apply`` (its layout validated anew); None when that is not
    a valid layout."""
    variant = copy.deepcopy(cfg)
    apply(variant)
    try:
        return _need(variant, budget)[0]
    except ConfigError:
        return None


def _fixes(cfg: TrainConfig, budget: Budget, dims: ParallelDims) -> list[str]:
    """The cheapest changes, each re-planned: full AC, the largest smaller micro batch that fits
    (else the smallest), FSDP over the data-parallel ranks and ZeRO-1 (under DDP: ``dims``)."""
    t, p = cfg.training, cfg.parallelism
    tried: list[tuple[str, Optional[float]]] = []
    if t.activation_checkpoint != "full":
        tried.append(
            (
                "training.activation_checkpoint=full",
                _try(cfg, budget, lambda c: setattr(c.training, "activation_checkpoint", "full")),
            )
        )
    mb, micro = t.micro_batch_size // 2, None
    while mb >= 1:
        need = _try(cfg, budget, lambda c, mb=mb: setattr(c.training, "micro_batch_size", mb))
        if need is not None:
            micro = (f"training.micro_batch_size={mb}", need)
            if need <= budget.per_rank_bytes:
                break
        mb //= 2
    if micro is not None:
        tried.append(micro)
    if dims.ddp_enabled:

        def fsdp(c: Any, n: int = p.dp_replicate) -> None:
            c.parallelism.dp_replicate, c.parallelism.dp_shard = 1, n

        tried.append(
            (
                f"parallelism.dp_replicate=1 parallelism.dp_shard={p.dp_replicate} (FSDP)",
                _try(cfg, budget, fsdp),
            )
        )
        if not p.ddp.sharded_optimizer:
            tried.append(
                (
                    "parallelism.ddp.sharded_optimizer=true (ZeRO-1)",
                    _try(cfg, budget, lambda c: setattr(c.parallelism.ddp, "sharded_optimizer", True)),
                )
            )
    return [
        f"{label} -> {need / GIB:.2f} GiB per rank "
        f"({'fits' if need <= budget.per_rank_bytes else 'still too much'})"
        for label, need in tried
        if need is not None
    ]


def check_memory(
    cfg: TrainConfig,
    device: torch.device,
    local_world_size: int,
    world_size: Optional[int] = None,
    dims: Optional[ParallelDims] = None,
) -> FitCheck:
    """Plan ``cfg`` on this host (``local_world_size`` of ``world_size`` ranks on it) and compare with
    its memory. ``dims``: the run's layout, already validated against ``cfg`` (None: validated here)."""
    budget = rank_budget(device, local_world_size, world_size)
    need, worst, dims = _need(cfg, budget, dims)
    if budget.total_bytes <= 0 or need <= budget.per_rank_bytes:
        return FitCheck(True, need, "")
    parts = (
        f"parameters {worst.params_bytes / GIB:.2f}, gradients {worst.grads_bytes / GIB:.2f}, optimizer "
        f"{worst.optimizer_bytes / GIB:.2f}, saved activations {worst.activations_bytes / GIB:.2f}, buffers "
        f"{sum(worst.buffers.values()) / GIB:.2f}, process {budget.overhead_bytes / GIB:.2f}"
    )
    fixes = _fixes(cfg, budget, dims)
    compiled = (
        " (planned for eager execution; training.compile=true saves less, so this is an upper bound)"
        if cfg.training.compile
        else ""
    )
    message = (
        f"the planned memory of a rank does not fit: it needs {need / GIB:.2f} GiB ({parts}){compiled}, "
        f"x {budget.sharing} rank(s) = {need * budget.sharing / GIB:.1f} GiB of {budget.what} "
        f"({budget.per_rank_bytes / GIB:.2f} GiB per rank). Cheapest fixes: "
        + ("; ".join(fixes) if fixes else "none found by re-planning: use more devices or a smaller model")
        + ". Or start fewer ranks per host, or set metrics.memory_check=warn to start anyway "
        "(python -m trainer.plan shows the whole plan)."
    )
    return FitCheck(False, need, message)


def local_world_size() -> int:
    """Ranks started on this host (torchrun's LOCAL_WORLD_SIZE; else the world, one host)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))


def run_check(
    cfg: TrainConfig,
    device: torch.device,
    log: Callable[[str], None],
    dims: Optional[ParallelDims] = None,
) -> Optional[FitCheck]:
    """``metrics.memory_check`` at start-up: raise ConfigError (``error``), log (``warn``), or nothing.
    ``dims``: the trainer's layout (``validated_dims``), planned as it is instead of validated again.
    A planner failure never stops training: it is logged and the check is skipped."""
    mode = cfg.metrics.memory_check
    if mode == "off":
        return None
    try:
        world = int(os.environ.get("WORLD_SIZE", "1"))
        result = check_memory(cfg, device, local_world_size(), world, dims=dims)
    except Exception as e:  # noqa: BLE001 -- a family the planner cannot model yet must still train
        log(f"metrics.memory_check skipped: the planner could not plan this config ({type(e).__name__}: {e})")
        return None
    if not result.fits:
        if mode == "error":
            raise ConfigError(f"metrics.memory_check=error: {result.message}")
        log(f"metrics.memory_check=warn: {result.message}")
    return result
