"""Framework overhead: the Trainer's tokens/s against a bare PyTorch loop, in one run.

Same model class and init, same batches (the Trainer's own data loader), same AdamW
(foreach), same grad clipping, one process, fp32 on the CPU. The two loops alternate in
rounds so machine drift hits both; the median over rounds of each loop's mean step
time is compared.

    python benchmarks/bench_overhead.py [--model debug] [--steps 20] [--rounds 5] [--threads 1]

Prints JSON with both throughputs and ``ratio = trainer / bare`` (target >= 0.97).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from trainer.config import compose_config as make_config  # noqa: E402
from trainer.train import Trainer  # noqa: E402


def bare_loop_step_time(trainer: Trainer, steps: int) -> float:
    """A hand-written loop over the same model class, weights, kernels (``training.cpu_gemm``), batches
    and optimizer settings."""
    cfg = trainer.cfg
    from models.cpu_gemm import resolve_cpu_gemm, use_onednn_linears
    from models.llama import Transformer
    from trainer.optim import build_optimizer

    model = Transformer(cfg.model)
    if resolve_cpu_gemm(cfg.training.cpu_gemm, "cpu"):
        use_onednn_linears(model)
    model.init_weights(seed=cfg.training.seed)
    opt = build_optimizer(model, cfg.optimizer, device_type="cpu")
    loader = trainer.train_loader
    accum = trainer.grad_accum_steps
    t0 = time.perf_counter()
    for _ in range(steps):
        batch = loader.next_batch()
        n_tokens = batch.labels.numel()
        for x, y in zip(batch.inputs.chunk(accum), batch.labels.chunk(accum)):
            logits = model(x)
            loss = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten(0, 1), reduction="sum") / n_tokens
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.training.grad_clip, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return (time.perf_counter() - t0) / steps


def trainer_step_time(trainer: Trainer, steps: int) -> float:
    """The Trainer's own loop (``train()``) over ``steps`` more steps, with its per-step
    bookkeeping and periodic logging; returns the mean step time."""
    t0 = time.perf_counter()
    trainer.cfg.training.steps = trainer.state.step + steps
    trainer.train()
    return (time.perf_counter() - t0) / steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="debug")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument(
        "--threads", type=int, default=1, help="intra-op threads (1 = stable timings on a shared CPU)"
    )
    args = ap.parse_args()
    # With 2 threads on a 2-core machine the spread between runs (+-5%) exceeds the overhead
    # being measured; one thread gives repeatable numbers (+-0.5%).
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    tmp = os.path.join("outputs", "bench_overhead")
    cfg = make_config(
        f"model={args.model}",
        f"training.seq_len={args.seq_len}",
        f"training.global_batch_size={args.batch}",
        f"training.micro_batch_size={args.batch // 2}",
        f"training.steps={args.steps}",
        "training.eval_freq=0",
        "metrics.log_freq=10",
        "metrics.tensorboard=false",
        f"job.dump_folder={tmp}",
    )
    trainer = Trainer(cfg)
    logging.getLogger("meshwright").setLevel(logging.WARNING)
    bare, ours = [], []
    bare_loop_step_time(trainer, 2)  # warm up allocator and kernels
    trainer_step_time(trainer, 2)
    for _ in range(args.rounds):  # alternate, so drift of the machine hits both
        bare.append(bare_loop_step_time(trainer, args.steps))
        ours.append(trainer_step_time(trainer, args.steps))
    trainer.close()
    tokens = args.batch * args.seq_len
    bare_tps = tokens / statistics.median(bare)
    ours_tps = tokens / statistics.median(ours)
    print(
        json.dumps(
            {
                "model": args.model,
                "tokens_per_step": tokens,
                "steps_per_round": args.steps,
                "rounds": args.rounds,
                "bare_tokens_per_sec": round(bare_tps, 1),
                "trainer_tokens_per_sec": round(ours_tps, 1),
                "ratio": round(ours_tps / bare_tps, 4),
                "target": ">= 0.97",
                "threads": args.threads,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
