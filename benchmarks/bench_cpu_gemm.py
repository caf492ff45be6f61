"""fp32 CPU linears: torch's ``F.linear`` (its BLAS, MKL) against oneDNN (``training.cpu_gemm=onednn``,
models/cpu_gemm.py), forward and backward of the debug-like shapes, in one process. Prints one JSON
line per shape (GFLOP/s of both, their ratio) and a summary line with the ratio over all shapes
(total time torch / total time oneDNN), the CPU model and the thread count.

    python benchmarks/bench_cpu_gemm.py [--threads 1] [--repeats 40] [--tokens 1024]

The minimum over repeats is taken (the machine's noise only adds time); the two kernels alternate.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from torch import nn  # noqa: E402

from models.cpu_gemm import onednn_available, use_onednn_linears  # noqa: E402

# (in, out) of the llama3 debug shape of docs/cpu_vs_torchtitan.md: q/k/v/o, w1/w3, w2, the head
SHAPES = ((256, 256), (256, 768), (768, 256), (256, 2048))


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _step_seconds(layer: nn.Module, x: torch.Tensor, grad: torch.Tensor) -> float:
    start = time.perf_counter()
    layer(x).backward(grad)
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=40)
    ap.add_argument("--tokens", type=int, default=1024, help="rows of the activations (batch x sequence)")
    args = ap.parse_args(argv)
    if not onednn_available():
        raise SystemExit("this torch build has no oneDNN CPU linear: nothing to compare")
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    totals = {"torch": 0.0, "onednn": 0.0}
    for d_in, d_out in SHAPES:
        plain = nn.Linear(d_in, d_out, bias=False)
        fast = nn.Linear(d_in, d_out, bias=False)
        fast.load_state_dict(plain.state_dict())
        use_onednn_linears(fast)
        x = torch.randn(args.tokens, d_in, requires_grad=True)
        grad = torch.randn(args.tokens, d_out)
        best = {"torch": float("inf"), "onednn": float("inf")}
        for _ in range(args.repeats):  # alternating, so both see the same moments of the machine
            for name, layer in (("torch", plain), ("onednn", fast)):
                best[name] = min(best[name], _step_seconds(layer, x, grad))
        flops = 3 * 2 * args.tokens * d_in * d_out  # output, input gradient, weight gradient
        for name in totals:
            totals[name] += best[name]
        print(
            json.dumps(
                {
                    "shape": f"{args.tokens}x{d_in} @ {d_in}x{d_out}",
                    "torch_gflops": round(flops / best["torch"] / 1e9, 1),
                    "onednn_gflops": round(flops / best["onednn"] / 1e9, 1),
                    "onednn_speedup": round(best["torch"] / best["onednn"], 3),
                }
            )
        )
    summary = {
        "cpu": _cpu_name(),
        "threads": args.threads,
        "torch": torch.__version__,
        "onednn_speedup_all_shapes": round(totals["torch"] / totals["onednn"], 3),
    }
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
