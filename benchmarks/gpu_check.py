"""One-command GPU check: does meshwright work on this CUDA machine, and how fast?

    python benchmarks/gpu_check.py [--quick] [--out DIR] [--gpus N] [--only PART,...] [--dry-run]

Runs each part below in its own process with a timeout (one failing part does not stop the
others), prints one JSON summary on stdout and writes it to ``DIR/summary.json`` (default DIR:
outputs/gpu_check); each part's log is ``DIR/logs/<part>.log``, each training run's folder
``DIR/runs/<part>/`` (config.yaml, metrics.jsonl, profile/). About 6-8 minutes on one GPU
(``--quick``: 3-4), plus about a minute per multi-GPU run.

* environment: GPU name / count / memory, torch, CUDA, cuDNN, NCCL and driver versions, and the
  measured dense bf16 matmul TFLOP/s: the denominator of this check's MFU;
* numerics against a float32 or eager reference: FlexAttention block-causal forward and backward
  vs SDPA with the dense mask (``models/attention.py``); grouped-GEMM experts
  (``torch._grouped_mm``) vs the padded batched fallback (``models/moe/experts.py``); fused vs
  foreach AdamW (``optimizer.implementation``); compiled vs eager training losses; Qwen3.5's Gated
  DeltaNet core with flash-linear-attention's kernels vs our torch form, and its speed (when the
  optional ``fla`` package is installed; ``model.linear_kernel``);
* training through ``trainer/main.py`` in bf16 on the 1B preset at seq 2048, eager and
  ``training.compile=true``: tokens/s, MFU (vs the datasheet peak, as the trainer logs it, and vs
  the measured matmul rate), peak ``max_memory_allocated`` against the planner's figure
  (``python -m trainer.plan``), falling loss; the eager run profiles one step
  (``profiling.enable``): a Chrome trace and a CUDA memory snapshot (paths in the summary);
* the same compiled 1B run with float8 tensorwise linears and with MXFP8 linears (``training.float8``;
  MXFP8 skipped below SM100): tokens/s and MFU, and their ratio to the bf16 compiled run
  (``tokens_per_sec_vs_bf16``); on CPU float8 runs only emulated (numerics, not speed:
  ``tests/trainer/test_float8.py``);
* MoE experts (``training.float8.experts``): the same eager MoE run (moe_debug widened to dim 1024,
  expert hidden 2048, bf16, seq 2048) with bf16 ``torch._grouped_mm`` experts, float8 rowwise experts
  (torchao's float8 grouped GEMM: SM90/SM100 only) and MXFP8 experts (SM100+): tokens/s of each
  against bf16 (``tokens_per_sec_vs_bf16``) and its per-step loss difference from bf16; a variant the
  GPU cannot run is reported ``unsupported`` with the reason. On CPU the float8 experts run only with
  reference kernels and MXFP8 only emulated (``tests/trainer/test_float8_grouped.py``,
  ``test_float8_experts.py``): numerics, not speed;
* KV-cache generation tokens/s with the 1B shapes (``models/generation.py``);
* with 2+ GPUs, NCCL runs of the debug model (moe_debug for EP) in bf16 whose per-step losses
  must match a 1-GPU reference: FSDP x N, TP x 2, CP x 2 (``cp_impl=ring`` and ``allgather``),
  EP x 2.

Tolerances are in the summary (``tolerances``) and in README.md ("Checking a GPU machine").
Exit status: 0 every part that ran passed; 1 some part failed; 2 bad arguments or no CUDA device.

Dependencies: the environment, numerics and generation parts need only torch (plus PyYAML, which
transformers brings, for the generation part's preset). The training parts run ``trainer/main.py``,
which needs hydra-core and omegaconf (``datasets`` is not needed: the runs use the built-in
corpus). Where they are missing those parts fail with that reason and the others still run. On a
machine without internet, bring them as wheels built elsewhere (all pure Python, any Python 3):

    pip wheel -w wheels 'hydra-core>=1.3' 'omegaconf>=2.3'     # on a connected machine
    pip install --no-index --find-links wheels hydra-core omegaconf   # on the GPU machine
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass
from typing import Any, Optional

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if sys.path[0] != REPO:
    sys.path.insert(0, REPO)  # before site-packages: ``benchmarks`` is this repository's

SCHEMA = "meshwright-gpu-check/1"
STATUSES = ("pass", "fail", "skip")

# Pass/fail bounds, reported in the summary. bf16 rounds at 2**-8 = 3.9e-3 relative; kernels that
# sum in another order (fused attention, grouped GEMMs, compiled graphs, sharded matmuls and
# reductions) differ from the reference by a few of those, and training amplifies step-1
# differences a little over the run.
TOLERANCES = {
    # bf16 FlexAttention vs fp32 SDPA (dense mask): out, dq, dk, dv; norm-relative
    "flex_attention_rel": 2e-2,
    "grouped_mm_rel": 2e-2,  # bf16 grouped / padded experts vs fp32 padded: out and grads; norm-relative
    "adamw_rel": 1e-5,  # fp32 fused vs foreach vs for-loop AdamW after 10 steps; norm-relative per tensor
    # Qwen3.5's Gated DeltaNet core, flash-linear-attention (bf16 inputs) vs our torch form (fp32): out
    # and the gradients of q, k, v, decay, beta, conv weights, causal and block-causal; norm-relative
    "delta_rule_fla_rel": 3e-2,
    "compile_vs_eager_loss_rel": 2e-2,  # bf16 1B: max over steps of |loss_c - loss_e| / loss_e
    "parity_loss_rel": 2e-2,  # bf16 NCCL layouts vs 1 GPU: max over steps of |loss - ref| / ref
    # the same for the pre-clip gradient norms (a mis-scaled reduction shows here)
    "parity_grad_norm_rel": 5e-2,
    "memory_over_plan_max": 1.25,  # measured peak max_memory_allocated / planned bytes per rank
    # low-precision MoE experts vs bf16 experts, the same run: max over steps of |loss - bf16| / bf16
    # (CPU, reference kernels / emulation, moe_debug cut to 1 layer: 1.9e-2 over 12 steps)
    "moe_experts_loss_rel": 5e-2,
    "loss_drop_min": 0.1,  # the last loss at most (1 - this) x the first
}


@dataclass(frozen=True)
class Part:
    """One part of the check: runs in a child process (``--part NAME``) with a timeout."""

    name: str
    what: str
    kind: str  # probe | train | parity
    min_gpus: int = 1
    timeout_s: int = 240
    quick_timeout_s: int = 180


PARTS = (
    Part(
        "environment", "GPUs, versions, dense bf16 matmul TFLOP/s (the MFU denominator)", "probe", 1, 120, 90
    ),
    Part(
        "numerics_flex_attention",
        "FlexAttention block-causal fwd+bwd (bf16, compiled) vs fp32 SDPA with the "
        "dense mask, B=2 S=2048 16/4 heads",
        "probe",
        1,
        300,
        240,
    ),
    Part(
        "numerics_grouped_mm",
        "grouped-GEMM experts vs padded bmm, bf16 weights and fp32+autocast, vs fp32",
        "probe",
        1,
        120,
        90,
    ),
    Part("numerics_adamw", "fused vs foreach vs for-loop AdamW, fp32, 10 steps", "probe", 1, 90, 60),
    Part(
        "numerics_delta_rule_fla",
        "Qwen3.5 Gated DeltaNet core: flash-linear-attention's kernels (bf16) vs our torch form (fp32), "
        "fwd+bwd, causal and documents, and their speed (not run without the fla package)",
        "probe",
        1,
        300,
        240,
    ),
    Part(
        "train_1b_eager",
        "trainer/main.py, 1B preset, bf16, seq 2048, eager; profiles one step",
        "train",
        1,
        420,
        240,
    ),
    Part(
        "train_1b_compiled",
        "trainer/main.py, 1B preset, bf16, seq 2048, training.compile=true",
        "train",
        1,
        480,
        300,
    ),
    Part(
        "train_1b_float8",
        "trainer/main.py, 1B preset, bf16, seq 2048, compiled, float8 tensorwise linears (torchao): "
        "tokens/s and MFU against train_1b_compiled",
        "train",
        1,
        480,
        300,
    ),
    Part(
        "train_1b_mxfp8",
        "the same with MXFP8 linears (SM100+ only: older GPUs report the part as not run)",
        "train",
        1,
        480,
        300,
    ),
    Part(
        "moe_experts",
        "MoE run (eager, bf16) with bf16 grouped-GEMM experts vs float8 rowwise experts (SM90/SM100) and "
        "MXFP8 experts (SM100+): tokens/s and loss difference",
        "moe",
        1,
        600,
        360,
    ),
    Part("generation_kv_cache", "greedy KV-cache generation, 1B shapes, bf16, batch 1", "probe", 1, 240, 180),
    Part("parity_reference", "debug model, bf16, 1 GPU: the reference of the dense layouts", "parity", 2),
    Part("parity_fsdp", "debug model, FSDP x N (all GPUs) vs parity_reference", "parity", 2),
    Part("parity_tp2", "debug model, TP x 2 vs parity_reference", "parity", 2),
    Part("parity_cp2_ring", "debug model, CP x 2, cp_impl=ring vs parity_reference", "parity", 2),
    Part("parity_cp2_allgather", "debug model, CP x 2, cp_impl=allgather vs parity_reference", "parity", 2),
    Part("parity_moe_reference", "moe_debug, bf16, 1 GPU: the reference of EP", "parity", 2),
    Part("parity_ep2", "moe_debug, EP x 2 (dp_shard=2) vs parity_moe_reference", "parity", 2),
)
PART_NAMES = tuple(p.name for p in PARTS)
# Parts computed from other parts' results (no process of their own).
DERIVED = {
    "numerics_compile_vs_eager": "per-step losses of train_1b_compiled vs train_1b_eager",
    "profiler_and_memory_snapshot": (
        "the profiler trace and CUDA memory snapshot of train_1b_eager's profiled step"
    ),
}
PARITY_REFERENCE = {
    "parity_fsdp": "parity_reference",
    "parity_tp2": "parity_reference",
    "parity_cp2_ring": "parity_reference",
    "parity_cp2_allgather": "parity_reference",
    "parity_ep2": "parity_moe_reference",
}


class PartFailure(Exception):
    """A part's own check failed; the message is the summary's ``reason``, ``numbers`` and
    ``artifacts`` what was measured before the failure."""

    def __init__(
        self,
        reason: str,
        numbers: Optional[dict[str, Any]] = None,
        artifacts: Optional[dict[str, Any]] = None,
    ) -> None:
        super().__init__(reason)
        self.numbers = numbers or {}
        self.artifacts = artifacts or {}


# ----------------------------------------------------------------------------------------------
# Arguments
# ----------------------------------------------------------------------------------------------


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    """Parse and check the arguments; bad ones exit with status 2 and a message naming them."""
    p = argparse.ArgumentParser(
        prog="gpu_check.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--quick", action="store_true", help="fewer steps and smaller sizes (about 4 minutes on one GPU)"
    )
    p.add_argument(
        "--out", default=os.path.join("outputs", "gpu_check"), help="folder for summary.json, logs, runs"
    )
    p.add_argument("--gpus", type=int, default=None, help="use the first N GPUs (default: all visible)")
    p.add_argument("--only", default=None, help=f"comma-separated parts to run, of: {', '.join(PART_NAMES)}")
    p.add_argument(
        "--micro-batch",
        type=int,
        default=4,
        help="1B micro batch at seq 2048 (default 4; halved until the planner says it fits)",
    )
    p.add_argument(
        "--dry-run", action="store_true", help="list the parts and commands; run nothing (works on CPU)"
    )
    p.add_argument("--part", default=None, help=argparse.SUPPRESS)  # internal: run one part (child process)
    args = p.parse_args(argv)
    if args.gpus is not None and args.gpus < 1:
        p.error(f"--gpus={args.gpus} must be >= 1 (or leave it out to use every visible GPU)")
    if args.micro_batch < 1:
        p.error(f"--micro-batch={args.micro_batch} must be >= 1")
    if os.path.exists(args.out) and not os.path.isdir(args.out):
        p.error(f"--out={args.out} is a file; pass a folder (it is created if missing)")
    names = (
        [n.strip() for n in args.only.split(",") if n.strip()] if args.only is not None else list(PART_NAMES)
    )
    unknown = [n for n in names if n not in PART_NAMES]
    if unknown or not names:
        p.error(f"--only={args.only!r}: unknown part(s) {unknown}; choose from {', '.join(PART_NAMES)}")
    if args.part is not None and args.part not in PART_NAMES:
        p.error(f"--part={args.part!r} is not a part; choose from {', '.join(PART_NAMES)}")
    names += [PARITY_REFERENCE[n] for n in names if n in PARITY_REFERENCE]  # a layout needs its reference
    args.only = [n for n in PART_NAMES if n in names]
    args.out = os.path.abspath(args.out)  # the parts run from the repository root
    return args


# ----------------------------------------------------------------------------------------------
# Trainer commands
# ----------------------------------------------------------------------------------------------


def train_steps(quick: bool) -> tuple[int, int, int]:
    """(steps, profiled step, warm-up steps left out of the throughput) of a 1B run."""
    return (12, 9, 4) if quick else (30, 25, 5)


def one_gpu_run(steps: int, folder: str) -> list[str]:
    """The overrides every one-GPU training run shares: bf16, ``steps`` steps each logged, no eval,
    checkpoint or TensorBoard, the built-in corpus, the run folder."""
    return [
        "training.mixed_precision=bf16",
        f"training.steps={steps}",
        "training.eval_freq=0",
        "training.device=cuda",
        "lr_scheduler.warmup_steps=3",
        "metrics.log_freq=1",
        "metrics.tensorboard=false",
        "checkpoint.enable=false",
        "data.max_documents=400",
        "parallelism.dp_shard=1",
        f"job.dump_folder={folder}",
    ]


def train_overrides(part: str, folder: str, quick: bool, micro_batch: int) -> list[str]:
    """Hydra overrides of a 1B run (``train_1b_eager`` / ``train_1b_compiled``)."""
    steps, profiled, _ = train_steps(quick)
    o = [
        "model=1b",
        "training.seq_len=2048",
        f"training.micro_batch_size={micro_batch}",
        f"training.global_batch_size={micro_batch}",
        *one_gpu_run(steps, folder),
    ]
    if part == "train_1b_eager":
        o += ["profiling.enable=true", f"profiling.steps=[{profiled}]", "profiling.memory_snapshot=true"]
    else:  # compiled: bf16, or with float8 / MXFP8 linears (the same shapes)
        o.append("training.compile=true")
    if part in FLOAT8_PARTS:
        o += ["training.float8.enable=true", f"training.float8.recipe={FLOAT8_PARTS[part]}"]
    return o


# float8 training parts -> recipe; their tokens/s and MFU are set against train_1b_compiled (bf16)
FLOAT8_PARTS = {"train_1b_float8": "tensorwise", "train_1b_mxfp8": "mxfp8"}


# MoE experts part: variant -> its float8 overrides (bf16: none; every variant has grouped_mm=on)
MOE_VARIANTS = {
    "bf16": (),
    "float8_rowwise": (
        "training.float8.enable=true",
        "training.float8.recipe=rowwise",
        "training.float8.experts=true",
    ),
    "mxfp8": ("training.float8.enable=true", "training.float8.recipe=mxfp8", "training.float8.experts=true"),
}


def moe_steps(quick: bool) -> tuple[int, int]:
    """(steps, warm-up steps left out of the throughput) of a run of the MoE experts part."""
    return (10, 3) if quick else (20, 5)


def moe_overrides(variant: str, folder: str, quick: bool) -> list[str]:
    """Hydra overrides of one variant of the MoE experts part: the same shapes, data and steps."""
    return [
        "model=moe_debug",
        "model.dim=1024",
        "model.n_heads=8",
        "model.n_kv_heads=4",
        "model.moe_hidden_dim=2048",
        "model.grouped_mm=on",
        "training.seq_len=2048",
        "training.micro_batch_size=8",
        "training.global_batch_size=8",
        *one_gpu_run(moe_steps(quick)[0], folder),
        *MOE_VARIANTS[variant],
    ]


PARITY_LAYOUTS = {
    "parity_reference": (1, []),
    "parity_fsdp": (-1, ["parallelism.dp_shard=-1"]),
    "parity_tp2": (2, ["parallelism.tp=2", "parallelism.dp_shard=1"]),
    "parity_cp2_ring": (2, ["parallelism.cp=2", "parallelism.cp_impl=ring", "parallelism.dp_shard=1"]),
    "parity_cp2_allgather": (
        2,
        ["parallelism.cp=2", "parallelism.cp_impl=allgather", "parallelism.dp_shard=1"],
    ),
    "parity_moe_reference": (1, ["model=moe_debug"]),
    "parity_ep2": (2, ["model=moe_debug", "parallelism.ep=2", "parallelism.dp_shard=2"]),
}


def parity_steps(quick: bool) -> int:
    return 6 if quick else 10


def parity_overrides(part: str, folder: str, quick: bool, num_gpus: int) -> tuple[int, list[str]]:
    """(processes, overrides) of a parity run. Every layout uses the same global batch (16, or a
    multiple of 2 x N that FSDP x N divides) and micro batch 2, so its data and steps are the
    reference's."""
    nproc, layout = PARITY_LAYOUTS[part]
    nproc = num_gpus if nproc == -1 else nproc
    gbs = math.lcm(16, 2 * max(num_gpus, 1))
    return nproc, [
        "+experiment=debug",
        "training.seq_len=512",
        "training.micro_batch_size=2",
        f"training.global_batch_size={gbs}",
        "training.mixed_precision=bf16",
        f"training.steps={parity_steps(quick)}",
        "training.eval_freq=0",
        "training.device=cuda",
        "lr_scheduler.warmup_steps=2",
        "metrics.log_freq=1",
        "metrics.tensorboard=false",
        "checkpoint.enable=false",
        "data.max_documents=300",
        f"job.dump_folder={folder}",
        *layout,
    ]


def trainer_command(nproc: int, overrides: list[str]) -> list[str]:
    """``python trainer/main.py`` for one process, torchrun (``torch.distributed.run``) for more."""
    if nproc == 1:
        return [sys.executable, "trainer/main.py", *overrides]
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        "trainer/main.py",
        *overrides,
    ]


def part_command(part: Part, out: str, quick: bool, num_gpus: int, micro_batch: int) -> Optional[list[str]]:
    """The trainer command a training / parity part runs (None for the in-process probes)."""
    folder = os.path.join(out, "runs", part.name)
    if part.kind == "train":
        return trainer_command(1, train_overrides(part.name, folder, quick, micro_batch))
    if part.kind == "parity":
        return trainer_command(*parity_overrides(part.name, folder, quick, num_gpus))
    return None


# ----------------------------------------------------------------------------------------------
# Reading runs
# ----------------------------------------------------------------------------------------------


def read_metrics(folder: str) -> list[dict[str, Any]]:
    """The training records (those with a ``loss``) of ``<folder>/metrics.jsonl``, by step."""
    path = os.path.join(folder, "metrics.jsonl")
    if not os.path.isfile(path):
        return []
    with open(path, encoding="utf-8") as f:
        records = [json.loads(line) for line in f if line.strip()]
    return sorted((r for r in records if "loss" in r), key=lambda r: r["step"])


def summarize_training(
    records: list[dict[str, Any]], *, warmup: int, exclude: tuple[int, ...] = ()
) -> dict[str, Any]:
    """Throughput (medians over the steps after ``warmup``, without ``exclude``), peak memory
    (``memory_gib`` is ``max_memory_allocated`` since the previous record) and the losses."""
    if not records:
        raise PartFailure("no training records in metrics.jsonl (see the part's log)")
    timed = [r for r in records if r["step"] > warmup and r["step"] not in exclude] or records[-1:]

    def median(key: str) -> Optional[float]:
        values = [r[key] for r in timed if r.get(key) is not None]
        return statistics.median(values) if values else None

    losses = [r["loss"] for r in records]
    return {
        "steps": len(records),
        "timed_steps": [r["step"] for r in timed],
        "tokens_per_sec": median("tokens_per_sec"),
        "tflops": median("tflops"),
        "mfu_pct_datasheet": median("mfu"),
        "step_time_s": median("step_time_s"),
        "peak_memory_gib": max(r.get("memory_gib") or 0.0 for r in records),
        "first_loss": losses[0],
        "last_loss": losses[-1],
        "losses": losses,
    }


def finite_json(obj: Any) -> Any:
    """``obj`` with non-finite floats as strings ("nan", "inf"): the summary stays strict JSON."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    if isinstance(obj, dict):
        return {k: finite_json(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite_json(v) for v in obj]
    return obj


def compare_losses(test: list[float], ref: list[float], tol: float) -> dict[str, Any]:
    """Per-step relative loss difference of ``test`` against ``ref``: pass when every step is within
    ``tol``."""
    if not test or not ref:
        return {"pass": False, "reason": "no losses to compare"}
    if not all(isinstance(x, (int, float)) and math.isfinite(x) for x in (*test, *ref)):
        return {"pass": False, "reason": "a value is not a finite number"}
    if len(test) != len(ref):
        return {"pass": False, "reason": f"{len(test)} steps vs {len(ref)} in the reference"}
    rel = [abs(a - b) / abs(b) if b else abs(a - b) for a, b in zip(test, ref)]
    worst = max(rel)
    return {
        "pass": worst <= tol,
        "max_rel": worst,
        "step1_rel": rel[0],
        "tolerance": tol,
        "reason": None
        if worst <= tol
        else f"differs by {worst:.3g} relative (> {tol:g}) at step {rel.index(worst) + 1}",
    }


# ----------------------------------------------------------------------------------------------
# Parts (each runs in a child process)
# ----------------------------------------------------------------------------------------------


def _device() -> Any:
    import torch

    return torch.device("cuda", 0)


def part_environment(args: argparse.Namespace) -> dict[str, Any]:
    from benchmarks.gpu_probes import environment, matmul_tflops

    env = environment()
    sizes, iters = ((8192,), 10) if args.quick else ((4096, 8192, 16384), 20)
    try:
        mm = matmul_tflops(_device(), sizes=sizes, iters=iters)
    except Exception as e:  # keep the versions and GPU list in the summary
        raise PartFailure(f"bf16 matmul failed: {type(e).__name__}: {e}"[:1000], env) from e
    env.update(matmul_bf16_tflops=mm["tflops"], matmul_bf16_tflops_by_size=mm["tflops_by_size"])
    if not mm["tflops"] > 0:
        raise PartFailure(f"bf16 matmul measured {mm['tflops']} TFLOP/s")
    return {"numbers": env}


def _bounded(numbers: dict[str, Any], key: str, tol: float, what: str) -> dict[str, Any]:
    if numbers[key] is None:
        errors = {k: v["error"] for k, v in numbers.items() if isinstance(v, dict) and "error" in v}
        raise PartFailure(f"{what}: raised {errors}", numbers)
    if not numbers[key] <= tol:
        raise PartFailure(f"{what}: {key}={numbers[key]:.3g} > {tol:g}", numbers)
    return {"numbers": numbers}


def part_numerics_flex_attention(args: argparse.Namespace) -> dict[str, Any]:
    from benchmarks.gpu_probes import check_flex_attention

    numbers = check_flex_attention(_device(), seq_len=1024 if args.quick else 2048)
    return _bounded(numbers, "max_rel_err", TOLERANCES["flex_attention_rel"], "FlexAttention vs SDPA")


def part_numerics_grouped_mm(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from benchmarks.gpu_probes import check_grouped_experts

    numbers = check_grouped_experts(_device())
    major, minor = torch.cuda.get_device_capability(0)
    numbers["grouped_mm_auto_here"] = (major, minor) >= (9, 0)  # grouped_mm=auto uses it on sm90+
    return _bounded(numbers, "max_rel_err", TOLERANCES["grouped_mm_rel"], "grouped vs padded experts")


def part_numerics_adamw(args: argparse.Namespace) -> dict[str, Any]:
    from benchmarks.gpu_probes import check_adamw

    return _bounded(check_adamw(_device()), "max_rel_err", TOLERANCES["adamw_rel"], "fused vs foreach AdamW")


def part_numerics_delta_rule_fla(args: argparse.Namespace) -> dict[str, Any]:
    from benchmarks.gpu_probes import check_delta_rule_fla
    from models.qwen3_5.kernels import fla_installed

    if not fla_installed():
        return {
            "status": "skip",
            "reason": "flash-linear-attention is not installed (pip install 'meshwright[fla]')",
        }
    numbers = check_delta_rule_fla(_device(), seq_len=2048 if args.quick else 4096)
    return _bounded(numbers, "max_rel_err", TOLERANCES["delta_rule_fla_rel"], "fla vs torch Gated DeltaNet")


def part_generation_kv_cache(args: argparse.Namespace) -> dict[str, Any]:
    from benchmarks.gpu_probes import generation_speed

    numbers = generation_speed(_device(), new_tokens=64 if args.quick else 256)
    if not numbers["decode_tokens_per_s"] > 0:
        raise PartFailure("no tokens generated", numbers)
    return {"numbers": numbers}


def _require_training_packages() -> None:
    from benchmarks.gpu_probes import missing_training_packages

    missing = missing_training_packages()
    if missing:
        raise PartFailure(
            f"{', '.join(missing)} not installed: trainer/main.py composes Hydra configs. Install them "
            "(pip install hydra-core omegaconf; offline: see `python benchmarks/gpu_check.py --help`)"
        )


def run_trainer(cmd: list[str], timeout_s: float) -> int:
    """Run a trainer command from the repository root (its output joins this part's log); on
    timeout SIGTERM it (torchrun passes it to its workers), then SIGKILL."""
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    print("$ " + shlex.join(cmd), flush=True)
    proc = subprocess.Popen(cmd, cwd=REPO, env=env)
    try:
        return proc.wait(timeout=max(timeout_s, 1.0))
    except subprocess.TimeoutExpired:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        raise PartFailure(f"the trainer did not finish within {timeout_s:.0f} s") from None


def planned_memory_gib(overrides: list[str]) -> float:
    """The planner's per-rank bytes (stage 0's total, without the CUDA workspace) in GiB."""
    cmd = [sys.executable, "-m", "trainer.plan", *overrides, "--json"]
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=180)
    if proc.returncode != 0:
        raise PartFailure(f"python -m trainer.plan failed ({proc.returncode}): {proc.stderr.strip()[-500:]}")
    plan = json.loads(proc.stdout)
    return max(s["total_bytes"] for s in plan["stages"]) / 2**30


def fitting_micro_batch(
    part: str, folder: str, args: argparse.Namespace, memory_gib: float
) -> tuple[int, float]:
    """The largest micro batch <= ``--micro-batch`` (halving) whose planned bytes fit 85% of the GPU."""
    micro = args.micro_batch
    while True:
        planned = planned_memory_gib(train_overrides(part, folder, args.quick, micro))
        if planned <= 0.85 * memory_gib or micro == 1:
            return micro, planned
        micro //= 2


def profile_artifacts(folder: str, step: int) -> dict[str, Any]:
    """Paths and sizes of the trace, top-ops table and memory snapshot of ``step`` (rank 0)."""
    base = os.path.join(folder, "profile", f"step-{step}")
    out: dict[str, Any] = {}
    for key, name in (
        ("profile_trace", "rank0.trace.json"),
        ("top_ops", "rank0.top_ops.txt"),
        ("memory_snapshot", "rank0.memory_snapshot.pickle"),
    ):
        path = os.path.join(base, name)
        out[key] = os.path.abspath(path) if os.path.isfile(path) else None
        out[f"{key}_bytes"] = os.path.getsize(path) if os.path.isfile(path) else 0
    return out


def part_train(args: argparse.Namespace, part: Part) -> dict[str, Any]:
    """A 1B run through trainer/main.py: throughput, peak memory vs the plan, falling loss."""
    import torch

    _require_training_packages()
    if part.name == "train_1b_mxfp8" and torch.cuda.get_device_capability(0) < (10, 0):
        major, minor = torch.cuda.get_device_capability(0)
        return {"status": "skip", "reason": f"MXFP8 needs SM100+; this GPU is SM{major}{minor}"}
    folder = os.path.abspath(os.path.join(args.out, "runs", part.name))
    shutil.rmtree(folder, ignore_errors=True)  # a fresh run, not a resume
    memory = torch.cuda.get_device_properties(0).total_memory / 2**30
    micro, planned = fitting_micro_batch(part.name, folder, args, memory)
    cmd = trainer_command(1, train_overrides(part.name, folder, args.quick, micro))
    artifacts: dict[str, Any] = {
        "run_folder": folder,
        "metrics_jsonl": os.path.join(folder, "metrics.jsonl"),
        "command": shlex.join(cmd),
    }
    rc = run_trainer(cmd, args.deadline - time.monotonic())
    steps, profiled, warmup = train_steps(args.quick)
    if part.name == "train_1b_eager":
        artifacts.update(profile_artifacts(folder, profiled))
    if rc != 0:
        raise PartFailure(f"trainer/main.py exited with status {rc} (see the part's log)", {}, artifacts)
    numbers = {
        "preset": "1b",
        "seq_len": 2048,
        "micro_batch": micro,
        "dtype": "bf16",
        "float8": FLOAT8_PARTS.get(part.name),
        "compile": part.name != "train_1b_eager",
        **summarize_training(read_metrics(folder), warmup=warmup, exclude=(profiled,)),
    }
    numbers["planned_memory_gib"] = planned
    numbers["memory_over_plan"] = numbers["peak_memory_gib"] / planned
    numbers["loss_falling"] = (
        numbers["last_loss"] <= (1 - TOLERANCES["loss_drop_min"]) * numbers["first_loss"]
    )
    problems = []
    if numbers["steps"] != steps:
        problems.append(f"{numbers['steps']} of {steps} steps logged")
    if not numbers["loss_falling"]:
        problems.append(f"loss did not fall: {numbers['first_loss']:.3f} -> {numbers['last_loss']:.3f}")
    if numbers["memory_over_plan"] > TOLERANCES["memory_over_plan_max"]:
        problems.append(
            f"peak memory {numbers['peak_memory_gib']:.1f} GiB is {numbers['memory_over_plan']:.2f}x "
            f"the planned {planned:.1f} GiB (> {TOLERANCES['memory_over_plan_max']})"
        )
    if problems:
        raise PartFailure("; ".join(problems), numbers, artifacts)
    return {"numbers": numbers, "artifacts": artifacts}


def moe_unsupported(variant: str) -> Optional[str]:
    """Why this GPU cannot run ``variant`` of the MoE experts part (None: it can), from the checks the
    trainer itself applies (``parallelisms/float8.py``)."""
    import torch

    from parallelisms.float8 import has_float8_grouped_mm, has_mxfp8_matmul

    device = _device()
    major, minor = torch.cuda.get_device_capability(device)
    if variant == "float8_rowwise" and not has_float8_grouped_mm(device):
        return (
            f"torchao's float8 grouped GEMM needs CUDA SM90/SM100 (torch._scaled_grouped_mm) and Triton; "
            f"this GPU is SM{major}{minor}"
        )
    if variant == "mxfp8" and not has_mxfp8_matmul(device):
        return f"MXFP8 experts need SM100+ (below they run only emulated); this GPU is SM{major}{minor}"
    return None


def part_moe_experts(args: argparse.Namespace) -> dict[str, Any]:
    """The MoE run with bf16, float8 rowwise and MXFP8 experts (same shapes, eager): each variant's
    tokens/s and losses, its speed against bf16 and its per-step loss difference from bf16."""
    _require_training_packages()
    steps, warmup = moe_steps(args.quick)
    numbers: dict[str, Any] = {"preset": "moe_debug (dim 1024, expert hidden 2048)", "seq_len": 2048}
    artifacts: dict[str, Any] = {}
    problems = []
    for variant in MOE_VARIANTS:
        reason = moe_unsupported(variant)
        if reason is not None:
            numbers[variant] = {"status": "unsupported", "reason": reason}
            continue
        folder = os.path.abspath(os.path.join(args.out, "runs", f"moe_experts_{variant}"))
        shutil.rmtree(folder, ignore_errors=True)
        cmd = trainer_command(1, moe_overrides(variant, folder, args.quick))
        artifacts[variant] = {"run_folder": folder, "command": shlex.join(cmd)}
        rc = run_trainer(cmd, args.deadline - time.monotonic())
        if rc != 0:
            numbers[variant] = {"status": "fail", "reason": f"trainer/main.py exited with status {rc}"}
            problems.append(f"{variant}: trainer/main.py exited with status {rc} (see the part's log)")
            continue
        run = summarize_training(read_metrics(folder), warmup=warmup)
        numbers[variant] = {"status": "pass", **run}
        if run["steps"] != steps:
            problems.append(f"{variant}: {run['steps']} of {steps} steps logged")
    bf16 = numbers.get("bf16", {})
    for variant in MOE_VARIANTS:
        got = numbers[variant]
        if variant == "bf16" or got.get("status") != "pass" or bf16.get("status") != "pass":
            continue
        if got["tokens_per_sec"] and bf16["tokens_per_sec"]:
            got["tokens_per_sec_vs_bf16"] = got["tokens_per_sec"] / bf16["tokens_per_sec"]
        cmp = compare_losses(got["losses"], bf16["losses"], TOLERANCES["moe_experts_loss_rel"])
        got["loss_vs_bf16"] = {k: v for k, v in cmp.items() if k not in ("pass", "reason")}
        if not cmp["pass"]:
            problems.append(f"{variant}: loss {cmp['reason']}")
    if problems:
        raise PartFailure("; ".join(problems), numbers, artifacts)
    return {"numbers": numbers, "artifacts": artifacts}


def part_parity(args: argparse.Namespace, part: Part) -> dict[str, Any]:
    """A debug-model run on 1 or more GPUs; the parent compares its losses with the reference's."""
    _require_training_packages()
    folder = os.path.abspath(os.path.join(args.out, "runs", part.name))
    shutil.rmtree(folder, ignore_errors=True)
    nproc, overrides = parity_overrides(part.name, folder, args.quick, args.gpus)
    cmd = trainer_command(nproc, overrides)
    artifacts = {"run_folder": folder, "command": shlex.join(cmd)}
    rc = run_trainer(cmd, args.deadline - time.monotonic())
    if rc != 0:
        raise PartFailure(
            f"trainer exited with status {rc} (see the part's log)", {"processes": nproc}, artifacts
        )
    records = read_metrics(folder)
    numbers = {
        "processes": nproc,
        "dtype": "bf16",
        "losses": [r["loss"] for r in records],
        "grad_norms": [r["grad_norm"] for r in records],
    }
    if len(records) != parity_steps(args.quick):
        raise PartFailure(f"{len(records)} of {parity_steps(args.quick)} steps logged", numbers, artifacts)
    return {"numbers": numbers, "artifacts": artifacts}


PROBES = {
    "environment": part_environment,
    "numerics_flex_attention": part_numerics_flex_attention,
    "numerics_grouped_mm": part_numerics_grouped_mm,
    "numerics_adamw": part_numerics_adamw,
    "numerics_delta_rule_fla": part_numerics_delta_rule_fla,
    "generation_kv_cache": part_generation_kv_cache,
}


def run_part_kind(args: argparse.Namespace, part: Part) -> dict[str, Any]:
    """Run ``part`` by its kind (in this process); raises ``PartFailure`` when its check fails."""
    if part.kind == "probe":
        return PROBES[part.name](args)
    if part.kind == "train":
        return part_train(args, part)
    if part.kind == "moe":
        return part_moe_experts(args)
    return part_parity(args, part)


def timeout_of(part: Part, quick: bool) -> int:
    return part.quick_timeout_s if quick else part.timeout_s


def run_part_here(args: argparse.Namespace) -> int:
    """Child process: run ``--part`` and write ``<out>/parts/<name>.json``."""
    part = next(p for p in PARTS if p.name == args.part)
    start = time.perf_counter()
    args.deadline = time.monotonic() + timeout_of(part, args.quick) - 30  # the parent stops it at the timeout
    try:
        result = {"status": "pass", "reason": None, **run_part_kind(args, part)}
    except PartFailure as e:
        result = {"status": "fail", "reason": str(e), "numbers": e.numbers, "artifacts": e.artifacts}
    except Exception as e:
        traceback.print_exc()
        result = {"status": "fail", "reason": f"{type(e).__name__}: {e}"[:2000]}
    result["wall_s"] = round(time.perf_counter() - start, 2)
    path = os.path.join(args.out, "parts", f"{part.name}.json")
    with open(path + ".tmp", "w", encoding="utf-8") as f:
        json.dump(finite_json(result), f, indent=2, default=str)
    os.replace(path + ".tmp", path)
    print(json.dumps(result, default=str)[:4000], flush=True)
    return 0


# ----------------------------------------------------------------------------------------------
# The parent: plan, run, summarise
# ----------------------------------------------------------------------------------------------


def plan_parts(only: list[str], num_gpus: int) -> list[tuple[Part, Optional[str]]]:
    """The selected parts in order, each with None (run it) or the reason it is skipped."""
    planned = []
    for part in PARTS:
        if part.name not in only:
            continue
        skip = None
        if num_gpus < part.min_gpus:
            skip = f"needs {part.min_gpus}+ GPUs, {num_gpus} in use"
        planned.append((part, skip))
    return planned


def _log_tail(path: str, lines: int = 15) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return "".join(f.readlines()[-lines:]).strip()
    except OSError:
        return ""


def run_part_child(part: Part, args: argparse.Namespace) -> dict[str, Any]:
    """Run one part in a child process (its own session) with the part's timeout."""
    out = args.out
    result_path = os.path.join(out, "parts", f"{part.name}.json")
    log = os.path.join(out, "logs", f"{part.name}.log")
    if os.path.exists(result_path):
        os.remove(result_path)
    cmd = [
        sys.executable,
        os.path.abspath(__file__),
        "--part",
        part.name,
        "--out",
        out,
        "--gpus",
        str(args.gpus),
        "--micro-batch",
        str(args.micro_batch),
        *(["--quick"] if args.quick else []),
    ]
    timeout = timeout_of(part, args.quick)
    start = time.perf_counter()
    with open(log, "w", encoding="utf-8") as f:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        timed_out = False
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out, rc = True, None
            _stop_group(proc)
    wall = round(time.perf_counter() - start, 2)
    result: dict[str, Any] = {"status": "fail", "reason": None, "numbers": {}, "artifacts": {}}
    if os.path.isfile(result_path):
        with open(result_path, encoding="utf-8") as f:
            result.update(json.load(f))
    elif timed_out:
        result["reason"] = f"timed out after {timeout} s; log tail:\n{_log_tail(log)}"
    else:
        result["reason"] = (
            f"the part's process exited with status {rc} without a result; log tail:\n{_log_tail(log)}"
        )
    result.update(wall_s=wall, log=os.path.abspath(log))
    return result


def _stop_group(proc: subprocess.Popen) -> None:
    """SIGTERM the child's process group (the child and a trainer it started), then SIGKILL."""
    for sig, wait in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def _derive_train(result: dict[str, Any], matmul_tflops: Optional[float]) -> None:
    """Add the MFU against the measured matmul rate to a training part's numbers."""
    tflops = result.get("numbers", {}).get("tflops")
    if tflops is not None and matmul_tflops:
        result["numbers"]["mfu_pct_measured_matmul"] = 100.0 * tflops / matmul_tflops


def _judge_parity(result: dict[str, Any], ref: Optional[dict[str, Any]], ref_name: str) -> None:
    """A layout passes when its run passed and its losses match the reference's within tolerance."""
    if result["status"] != "pass":
        return
    if ref is None or ref["status"] != "pass":
        state = "was not run" if ref is None else ref["status"]
        result.update(status="fail", reason=f"no reference to compare with: {ref_name} {state}")
        return
    numbers, ref_numbers = result["numbers"], ref["numbers"]
    cmp = compare_losses(numbers["losses"], ref_numbers["losses"], TOLERANCES["parity_loss_rel"])
    norms = compare_losses(
        numbers["grad_norms"], ref_numbers["grad_norms"], TOLERANCES["parity_grad_norm_rel"]
    )
    numbers["reference"] = ref_name
    numbers["loss_vs_reference"] = {k: v for k, v in cmp.items() if k not in ("pass", "reason")}
    numbers["grad_norm_vs_reference"] = {k: v for k, v in norms.items() if k not in ("pass", "reason")}
    reasons = [
        f"{what} {c['reason']}" for what, c in (("loss:", cmp), ("grad norm:", norms)) if not c["pass"]
    ]
    if reasons:
        result.update(status="fail", reason="; ".join(reasons))


def _compile_vs_eager(results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    eager, comp = results.get("train_1b_eager"), results.get("train_1b_compiled")
    if eager is None or comp is None:
        return _result("skip", "needs train_1b_eager and train_1b_compiled")
    losses = {k: r.get("numbers", {}).get("losses") for k, r in (("eager", eager), ("compiled", comp))}
    missing = [k for k, v in losses.items() if not v]
    if missing:
        return _result("fail", f"no losses from the {' and '.join(missing)} run (see its part)")
    cmp = compare_losses(losses["compiled"], losses["eager"], TOLERANCES["compile_vs_eager_loss_rel"])
    numbers = {k: v for k, v in cmp.items() if k not in ("pass", "reason")}
    return _result("pass" if cmp["pass"] else "fail", cmp["reason"], numbers)


def _profile_part(results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    eager = results.get("train_1b_eager")
    if eager is None:
        return _result("skip", "needs train_1b_eager")
    a = eager.get("artifacts", {})
    keys = ("profile_trace", "memory_snapshot", "top_ops")
    artifacts = {k: a.get(k) for k in keys}
    numbers = {f"{k}_bytes": a.get(f"{k}_bytes", 0) for k in keys}
    missing = [k for k in keys if not artifacts[k] or not numbers[f"{k}_bytes"]]
    reason = f"not written: {', '.join(missing)} (see train_1b_eager's log)" if missing else None
    return _result("fail" if missing else "pass", reason, numbers, artifacts)


def _result(
    status: str, reason: Optional[str], numbers: Optional[dict] = None, artifacts: Optional[dict] = None
) -> dict[str, Any]:
    return {
        "status": status,
        "reason": reason,
        "numbers": numbers or {},
        "artifacts": artifacts or {},
        "wall_s": 0.0,
    }


def build_summary(
    results: dict[str, dict[str, Any]], *, quick: bool, out: str, gpus: int, started_utc: str, wall_s: float
) -> dict[str, Any]:
    """The summary from the parts' results (``{name: {status, reason, numbers, artifacts, wall_s}}``):
    derived checks added (MFU vs the measured matmul, parity vs reference, compiled vs eager,
    profiler files), parts in the canonical order, counts and the overall ``ok``."""
    results = json.loads(json.dumps(finite_json(results), default=str))  # a deep copy; numbers get added
    env = results.get("environment", {})
    matmul = env.get("numbers", {}).get("matmul_bf16_tflops") if env.get("status") == "pass" else None
    for name in ("train_1b_eager", "train_1b_compiled", *FLOAT8_PARTS):
        if name in results:
            _derive_train(results[name], matmul)
    bf16 = results.get("train_1b_compiled", {}).get("numbers", {})
    for name in FLOAT8_PARTS:  # the float8 speed-up: same shapes, same compile, vs bf16
        numbers = results.get(name, {}).get("numbers")
        if numbers and numbers.get("tokens_per_sec") and bf16.get("tokens_per_sec"):
            numbers["tokens_per_sec_vs_bf16"] = numbers["tokens_per_sec"] / bf16["tokens_per_sec"]
    for name, ref in PARITY_REFERENCE.items():
        if name in results:
            _judge_parity(results[name], results.get(ref), ref)
    derived = {}
    if "train_1b_eager" in results or "train_1b_compiled" in results:
        derived["numerics_compile_vs_eager"] = _compile_vs_eager(results)
    if "train_1b_eager" in results:
        derived["profiler_and_memory_snapshot"] = _profile_part(results)
    parts = []
    for name in (*PART_NAMES, *DERIVED):
        r = results.get(name, derived.get(name))
        if r is None:
            continue
        parts.append(
            {
                "name": name,
                "status": r.get("status", "fail"),
                "reason": r.get("reason"),
                "wall_s": float(r.get("wall_s", 0.0)),
                "numbers": r.get("numbers") or {},
                "artifacts": r.get("artifacts") or {},
                "log": r.get("log"),
            }
        )
    counts = {s: sum(p["status"] == s for p in parts) for s in STATUSES}
    return {
        "schema": SCHEMA,
        "ok": counts["fail"] == 0 and counts["pass"] > 0,
        "quick": quick,
        "out_dir": os.path.abspath(out),
        "gpus_used": gpus,
        "started_utc": started_utc,
        "wall_s": round(wall_s, 2),
        "environment": env.get("numbers", {}),
        "tolerances": dict(TOLERANCES),
        "parts": parts,
        "counts": counts,
    }


SUMMARY_KEYS = {
    "schema": str,
    "ok": bool,
    "quick": bool,
    "out_dir": str,
    "gpus_used": int,
    "started_utc": str,
    "wall_s": (int, float),
    "environment": dict,
    "tolerances": dict,
    "parts": list,
    "counts": dict,
}
PART_KEYS = {
    "name": str,
    "status": str,
    "reason": (str, type(None)),
    "wall_s": (int, float),
    "numbers": dict,
    "artifacts": dict,
    "log": (str, type(None)),
}


def validate_summary(summary: Any) -> None:
    """Raise ``ValueError`` listing every way ``summary`` departs from the schema above."""
    problems = []
    if not isinstance(summary, dict):
        raise ValueError(f"the summary is a {type(summary).__name__}, not a JSON object")
    for key, kind in SUMMARY_KEYS.items():
        if key not in summary:
            problems.append(f"missing key {key!r}")
        elif not isinstance(summary[key], kind) or (kind is int and isinstance(summary[key], bool)):
            problems.append(f"{key!r} is {type(summary[key]).__name__}")
    if summary.get("schema") not in (None, SCHEMA):
        problems.append(f"schema {summary['schema']!r} is not {SCHEMA!r}")
    known = set(PART_NAMES) | set(DERIVED)
    for i, part in enumerate(summary.get("parts") or []):
        if not isinstance(part, dict):
            problems.append(f"parts[{i}] is not an object")
            continue
        for key, kind in PART_KEYS.items():
            if key not in part or not isinstance(part[key], kind):
                problems.append(f"parts[{i}].{key} missing or not {kind}")
        if part.get("name") not in known:
            problems.append(f"parts[{i}].name={part.get('name')!r} is not a known part")
        if part.get("status") not in STATUSES:
            problems.append(f"parts[{i}].status={part.get('status')!r} is not one of {STATUSES}")
        elif part["status"] != "pass" and not part.get("reason"):
            problems.append(f"parts[{i}] ({part.get('name')}) is {part['status']} without a reason")
    parts = [p for p in summary.get("parts") or [] if isinstance(p, dict)]
    counts = {s: sum(p.get("status") == s for p in parts) for s in STATUSES}
    if isinstance(summary.get("counts"), dict) and summary["counts"] != counts:
        problems.append(f"counts {summary['counts']} do not match the parts {counts}")
    if isinstance(summary.get("ok"), bool) and summary["ok"] != (counts["fail"] == 0 and counts["pass"] > 0):
        problems.append("ok does not match the parts' statuses")
    if problems:
        raise ValueError("summary does not follow " + SCHEMA + ": " + "; ".join(problems))


def dry_run_listing(args: argparse.Namespace, num_gpus: int) -> str:
    """What a run with these arguments would do: parts, timeouts, trainer commands."""
    head = f"gpu_check dry run: {num_gpus} GPU(s), {'quick' if args.quick else 'full'} mode, out={args.out}"
    if num_gpus == 0:
        num_gpus = 1
        head += " -- no CUDA device here (a real run exits 2); listed as for 1 GPU, --gpus N lists for N"
    lines = [head]
    for part, skip in plan_parts(args.only, num_gpus):
        state = f"skip ({skip})" if skip else f"run, timeout {timeout_of(part, args.quick)} s"
        lines.append(f"- {part.name}: {part.what} [{state}]")
        cmds = [part_command(part, args.out, args.quick, max(num_gpus, 2), args.micro_batch)]
        if part.kind == "moe":
            runs = os.path.join(args.out, "runs")
            cmds = [
                trainer_command(1, moe_overrides(v, os.path.join(runs, f"moe_experts_{v}"), args.quick))
                for v in MOE_VARIANTS
            ]
        for cmd in cmds:
            if cmd is not None:
                lines.append("    $ " + shlex.join(["python" if c == sys.executable else c for c in cmd]))
    for name, what in DERIVED.items():
        lines.append(f"- {name} (from the parts above): {what}")
    lines.append("tolerances: " + json.dumps(TOLERANCES))
    return "\n".join(lines)


def _cuda_gpus(args: argparse.Namespace) -> int:
    """GPUs to use; exits 2 without CUDA or when ``--gpus`` asks for more than are visible."""
    import torch

    if not torch.cuda.is_available():
        print(
            f"gpu_check: no CUDA device here (torch {torch.__version__}, CUDA build: "
            f"{torch.version.cuda or 'none'}, "
            "torch.cuda.is_available() is False). This check needs an NVIDIA GPU; `--dry-run` lists what it "
            "would run. On CPU, float8 / MXFP8 linears and experts run emulated or with reference kernels "
            "(tests/trainer/test_float8*.py): that proves numerics, not speed.",
            file=sys.stderr,
        )
        sys.exit(2)
    visible = torch.cuda.device_count()
    if args.gpus is not None and args.gpus > visible:
        print(
            f"gpu_check: --gpus={args.gpus} but {visible} GPU(s) are visible; "
            f"pass --gpus {visible} or fewer.",
            file=sys.stderr,
        )
        sys.exit(2)
    return args.gpus or visible


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    if args.part is not None:
        args.gpus = args.gpus or 1
        return run_part_here(args)
    if args.dry_run:
        print(dry_run_listing(args, args.gpus if args.gpus is not None else _visible_gpus()))
        return 0
    args.gpus = _cuda_gpus(args)
    for sub in ("parts", "logs", "runs"):
        os.makedirs(os.path.join(args.out, sub), exist_ok=True)
    started, t0 = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), time.perf_counter()
    results: dict[str, dict[str, Any]] = {}
    for part, skip in plan_parts(args.only, args.gpus):
        if skip:
            results[part.name] = _result("skip", skip)
        else:
            results[part.name] = run_part_child(part, args)
        r = results[part.name]
        print(
            f"[gpu_check] {part.name}: {r['status']} ({r.get('wall_s', 0):.0f} s)"
            + (f" - {r['reason'].splitlines()[0]}" if r.get("reason") else ""),
            file=sys.stderr,
            flush=True,
        )
    summary = build_summary(
        results,
        quick=args.quick,
        out=args.out,
        gpus=args.gpus,
        started_utc=started,
        wall_s=time.perf_counter() - t0,
    )
    try:
        validate_summary(summary)
    except ValueError as e:  # still write what was measured
        print(f"[gpu_check] warning: {e}", file=sys.stderr)
    text = json.dumps(summary, indent=2)
    with open(os.path.join(args.out, "summary.json"), "w", encoding="utf-8") as f:
        f.write(text + "\n")
    print(text)
    return 0 if summary["ok"] else 1


def _visible_gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


if __name__ == "__main__":
    sys.exit(main())
