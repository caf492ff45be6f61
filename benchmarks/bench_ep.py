"""Expert-parallel all_to_all volume per rank per step against the seed article's formula, and
the step time of EP x 2 against the same MoE model under plain FSDP x 2.

Article (section 8, "EP"): each MoE layer does two all_to_all per forward, dispatch and combine;
each sends k copies of every token's hidden state, so one layer moves ``2 * k * B * S * H``
elements per rank (B * S: the rank's tokens). Backward runs the two in reverse, the same
volume again. This script trains the real Trainer (moe_debug shapes, fp32, gloo) under
``parallelism.ep=2``, reads the byte counters of every MoE layer's ``AllToAllDispatcher`` (all
bytes handed to ``all_to_all_single``, and the share that leaves the rank), and divides by the
number of steps. Token dropping is off, so the count should equal the formula exactly.

The same model then trains under ``parallelism.dp_shard=2`` (experts replicated and FSDP-
sharded like everything else) and the mean step times after warm-up are compared.

    python benchmarks/bench_ep.py [--steps 6] [--seq 128] [--batch 8] [--micro 4]

Per rank, the article's quantity is the traffic of the rank's own tokens: the bytes it sends in
dispatch plus those it gets back in combine (the bytes a rank *sends* in combine depend on how
many tokens its experts received; their mean over ranks is the formula as well).

Prints JSON; ``within_5pct`` is true when every rank's own-token bytes are within 5% of the formula.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import socket
import sys
import tempfile
import traceback
from typing import Any

os.environ["OMP_NUM_THREADS"] = "1"  # before torch is imported, here and in the spawned ranks

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _overrides(args: argparse.Namespace, folder: str, layout: list[str]) -> list[str]:
    return [
        "+experiment=debug",
        "model=moe_debug",
        f"job.dump_folder={folder}",
        f"training.steps={args.steps}",
        f"training.seq_len={args.seq}",
        f"training.global_batch_size={args.batch}",
        f"training.micro_batch_size={args.micro}",
        "training.eval_freq=0",
        "metrics.log_freq=1",
        "metrics.tensorboard=false",
        "data.max_documents=400",
        *layout,
    ]


def _run(args: argparse.Namespace, folder: str, layout: list[str]) -> dict[str, Any]:
    from trainer.config import compose_config
    from trainer.train import Trainer

    cfg = compose_config(*_overrides(args, folder, layout))
    trainer = Trainer(cfg)
    logging.getLogger("meshwright").setLevel(logging.WARNING)  # keep stdout for the JSON
    history = trainer.train()
    layers = [layer for part in trainer.model_parts for layer in trainer.spec.moe_layers(part)]
    stats: dict[str, int] = {}
    for _, moe in layers:
        for key, value in getattr(moe.dispatcher, "stats", {}).items():
            stats[key] = stats.get(key, 0) + value
    times = [r["step_time_s"] for r in history if "step_time_s" in r][2:]  # skip warm-up steps
    out = {
        "stats": stats,
        "num_moe_layers": len(layers),
        "local_tokens_per_step": trainer.local_batch_size * cfg.training.seq_len,
        "dim": cfg.model.dim,
        "top_k": cfg.model.top_k,
        "step_time_s": sum(times) / max(1, len(times)),
        "losses": [r["loss"] for r in history if "loss" in r],
    }
    trainer.close()
    return out


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, folder: str, queue: Any) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
    )
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world)
        ep = _run(args, os.path.join(folder, "ep"), ["parallelism.ep=2", "parallelism.dp_shard=2"])
        fsdp = _run(args, os.path.join(folder, "fsdp"), ["parallelism.dp_shard=2"])
        queue.put((rank, {"ep": ep, "fsdp": fsdp}))
    except BaseException:
        queue.put((rank, traceback.format_exc()))
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--micro", type=int, default=4)
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    with tempfile.TemporaryDirectory() as folder:
        procs = [ctx.Process(target=_worker, args=(r, 2, port, args, folder, queue)) for r in range(2)]
        for p in procs:
            p.start()
        results = dict(queue.get() for _ in procs)
        for p in procs:
            p.join()
    for rank, r in results.items():
        if isinstance(r, str):
            raise SystemExit(f"rank {rank} failed:\n{r}")
    per_rank = []
    for rank in sorted(results):
        ep = results[rank]["ep"]
        bytes_per_elem = 4  # fp32
        formula = (
            2 * ep["top_k"] * ep["local_tokens_per_step"] * ep["dim"] * bytes_per_elem * ep["num_moe_layers"]
        )
        s = {k: v / args.steps for k, v in ep["stats"].items()}
        # The article's view: a rank's tokens go out k times (dispatch) and come back k times (combine).
        own = s["dispatch_forward_sent_bytes"] + s["combine_forward_recv_bytes"]
        sent = s["dispatch_forward_sent_bytes"] + s["combine_forward_sent_bytes"]
        per_rank.append(
            {
                "rank": rank,
                "forward_own_tokens_bytes_per_step": own,
                "formula_2kBSH_bytes_per_step": formula,
                "ratio": own / formula,
                "forward_sent_bytes_per_step": sent,
                "forward_sent_remote_bytes_per_step": s["dispatch_forward_sent_remote_bytes"]
                + s["combine_forward_sent_remote_bytes"],
                "backward_sent_bytes_per_step": s["dispatch_backward_sent_bytes"]
                + s["combine_backward_sent_bytes"],
            }
        )
    ep, fsdp = results[0]["ep"], results[0]["fsdp"]
    report = {
        "model": "moe_debug (8 experts top-2, 4 MoE layers, H=256), fp32, 2 gloo ranks",
        "tokens_per_rank_per_step": ep["local_tokens_per_step"],
        "per_rank": per_rank,
        "within_5pct": all(abs(r["ratio"] - 1) <= 0.05 for r in per_rank),
        # Sent bytes differ per rank with the expert load (combine returns what a rank's experts
        # got); their mean over ranks is the formula too.
        "mean_sent_over_formula": sum(r["forward_sent_bytes_per_step"] for r in per_rank)
        / sum(r["formula_2kBSH_bytes_per_step"] for r in per_rank),
        "step_time_s": {"ep2": ep["step_time_s"], "fsdp2": fsdp["step_time_s"]},
        "ep2_over_fsdp2": ep["step_time_s"] / fsdp["step_time_s"],
        "same_losses": max(abs(a - b) / abs(b) for a, b in zip(ep["losses"], fsdp["losses"])) < 1e-5,
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
