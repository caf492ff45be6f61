"""Muon vs AdamW: the optimizer step's share of the step time, on 1 process and on 4 gloo ranks
(FSDP, DDP, ZeRO-1), with Muon's owner balance (max / mean Newton-Schulz FLOPs per rank).

The real Trainer runs ``--steps`` steps per (layout, optimizer) after one warm-up step (Muon's
first step also builds its owner plan); ``optimizer.step`` is timed inside the step (it includes
Muon's two all_to_all and ZeRO-1's broadcasts). Per step the slowest rank counts (the step waits
for it); the medians over steps are reported.

    python benchmarks/bench_muon.py [--model debug] [--steps 6] [--ns-dtype bfloat16]

Prints JSON: per layout and optimizer ``step_s``, ``optimizer_s``, ``share`` = optimizer / step,
and per layout ``muon_over_adamw`` (step time) and ``owner_balance``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests.spawn import run_distributed  # noqa: E402

LAYOUTS = {  # name -> (world, overrides)
    "single": (1, ["parallelism.dp_shard=1"]),
    "fsdp_x4": (4, ["parallelism.dp_shard=4"]),
    "ddp_x4": (4, ["parallelism.dp_replicate=4", "parallelism.dp_shard=1"]),
    "zero1_x4": (
        4,
        ["parallelism.dp_replicate=4", "parallelism.dp_shard=1", "parallelism.ddp.sharded_optimizer=true"],
    ),
}


def _owner_balance(optimizer) -> float | None:  # noqa: ANN001
    """max / mean Newton-Schulz FLOPs per rank: Muon's owners, or ZeRO-1's owners of the Muon matrices."""
    from trainer.optim.muon import Muon
    from trainer.optim.muon_plan import ns_flops

    if isinstance(optimizer, Muon):
        return optimizer.owner_balance() if optimizer.process_group is not None else 1.0
    inner = getattr(optimizer, "inner_optimizer", None)
    if not isinstance(inner, Muon):
        return None
    loads = [0] * optimizer.world_size
    index = 0
    for group in optimizer.param_groups:
        for p in group["params"]:
            if group["use_muon"]:
                loads[optimizer.owner_of(index)] += (p.shape[0] if p.ndim == 3 else 1) * ns_flops(
                    *p.shape[-2:]
                )
            index += 1
    return max(loads) / (sum(loads) / len(loads))


def _rank(rank: int, world: int, runs: dict[str, list[str]], steps: int) -> dict:
    with contextlib.redirect_stdout(sys.stderr):  # the Trainer's log lines: stdout is the JSON's
        return _timed_runs(runs, steps)


def _timed_runs(runs: dict[str, list[str]], steps: int) -> dict:
    import torch

    from trainer.config import compose_config
    from trainer.train import Trainer

    torch.set_num_threads(1)
    out = {}
    for name, overrides in runs.items():
        trainer = Trainer(compose_config(*overrides))
        logging.getLogger("meshwright").setLevel(logging.WARNING)
        opt_times: list[float] = []

        def timed_step(*args, _step=trainer.optimizer.step, _times=opt_times, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
            start = time.perf_counter()
            result = _step(*args, **kwargs)
            _times.append(time.perf_counter() - start)
            return result

        trainer.optimizer.step = timed_step
        step_times = []
        for _ in range(steps + 1):
            start = time.perf_counter()
            trainer.train_step()
            step_times.append(time.perf_counter() - start)
        out[name] = {
            "step": step_times[1:],
            "opt": opt_times[1:],
            "balance": _owner_balance(trainer.optimizer),
        }
        trainer.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="debug")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--ns-dtype", default="bfloat16", help="optimizer.muon.ns_dtype")
    ap.add_argument("--layouts", nargs="*", default=list(LAYOUTS))
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    folder = tempfile.mkdtemp(prefix="bench_muon_")
    common = [
        f"model={args.model}",
        "training.seq_len=128",
        "training.global_batch_size=8",
        "training.micro_batch_size=2",
        "training.eval_freq=0",
        "metrics.log_freq=1000",
        "metrics.tensorboard=false",
        "checkpoint.enable=false",
        "lr_scheduler.warmup_steps=1",
    ]
    results: dict = {}
    for world in sorted({LAYOUTS[n][0] for n in args.layouts}):
        runs = {}
        for name in args.layouts:
            w, overrides = LAYOUTS[name]
            if w != world:
                continue
            for opt in ("adamw", "muon"):
                extra = (
                    ["optimizer=muon", f"optimizer.muon.ns_dtype={args.ns_dtype}"] if opt == "muon" else []
                )
                runs[f"{name}/{opt}"] = [
                    *common,
                    *overrides,
                    *extra,
                    f"job.dump_folder={folder}/{name}_{opt}",
                ]
        per_rank = run_distributed(_rank, world, runs, args.steps, timeout=3600)
        for key in runs:
            name, opt = key.split("/")
            step = statistics.median(max(r[key]["step"][i] for r in per_rank) for i in range(args.steps))
            optim = statistics.median(max(r[key]["opt"][i] for r in per_rank) for i in range(args.steps))
            entry = results.setdefault(name, {"world": world})
            entry[opt] = {
                "step_s": round(step, 4),
                "optimizer_s": round(optim, 4),
                "share": round(optim / step, 3),
            }
            if opt == "muon":
                entry["owner_balance"] = round(per_rank[0][key]["balance"], 3)
    for entry in results.values():
        entry["muon_over_adamw"] = round(entry["muon"]["step_s"] / entry["adamw"]["step_s"], 3)
    print(
        json.dumps(
            {"model": args.model, "ns_dtype": args.ns_dtype, "steps": args.steps, "layouts": results},
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
