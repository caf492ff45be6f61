"""µP transfer: the best learning rate over a sweep at two widths, standard parametrisation vs µP.

The real Trainer (one process, CPU by default) trains the Llama family at widths ``--widths`` (heads of
16, FFN 3 x dim, 2 blocks, untied head) on the built-in corpus for ``--steps`` AdamW steps with
warmup-cosine, at each peak LR of ``--lrs``, with ``model.mup.enable`` false and true (base width
``--base-dim``). The loss is the mean training loss of the last 10 steps (the data is seen once: it
is a held-out loss). Under µP the best LR should be the same at both widths; under the standard
parametrisation it shifts down as the width grows.

    python benchmarks/bench_mup.py [--widths 64 256] [--lrs 1e-3 3e-3 1e-2 3e-2 1e-1] [--steps 60]

Prints a markdown table (loss per LR, the best marked) and JSON with every figure.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests.spawn import run_distributed  # noqa: E402


def _overrides(width: int, lr: float, mup: bool, args: argparse.Namespace, folder: str) -> list[str]:
    return [
        f"model.dim={width}",
        "model.n_layers=2",
        f"model.n_heads={width // 16}",
        "model.n_kv_heads=null",
        f"model.ffn_hidden_dim={3 * width}",
        "model.tie_embeddings=false",
        f"model.mup.enable={str(mup).lower()}",
        f"model.mup.base_dim={args.base_dim}",
        f"optimizer.lr={lr}",
        "optimizer.weight_decay=0.0",
        "lr_scheduler.warmup_steps=5",
        f"training.steps={args.steps}",
        f"training.seq_len={args.seq_len}",
        f"training.global_batch_size={args.batch}",
        f"training.micro_batch_size={args.batch}",
        "training.eval_freq=0",
        "metrics.log_freq=1",
        "metrics.tensorboard=false",
        f"job.dump_folder={folder}",
    ]


def _rank(rank: int, world: int, runs: dict[str, list[str]]) -> dict[str, list[float]]:
    with contextlib.redirect_stdout(sys.stderr):  # the Trainer's log lines: stdout is the table's
        import torch

        from trainer.config import compose_config
        from trainer.train import Trainer

        torch.set_num_threads(1)
        out = {}
        for name, overrides in runs.items():
            trainer = Trainer(compose_config(*overrides))
            logging.getLogger("meshwright").setLevel(logging.WARNING)
            try:
                history = trainer.train()
            finally:
                trainer.close()
            out[name] = [r["loss"] for r in history if "loss" in r]
            print(f"{name}: {sum(out[name][-10:]) / 10:.4f}", file=sys.stderr, flush=True)
        return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--widths", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--lrs", type=float, nargs="+", default=[1e-3, 3e-3, 1e-2, 3e-2, 1e-1])
    parser.add_argument("--base-dim", type=int, default=64)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        runs = {
            f"{p}/{w}/{lr:g}": _overrides(w, lr, p == "mup", args, os.path.join(tmp, f"{p}-{w}-{lr:g}"))
            for p in ("sp", "mup")
            for w in args.widths
            for lr in args.lrs
        }
        losses = run_distributed(_rank, 1, runs, timeout=7200)[0]
    final = {name: sum(v[-10:]) / len(v[-10:]) for name, v in losses.items()}
    print("| parametrisation | width | " + " | ".join(f"lr {lr:g}" for lr in args.lrs) + " | best lr |")
    print("|---|---|" + "---|" * (len(args.lrs) + 1))
    best: dict[str, dict[int, float]] = {}
    for p in ("sp", "mup"):
        for w in args.widths:
            row = {lr: final[f"{p}/{w}/{lr:g}"] for lr in args.lrs}
            top = min(row, key=lambda lr: row[lr])
            best.setdefault(p, {})[w] = top
            cells = " | ".join(f"**{v:.3f}**" if lr == top else f"{v:.3f}" for lr, v in row.items())
            print(f"| {'µP' if p == 'mup' else 'SP'} | {w} | {cells} | {top:g} |")
    print(json.dumps({"final_loss": final, "best_lr": best, "args": vars(args)}))


if __name__ == "__main__":
    main()
