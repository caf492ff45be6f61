"""Typed parallelism options (the ``parallelism`` config group's schema).

They live here, not in ``trainer/``, so that ``parallelize()`` can take them directly
while ``parallelisms/`` keeps never importing the trainer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


@dataclass
class DDPConfig:
    impl: str = "custom"  # custom (bucketed hooks, the seed's design) | torch
    bucket_mb: float = 25.0
    sharded_optimizer: bool = False  # ZeRO-1: optimizer state sharded over dp_replicate
    grad_dtype: Optional[str] = None  # None (= grad dtype) | bfloat16 | float16: compress buckets


@dataclass
class FSDPConfig:
    reshard_after_forward: Optional[bool] = None  # true = ZeRO-3, false = ZeRO-2; None = true, false under PP
    param_dtype: str = "float32"  # dtype of gathered parameters for compute
    reduce_dtype: str = "float32"  # dtype of the gradient reduce-scatter
    cpu_offload: bool = False


# parallelism.fault_tolerance.semi_sync.method
SEMI_SYNC_METHODS = ("none", "diloco", "streaming_diloco")


@dataclass
class OuterOptimizerConfig:
    """``parallelism.fault_tolerance.semi_sync.outer_optimizer``: the optimizer applied to the averaged
    pseudo-gradient at each sync (a name in the optimizer registry; DiLoCo's is Nesterov SGD)."""

    name: str = "sgd"  # a name in trainer.optim.OPTIMIZERS (sgd: DiLoCo's Nesterov momentum)
    lr: float = 0.7  # DiLoCo's outer LR
    momentum: float = 0.9
    nesterov: bool = True


@dataclass
class SemiSyncConfig:
    """``parallelism.fault_tolerance.semi_sync``: DiLoCo / Streaming DiLoCo across the replica groups
    (torchft.local_sgd.DiLoCo; trainer/resilience/semi_sync.py). Inside a group every layout runs as
    usual; across groups only the pseudo-gradient exchange at each sync."""

    method: str = "none"  # none (per-step synchronous groups) | diloco | streaming_diloco
    sync_every: int = 32  # H: inner steps between two syncs of the whole model
    outer_optimizer: OuterOptimizerConfig = field(default_factory=OuterOptimizerConfig)
    fragments: int = 1  # streaming_diloco: the model in this many fragments, one synced every H/fragments
    fragment_sync_delay: int = 0  # streaming_diloco: inner steps a fragment's exchange overlaps (tau)
    fragment_update_alpha: float = 0.0  # streaming_diloco: weight of the local weights when merging
    quantize: bool = False  # exchange pseudo-gradients quantized (torchft; CUDA + Triton only)


@dataclass
class FaultToleranceConfig:
    """``parallelism.fault_tolerance``: torchft replica groups across ``dp_replicate``
    (parallelisms/fault_tolerance.py, trainer/resilience/fault_tolerance.py)."""

    enable: bool = (
        False  # each dp_replicate index is a replica group (its own torchrun); groups may die and rejoin
    )
    replica_group_id: int = 0  # this group's index in [0, dp_replicate) (the launcher sets it)
    min_replicas: int = 1  # groups that must take part for a step to commit
    lighthouse: Optional[str] = None  # http://host:port of torchft_lighthouse; None = $TORCHFT_LIGHTHOUSE
    timeout_s: float = 10.0  # cross-group collectives, should_commit and healing transfers
    quorum_timeout_s: float = 60.0  # waiting for a quorum (> the lighthouse's --join_timeout_ms)
    heartbeat_ms: int = 100  # manager -> lighthouse heartbeat interval
    startup_wait_s: float = (
        0.0  # first step of a group's process: wait up to this long for all dp_replicate groups
    )
    # main thread silent this long (not in a step, not waiting for a quorum): the supervisor kills the group
    hang_timeout_s: float = 90.0
    semi_sync: SemiSyncConfig = field(default_factory=SemiSyncConfig)


@dataclass
class ParallelismConfig:
    dp_replicate: int = 1
    dp_shard: int = -1  # -1 = whatever is left of the world
    cp: int = 1
    tp: int = 1
    pp: int = 1
    ep: int = 1
    cp_impl: str = "allgather"  # allgather (any device) | ring (CUDA: torch's experimental ring attention)
    cp_load_balance: str = "headtail"  # headtail (zigzag: rank r holds chunks r and 2cp-1-r) | none
    ddp: DDPConfig = field(default_factory=DDPConfig)
    fsdp: FSDPConfig = field(default_factory=FSDPConfig)
    fault_tolerance: FaultToleranceConfig = field(default_factory=FaultToleranceConfig)
    sequence_parallel: bool = True
    loss_parallel: bool = True
    async_tp: bool = False
    pp_schedule: str = (
        "1F1B"  # GPipe | 1F1B | Interleaved1F1B | LoopedBFS | InterleavedZeroBubble | ZBVZeroBubble
    )
    pp_microbatches: Optional[int] = None  # None = local batch / training.micro_batch_size
    pp_layers_per_stage: Optional[int] = None  # None = balanced, one block fewer on the first/last stage
    pp_stages_per_rank: Optional[int] = None  # virtual stages per rank; None = 1, or 2 for interleaved / ZBV
    pp_module_names: Optional[list[list[str]]] = None  # explicit module names per stage (overrides the above)
