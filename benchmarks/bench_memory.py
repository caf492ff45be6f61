"""Per-rank memory of DDP, ZeRO-1 and FSDP: measured, and counted, against the seed article's formulas.

For each layout the real Trainer runs on N gloo ranks, and each rank reports two things:

1. **Accounting**: the bytes of parameters + gradients + optimizer state this rank holds
   (local shards only for DTensors) -- an element count, blind to any other buffer.
2. **Measured**: on CPU the process's resident set (``/proc/self/statm``, after
   ``malloc_trim`` so freed heap pages are returned) and its peak (``VmHWM`` in
   ``/proc/self/status``, reset per phase through ``/proc/self/clear_refs``); on CUDA
   ``torch.cuda.memory_allocated`` and ``max_memory_allocated`` (reset per phase). Phases:
   ``base`` (imports + process group), ``build`` (``Trainer()``: data, model, optimizer),
   ``step1`` (first step: gradients and Adam state appear) and ``steady`` (``--steps`` more).
   Growth is measured from ``base``; ``live`` is after the phase, ``peak`` its maximum.

Expected bytes per rank for P parameters and N ranks (fp32 training, the parameter is its
own master copy: 4 B param + 4 B grad + 8 B Adam exp_avg/exp_avg_sq = 16 B per parameter):

- DDP (custom)           16P
- DDP + ShardedOptimizer 8P + 8P/N  (the article's 4P + 12P/N assumes bf16 param/grad)
- FSDP (ZeRO-3)          16P/N

Gradients are kept after each step (``zero_grad`` is disabled) so that they are counted and
resident at the measurement, as in the formulas.

    python benchmarks/bench_memory.py [--world 4] [--model 38m] [--steps 3]       # CPU, spawns N ranks
    torchrun --nproc_per_node=N benchmarks/bench_memory.py --device cuda --layout fsdp   # GPUs
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import sys
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests.spawn import run_distributed  # noqa: E402
from trainer.config import compose_config as make_config  # noqa: E402

MIB = 2**20
_PAGE = os.sysconf("SC_PAGE_SIZE")


def _local_bytes(t: torch.Tensor) -> int:
    if hasattr(t, "to_local"):
        t = t.to_local()
    return t.numel() * t.element_size()


def _trim() -> None:
    """Return freed heap memory to the OS, so the resident set counts live allocations only."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: RSS then also holds freed-but-cached pages
        pass


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * _PAGE


def _peak_rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def _reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS (Linux >= 4.0)
    except OSError:
        pass  # then the peak is the process's peak so far


def _snapshot(device: torch.device) -> dict[str, int]:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        return {"live": torch.cuda.memory_allocated(device), "peak": torch.cuda.max_memory_allocated(device)}
    peak = _peak_rss()
    _trim()
    return {"live": _rss(), "peak": peak}


def _accounting(trainer: Any) -> dict[str, int]:
    params = list(trainer.model.parameters())
    return {
        "params": sum(_local_bytes(p) for p in params),
        "grads": sum(_local_bytes(p.grad) for p in params if p.grad is not None),
        "optimizer": sum(
            _local_bytes(v)
            for s in trainer.optimizer.state.values()
            for v in s.values()
            if torch.is_tensor(v) and v.ndim > 0
        ),
    }


def measure(overrides: list[str], steps: int, device: torch.device) -> dict[str, Any]:
    """Build the Trainer and train 1 + ``steps`` steps; memory per phase (growth from ``base``)."""
    from trainer.train import Trainer

    _trim()
    _reset_peak(device)
    base = _snapshot(device)["live"]
    phases: dict[str, dict[str, int]] = {}

    def phase(name: str) -> None:
        snap = _snapshot(device)
        phases[name] = {"live": snap["live"] - base, "peak": snap["peak"] - base}
        _reset_peak(device)

    trainer = Trainer(make_config(*overrides))
    phase("build")
    trainer.optimizer.zero_grad = lambda set_to_none=True: None  # type: ignore[method-assign]
    trainer.train_step()
    phase("step1")
    for _ in range(steps):
        trainer.train_step()
    phase("steady")
    out = {"base": base, "phases": phases, "accounting": _accounting(trainer)}
    trainer.close()
    return out


def _measure_rank(rank: int, world: int, overrides: list[str], steps: int) -> dict[str, Any]:
    return measure(overrides, steps, torch.device("cpu"))


def _layouts(n: int, num_params: int) -> dict[str, tuple[list[str], float, str]]:
    ddp = [f"parallelism.dp_replicate={n}", "parallelism.dp_shard=1"]
    return {
        "ddp": (ddp, 16 * num_params, "16P"),
        "zero1": (
            ddp + ["parallelism.ddp.sharded_optimizer=true"],
            8 * num_params + 8 * num_params / n,
            "8P + 8P/N",
        ),
        "fsdp": ([f"parallelism.dp_shard={n}"], 16 * num_params / n, "16P/N"),
    }


def _summary(per_rank: list[dict[str, Any]], formula: float, formula_text: str) -> dict[str, Any]:
    def mib(x: float) -> float:
        return round(x / MIB, 1)

    counted = [sum(r["accounting"].values()) for r in per_rank]
    r0 = per_rank[0]
    steady = max(r["phases"]["steady"]["live"] for r in per_rank)
    return {
        "formula": formula_text,
        "formula_mib": mib(formula),
        "counted_mib_per_rank": [mib(c) for c in counted],
        "counted_rel_err": round(max(abs(c - formula) for c in counted) / formula, 4),
        "counted_breakdown_mib_rank0": {k: mib(v) for k, v in r0["accounting"].items()},
        "measured_mib_rank0": {name: {k: mib(v) for k, v in p.items()} for name, p in r0["phases"].items()},
        "measured_steady_live_mib_max_rank": mib(steady),
        "measured_over_formula": round(steady / formula, 3),
        "measured_minus_formula_mib": mib(steady - formula),
        "base_rss_mib_rank0": mib(r0["base"]),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--model", default="38m")
    ap.add_argument("--steps", type=int, default=3, help="steady-state steps after the first")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--layout", default="all", choices=["all", "ddp", "zero1", "fsdp"])
    args = ap.parse_args()
    from models import get_spec

    model_cfg = make_config(f"model={args.model}").model
    num_params = get_spec(model_cfg.family).param_counts(model_cfg).total
    torchrun = "RANK" in os.environ  # CUDA: one process per GPU, started by torchrun
    n = int(os.environ["WORLD_SIZE"]) if torchrun else args.world
    base = [
        f"model={args.model}",
        "training.steps=1000",
        "training.seq_len=64",
        f"training.global_batch_size={n}",
        "training.micro_batch_size=1",
        "metrics.tensorboard=false",
        "metrics.jsonl=false",
        "data.max_documents=200",
        "job.dump_folder=outputs/bench_memory",
        f"training.device={args.device}",
    ]
    report: dict[str, Any] = {
        "model": args.model,
        "P": num_params,
        "world": n,
        "device": args.device,
        "dtype": "fp32 params/grads + fp32 Adam m,v",
        "measured": "CUDA memory_allocated"
        if args.device == "cuda"
        else "RSS after malloc_trim, peak = VmHWM",
    }
    if torchrun:
        import torch.distributed as dist

        from trainer.train_build import resolve_device

        device = resolve_device(args.device, int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")  # shared by every layout
    for name, (overrides, formula, text) in _layouts(n, num_params).items():
        if args.layout not in ("all", name):
            continue
        if torchrun:
            one = measure(base + overrides, args.steps, device)
            per_rank: list[Any] = [None] * n
            dist.all_gather_object(per_rank, one)
        else:
            per_rank = run_distributed(_measure_rank, n, base + overrides, args.steps, timeout=1800)
        report[name] = _summary(per_rank, formula, text)
    if not torchrun or dist.get_rank() == 0:
        print(json.dumps(report, indent=2))
    if torchrun:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
