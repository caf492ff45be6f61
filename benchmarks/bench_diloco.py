"""DiLoCo against synchronous fault-tolerant training, same token budget (``FT_GROUPS=2 NPROC=1
./launch.sh +experiment=debug``): synchronous (gradients all-reduced every step), DiLoCo H=8 and H=32
(``parallelism.fault_tolerance.semi_sync``). Prints JSON per run: the final validation loss (the same
validation batches), the cross-group bytes this rank all-reduced (measured where they are handed to
torchft: ``ft/cross_group_bytes``), their ratio to the synchronous run's, the median seconds of a sync
step's exchange and outer step (``ft/outer_s``), and the wall time.

    python benchmarks/bench_diloco.py [--steps 192] [--seq-len 128] [--runs sync,8,32]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests.ft_harness import FT_FAST, FTJob  # noqa: E402
from trainer.resilience.fault_tolerance import group_folder  # noqa: E402

FT = "parallelism.fault_tolerance"


def records(dump: str, group: int) -> list[dict]:
    with open(os.path.join(group_folder(dump, group), "metrics.jsonl"), encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def run(name: str, h: int, args: argparse.Namespace, root: str) -> dict:
    overrides = (
        "+experiment=debug",
        f"training.steps={args.steps}",
        f"training.seq_len={args.seq_len}",
        f"training.eval_freq={args.steps}",
        "training.eval_steps=8",
        "metrics.log_freq=1",
        "metrics.tensorboard=false",
        "checkpoint.enable=false",
        *FT_FAST,
        f"{FT}.min_replicas=2",
    )
    if h:
        overrides += (f"{FT}.semi_sync.method=diloco", f"{FT}.semi_sync.sync_every={h}")
    dump = os.path.join(root, name)
    start = time.time()
    job = FTJob(dump, overrides)
    try:
        assert job.wait(timeout=3600) == 0, job.log()
    finally:
        job.stop()
    out = records(dump, 0)
    steps = [r for r in out if "loss" in r]
    evals = [r for r in out if "eval_loss" in r]
    outer = [r["ft/outer_s"] for r in steps if h and r["step"] % h == 0]
    return {
        "run": name,
        "sync_every": h or 1,
        "final_train_loss": steps[-1]["loss"],
        "final_val_loss": evals[-1]["eval_loss"] if evals else None,
        "cross_group_bytes": steps[-1]["ft/cross_group_bytes"],
        "median_step_s": statistics.median(r["step_time_s"] for r in steps),
        "median_sync_s": statistics.median(outer) if outer else None,
        "wall_s": round(time.time() - start, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=192)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--runs", default="sync,8,32", help="comma list: sync and/or values of H")
    args = parser.parse_args()
    root = tempfile.mkdtemp(prefix="bench_diloco_")
    results = []
    for item in args.runs.split(","):
        h = 0 if item == "sync" else int(item)
        results.append(run("synchronous" if h == 0 else f"diloco_h{h}", h, args, root))
        print(json.dumps(results[-1]), flush=True)
    sync = next((r for r in results if r["sync_every"] == 1), None)
    if sync:
        for r in results:
            r["bytes_vs_sync"] = r["cross_group_bytes"] / sync["cross_group_bytes"]
    print(json.dumps({"steps": args.steps, "seq_len": args.seq_len, "results": results}, indent=2))


if __name__ == "__main__":
    main()
