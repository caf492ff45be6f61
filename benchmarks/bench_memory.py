"""Per-rank bytes of parameters + gradients + optimizer state, against the seed article's formulas.

Runs one real training step of the Trainer on N gloo ranks for each layout and counts
the bytes this rank holds (local shards only for DTensors):

- DDP (custom)           expected 16P
- DDP + ShardedOptimizer expected 8P + 8P/N
- FSDP (ZeRO-3)          expected 16P/N

Dtype convention: fp32 training, where the parameter is its own fp32 "master" copy:
4 B parameter + 4 B gradient + 8 B Adam (exp_avg, exp_avg_sq) = 16 B per parameter,
the article's 16P. The article's ZeRO-1 figure 4P + 12P/N assumes bf16 parameter and
gradient (2 + 2 B, replicated) plus a fp32 master copy and Adam moments (4 + 8 B,
sharded); with fp32 parameters the replicated part is 4 + 4 B and the sharded part the
8 B of Adam moments, hence 8P + 8P/N. FSDP shards everything: 16P/N in both conventions.

    python benchmarks/bench_memory.py [--world 4] [--model debug]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests.dist import run_distributed  # noqa: E402
from trainer.config import compose_config as make_config  # noqa: E402


def _local_bytes(t: torch.Tensor) -> int:
    if hasattr(t, "to_local"):
        t = t.to_local()
    return t.numel() * t.element_size()


def _measure(rank: int, world: int, overrides: list[str]) -> dict:
    from trainer.train import Trainer

    trainer = Trainer(make_config(*overrides))
    # One step creates the optimizer state; keep the gradients for counting.
    trainer.optimizer.zero_grad = lambda set_to_none=True: None  # type: ignore[method-assign]
    trainer.train()
    params = list(trainer.model.parameters())
    out = {
        "params": sum(_local_bytes(p) for p in params),
        "grads": sum(_local_bytes(p.grad) for p in params if p.grad is not None),
        "optimizer": sum(
            _local_bytes(v)
            for s in trainer.optimizer.state.values()
            for v in s.values()
            if torch.is_tensor(v) and v.ndim > 0
        ),
    }
    trainer.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--model", default="debug")
    args = ap.parse_args()
    n = args.world
    base = [
        f"model={args.model}", "training.steps=1", "training.seq_len=64", f"training.global_batch_size={n}",
        "training.micro_batch_size=1", "metrics.tensorboard=false", "metrics.jsonl=false", "data.max_documents=200",
        "job.dump_folder=outputs/bench_memory",
    ]  # fmt: skip
    from models import get_spec

    model_cfg = make_config(f"model={args.model}").model
    num_params = get_spec(model_cfg.family).param_counts(model_cfg).total
    layouts = {
        "ddp": (["parallelism.dp_replicate=" + str(n), "parallelism.dp_shard=1"], 16 * num_params),
        "zero1": (
            [
                "parallelism.dp_replicate=" + str(n),
                "parallelism.dp_shard=1",
                "parallelism.ddp.sharded_optimizer=true",
            ],
            8 * num_params + 8 * num_params / n,
        ),
        "fsdp": ([f"parallelism.dp_shard={n}"], 16 * num_params / n),
    }
    report: dict = {
        "model": args.model,
        "P": num_params,
        "world": n,
        "dtype": "fp32 params/grads + fp32 Adam m,v",
    }
    for name, (overrides, expected) in layouts.items():
        per_rank = run_distributed(_measure, n, base + overrides)
        totals = [r["params"] + r["grads"] + r["optimizer"] for r in per_rank]
        worst = max(totals, key=lambda t: abs(t - expected))
        report[name] = {
            "bytes_per_rank": totals,
            "breakdown_rank0": per_rank[0],
            "formula_bytes": int(expected),
            "max_rel_err_vs_formula": round(abs(worst - expected) / expected, 4),
        }
    report["within_5pct"] = all(report[k]["max_rel_err_vs_formula"] <= 0.05 for k in layouts)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
