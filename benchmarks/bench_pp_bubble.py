"""The pipeline bubble, measured per schedule, next to the seed article's (K-1)/(M+K-1).

Spawns K=4 gloo ranks on the CPU. Each rank runs its stage(s) with torch's real pipelining
runtime (``PipelineStage`` + the schedule classes ``parallelisms.pipeline_parallel`` uses,
with real send/recv between ranks), for M=4 and M=16 microbatches.

The stage compute is *simulated by sleeping*: forward F, input-gradient B and weight-gradient
W each take ``--unit-ms`` (F:B:W = 1:1:1, i.e. a full backward = 2F as in the article), via
autograd functions on the activation path (F, B) and on the weight path (W), so zero-bubble
schedules really can move W into the bubble. Sleeping, unlike real matmuls, does not compete
for this machine's 2 cores, so 4 ranks can overlap exactly as 4 GPUs would; with real
compute, 4 busy ranks on 2 cores run at half speed and the "bubble" would be mostly
oversubscription. Interleaved / V schedules hold v=2 virtual stages per rank, each with half
the work, so every rank computes the same total in every schedule.

Estimator: ``bubble = 1 - t_compute / t_step``, where ``t_step`` is the median (over
``--steps`` timed steps, after a warmup step that also runs torch's shape inference) of the
slowest rank's wall time of one ``schedule.step``, and ``t_compute`` is the same rank's
stages run for the same M microbatches forward + backward locally, back to back, with no
pipeline and no communication (measured, so Python and autograd overhead count as compute).
The difference is time a rank waits: the bubble, plus p2p latency.

    python benchmarks/bench_pp_bubble.py [--unit-ms 50] [--steps 5] [--microbatches 4 16]

Prints JSON: per schedule and M the measured step time, compute time and bubble fraction,
next to the article's bubble: (K-1)/(M+K-1) for GPipe and 1F1B, that / v for interleaved
1F1B (the article's shorthand; Megatron's exact share is (K-1)/(vM+K-1), a bit larger), and
0 (the ideal with F = B = W and enough microbatches) for the zero-bubble schedules. Expect
the measurement a few points above the formula: every F/B/W action also pays p2p latency
and the Python runtime (~1-3 ms here), which a larger ``--unit-ms`` dilutes. ~3 minutes.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

os.environ["OMP_NUM_THREADS"] = "1"  # before torch is imported, here and in the spawned ranks

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from parallelisms.pipeline_parallel import SCHEDULES, _kind, stage_ids_of_rank  # noqa: E402
from tests.spawn import run_distributed  # noqa: E402

K = 4  # pipeline ranks
DIM = 32
SCHEDULE_ORDER = ("GPipe", "1F1B", "Interleaved1F1B", "InterleavedZeroBubble", "ZBVZeroBubble")


class _Sleep(torch.autograd.Function):
    """Identity that sleeps ``fwd`` seconds in forward and ``bwd`` seconds in backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, fwd: float, bwd: float) -> torch.Tensor:
        time.sleep(fwd)
        ctx.bwd = bwd
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        time.sleep(ctx.bwd)
        return grad.clone(), None, None


class SleepStage(nn.Module):
    """``x @ w`` with F (forward), B (input gradient) and W (weight gradient) costs in seconds."""

    def __init__(self, f: float, b: float, w: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.eye(DIM))
        self.f, self.b, self.w = f, b, w

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (mb, DIM)
        weight = _Sleep.apply(self.weight, 0.0, self.w)  # W lies on the weight-gradient path only
        return _Sleep.apply(x @ weight, self.f, self.b)  # (mb, DIM)


def _loss(y: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (y - target).pow(2).sum()


def _article_bubble(schedule: str, m: int, v: int) -> float:
    if schedule in ("InterleavedZeroBubble", "ZBVZeroBubble"):
        return 0.0
    base = (K - 1) / (m + K - 1)
    return base / v if _kind(schedule) != "single" else base


def _bench(rank: int, world: int, unit_s: float, steps: int, microbatches: list[int]) -> list[dict]:
    torch.set_num_threads(1)
    group = dist.group.WORLD
    out = []
    for name in SCHEDULE_ORDER:
        if name not in SCHEDULES:
            continue
        kind = _kind(name)
        v = 1 if kind == "single" else 2
        num_stages = K * v
        ids = stage_ids_of_rank(rank, K, v, "v" if kind == "v" else "loop")
        cost = unit_s / v  # each virtual stage does 1/v of the rank's work
        for m in microbatches:
            mods = [SleepStage(cost, cost, cost) for _ in ids]
            stages = [
                PipelineStage(mod, s, num_stages, torch.device("cpu"), group=group)
                for mod, s in zip(mods, ids)
            ]
            schedule = SCHEDULES[name](
                stages if kind != "single" else stages[0], n_microbatches=m, loss_fn=_loss, scale_grads=False
            )
            x = torch.randn(m, DIM)
            target = torch.zeros(m, DIM)
            has_first, has_last = 0 in ids, num_stages - 1 in ids
            times = []
            for i in range(steps + 1):
                dist.barrier()
                start = time.perf_counter()
                schedule.step(*((x,) if has_first else ()), target=target if has_last else None)
                elapsed = torch.tensor(time.perf_counter() - start)
                dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the step ends with the slowest rank
                if i > 0:  # step 0 also infers shapes
                    times.append(elapsed.item())
                for mod in mods:
                    mod.weight.grad = None
            # The same work with no pipeline: every local stage, M microbatches, back to back.
            start = time.perf_counter()
            for _ in range(m):
                for mod in mods:
                    mod(torch.randn(1, DIM, requires_grad=True)).sum().backward()
            compute = torch.tensor(time.perf_counter() - start)
            dist.all_reduce(compute, op=dist.ReduceOp.MAX)
            t_step = statistics.median(times)
            out.append(
                {
                    "schedule": name,
                    "stages_per_rank": v,
                    "microbatches": m,
                    "step_s": round(t_step, 4),
                    "compute_s": round(compute.item(), 4),
                    "bubble_measured": round(1 - compute.item() / t_step, 3),
                    "bubble_article": round(_article_bubble(name, m, v), 3),
                }
            )
            dist.barrier()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--unit-ms", type=float, default=50.0, help="duration of F, of B and of W per microbatch")
    ap.add_argument("--steps", type=int, default=5, help="timed steps per schedule and M (after one warmup)")
    ap.add_argument("--microbatches", type=int, nargs="+", default=[4, 16])
    args = ap.parse_args()
    results = run_distributed(_bench, K, args.unit_ms / 1000, args.steps, args.microbatches, timeout=1800)
    print(
        json.dumps(
            {
                "pipeline_ranks": K,
                "unit_ms": args.unit_ms,
                "F:B:W": "1:1:1",
                "torch": torch.__version__,
                "estimator": (
                    "1 - t_compute / t_step (t_compute: same stages, same M, run locally without pipeline)"
                ),
                "article_formula": "(K-1)/(M+K-1); interleaved: / v; zero bubble: 0 when F = B = W",
                "results": results[0],
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
