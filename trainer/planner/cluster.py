"""The cluster model: the machine a layout is planned for (``configs/cluster/``), the alpha-beta
ring cost of a collective, and the pipeline schedule formulas (bubble, microbatches in flight)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

from omegaconf import OmegaConf

from models.errors import ConfigError
from trainer.config import CONFIG_DIR

CLUSTER_DIR = os.path.join(CONFIG_DIR, "cluster")
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
GB = 1e9
GIB = 2**30
ADAM_BYTES = 8  # two fp32 moments per parameter


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
    backend: str = (
        "nccl"  # nccl | gloo: the collectives a strategy picks (ZeRO-1 re-replicates by broadcast on gloo)
    )


def compose_cluster(overrides: list[str]) -> ClusterConfig:
    """``cluster=<preset>`` picks ``configs/cluster/<preset>.yaml`` (default h100_node);
    ``cluster.<key>=<value>`` overrides a field (typed: unknown keys and bad types fail)."""
    preset, dotlist = "h100_node", []
    for o in overrides:
        key, _, value = o.partition("=")
        if key == "cluster":
            preset = value
        else:
            dotlist.append(f"{key[len('cluster.') :]}={value}")
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
    if (
        op == "broadcast"
    ):  # pipelined ring: every rank but the last forwards it; (n-1)/n on average over roots
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
