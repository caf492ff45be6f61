"""Checkpoint cost for the 38m preset on the CPU: sync save, async stall, load.

One process, the real Trainer and Checkpointer (model + AdamW state + scheduler + data +
RNG, i.e. ~3x the fp32 weights on disk). One training step populates the optimizer state;
then, per round:

* ``sync_save_s``: ``save()`` in ``async_mode=disabled`` (write + fsync + commit);
* ``async_stall_s``: how long ``save()`` blocks the loop in ``async_mode=async`` (staging:
  the copy to host memory), and ``async_total_s`` until the background write is committed;
* ``load_s``: resuming from the newest checkpoint (integrity checks + DCP load).

    python benchmarks/bench_checkpoint.py [--model 38m] [--rounds 3] [--dump outputs/bench_checkpoint]

Prints JSON with the medians.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from trainer.config import compose_config as make_config  # noqa: E402
from trainer.train import Trainer  # noqa: E402


def _trainer(model: str, dump: str, async_mode: str) -> Trainer:
    cfg = make_config(
        f"model={model}", f"job.dump_folder={dump}", "training.steps=1000", "training.seq_len=64",
        "training.global_batch_size=1", "training.micro_batch_size=1", "data.max_documents=50",
        "metrics.tensorboard=false", "metrics.log_freq=1000", "checkpoint.enable=true",
        "checkpoint.interval=1000000", "checkpoint.save_final=false", f"checkpoint.async_mode={async_mode}",
    )  # fmt: skip
    return Trainer(cfg)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="38m")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dump", default="outputs/bench_checkpoint")
    args = parser.parse_args()
    logging.disable(logging.INFO)
    shutil.rmtree(args.dump, ignore_errors=True)
    results: dict[str, list[float]] = {
        "sync_save_s": [],
        "async_stall_s": [],
        "async_total_s": [],
        "load_s": [],
    }

    trainer = _trainer(args.model, args.dump, "disabled")
    t0 = time.perf_counter()
    trainer.train(until_step=1)  # populates the AdamW state
    step_s = time.perf_counter() - t0
    ckpt = trainer.checkpointer
    for r in range(args.rounds):
        t0 = time.perf_counter()
        ckpt.save(100 + r)
        results["sync_save_s"].append(time.perf_counter() - t0)
    size = sum(e.stat().st_size for e in os.scandir(os.path.join(ckpt.folder, "step-100")))
    for _ in range(args.rounds):
        trainer.state.step = 0  # load() below must really restore it
        t0 = time.perf_counter()
        ckpt.load()
        results["load_s"].append(time.perf_counter() - t0)
    trainer.close()

    trainer = _trainer(args.model, args.dump, "async")  # resumes from step-102
    ckpt = trainer.checkpointer
    for r in range(args.rounds):
        t0 = time.perf_counter()
        ckpt.save(200 + r)
        results["async_stall_s"].append(time.perf_counter() - t0)
        ckpt.wait()
        results["async_total_s"].append(time.perf_counter() - t0)
    trainer.close()

    out = {
        "model": args.model,
        "params_m": round(sum(p.numel() for p in trainer.model.parameters()) / 1e6, 2),
        "checkpoint_mb": round(size / 2**20, 1),
        "train_step_s": round(step_s, 3),
        "rounds": args.rounds,
        **{k: round(statistics.median(v), 3) for k, v in results.items()},
    }
    out["async_stall_vs_sync"] = round(out["async_stall_s"] / out["sync_save_s"], 3)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
