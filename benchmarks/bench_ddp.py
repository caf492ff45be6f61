"""Step time of the hand-written BucketedDDP against torch DDP, and of ZeRO-1 on top, in one run.

Spawns 2 gloo ranks on the CPU (OMP_NUM_THREADS=1 each). Every variant trains its own copy
of the same transformer-like stack of Linear layers with AdamW on the same batch:

* ``custom``  -- BucketedDDP + AdamW
* ``torch``   -- torch DistributedDataParallel as ``apply_ddp(impl="torch")`` builds it + AdamW
* ``sharded`` -- BucketedDDP + ShardedOptimizer(AdamW)

A step is forward + backward + gradient sync + optimizer step (+ parameter all-gather for
``sharded``). After warmup the variants are interleaved round by round, in rotating order, so
machine drift hits all of them; each variant's step time is the median over rounds of the
slower rank; the paired ratios are medians of per-round ratios, which cancel slow drift.

    python benchmarks/bench_ddp.py [--dim 384] [--layers 6] [--tokens 128] [--rounds 25]

Prints JSON with the medians and ``ratio_custom_vs_torch`` (target <= 1.05) and
``ratio_sharded_vs_ddp`` (sharded / custom, target <= 1.10).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time
from typing import Any

os.environ["OMP_NUM_THREADS"] = "1"  # before torch is imported, here and in the spawned ranks

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from parallelisms.ddp import apply_ddp, finish_gradient_sync  # noqa: E402
from parallelisms.sharded_optimizer import ShardedOptimizer  # noqa: E402

VARIANTS = ("custom", "torch", "sharded")


class Block(nn.Module):
    """Transformer-shaped block (4*d^2 mixing + 8*d^2 MLP weights) without attention's softmax."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 4 * dim)
        self.down = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (T, D)
        q, k, v = self.qkv(self.norm1(x)).chunk(3, dim=-1)
        x = x + self.proj(q * torch.sigmoid(k) + v)
        return x + self.down(F.gelu(self.up(self.norm2(x))))


def make_model(dim: int, num_layers: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[Block(dim) for _ in range(num_layers)])


def build(variant: str, args: argparse.Namespace, mesh: Any) -> tuple[nn.Module, torch.optim.Optimizer]:
    impl = "torch" if variant == "torch" else "custom"
    model = apply_ddp(make_model(args.dim, args.layers), mesh, impl=impl, bucket_mb=args.bucket_mb)
    if variant == "sharded":
        opt: torch.optim.Optimizer = ShardedOptimizer(
            model.parameters(), torch.optim.AdamW, mesh.get_group(), lr=1e-4
        )
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    return model, opt


def train_step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> None:
    F.mse_loss(model(x), y).backward()
    finish_gradient_sync(model)
    opt.step()
    opt.zero_grad(set_to_none=True)


def worker(rank: int, world_size: int, port: int, args: argparse.Namespace, queue: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp_replicate",))
        setups = {v: build(v, args, mesh) for v in VARIANTS}
        g = torch.Generator().manual_seed(rank)
        x = torch.randn(args.tokens, args.dim, generator=g)
        y = torch.randn(args.tokens, args.dim, generator=g)
        times: dict[str, list[float]] = {v: [] for v in VARIANTS}
        for round_index in range(args.warmup + args.rounds):
            shift = round_index % len(VARIANTS)
            for variant in VARIANTS[shift:] + VARIANTS[:shift]:
                model, opt = setups[variant]
                dist.barrier()
                start = time.perf_counter()
                train_step(model, opt, x, y)
                elapsed = time.perf_counter() - start
                if round_index >= args.warmup:
                    times[variant].append(elapsed)
        # Every variant must still hold identical replicas (a cheap guard against a broken sync).
        digests = {
            v: float(sum(p.detach().double().sum() for p in setups[v][0].parameters())) for v in VARIANTS
        }
        num_params = sum(p.numel() for p in setups["custom"][0].parameters())
        queue.put((rank, times, digests, num_params))
    finally:
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dim", type=int, default=384)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--tokens", type=int, default=128, help="tokens (rows) per rank per step")
    ap.add_argument("--bucket-mb", type=float, default=25.0)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=25)
    ap.add_argument("--world-size", type=int, default=2)
    args = ap.parse_args()

    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    port = free_port()
    procs = [
        ctx.Process(target=worker, args=(r, args.world_size, port, args, queue))
        for r in range(args.world_size)
    ]
    for p in procs:
        p.start()
    results = [queue.get() for _ in procs]
    for p in procs:
        p.join()
    if any(p.exitcode != 0 for p in procs):
        raise SystemExit("a benchmark rank failed")

    # A step is as slow as its slowest rank.
    per_round = {v: [max(r[1][v][i] for r in results) * 1e3 for i in range(args.rounds)] for v in VARIANTS}
    median = {v: statistics.median(ts) for v, ts in per_round.items()}

    def paired(a: str, b: str) -> float:
        """Median of per-round ratios: both steps of a round ran back to back, so drift cancels."""
        return round(statistics.median(x / y for x, y in zip(per_round[a], per_round[b])), 3)

    digests = [r[2] for r in results]
    out = {
        "custom_ddp_ms": round(median["custom"], 2),
        "torch_ddp_ms": round(median["torch"], 2),
        "ratio_custom_vs_torch": round(median["custom"] / median["torch"], 3),
        "sharded_ms": round(median["sharded"], 2),
        "ratio_sharded_vs_ddp": round(median["sharded"] / median["custom"], 3),
        "paired_ratio_custom_vs_torch": paired("custom", "torch"),
        "paired_ratio_sharded_vs_ddp": paired("sharded", "custom"),
        "iqr_ms": {
            v: round(statistics.quantiles(ts, n=4)[2] - statistics.quantiles(ts, n=4)[0], 2)
            for v, ts in per_round.items()
        },
        "replicas_equal": all(d == digests[0] for d in digests),
        "num_params_m": round(results[0][3] / 1e6, 2),
        "world_size": args.world_size,
        "tokens_per_rank": args.tokens,
        "bucket_mb": args.bucket_mb,
        "rounds": args.rounds,
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
