"""Step metrics to stdout, ``metrics.jsonl`` and the trackers (TensorBoard, W&B); rank 0 writes.

After a resume from step K the records of later steps (written by the interrupted attempt)
are dropped from ``metrics.jsonl`` and superseded in the trackers (``trainer/observe/trackers.py``), so
each step appears once.
"""

from __future__ import annotations

import json
import logging
import os
import resource
import sys
import time
from typing import Any, Optional

import torch

from trainer.config import MetricsConfig
from trainer.observe.trackers import Tracker, build_trackers, truncate_jsonl

logger = logging.getLogger("meshwright")

# Dense bf16 peak FLOP/s per device (vendor datasheets, without sparsity). MFU is
# reported against this peak whatever the run's dtype (the torchtitan convention).
_PEAK_BF16_FLOPS = {
    "H200": 989.5e12,
    "H100 NVL": 835e12,
    "H100 PCIe": 756e12,
    "H100": 989.5e12,
    "H800": 989.5e12,
    "B200": 2250e12,
    "GB200": 2500e12,
    "A100": 312e12,
    "A800": 312e12,
    "L40S": 362e12,
    "L4": 121e12,
    "A10G": 70e12,
    "RTX 4090": 165e12,
}


def device_peak_flops(device: torch.device) -> Optional[float]:
    """Peak bf16 FLOP/s of ``device``, or None when unknown (e.g. CPUs)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, flops in _PEAK_BF16_FLOPS.items():  # ordered: specific names first
        if key in name:
            return flops
    return None


def memory_gib(device: torch.device) -> float:
    """Peak memory since the last call: CUDA allocator peak, or the process's peak RSS on CPU."""
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        return peak / 2**30
    # ru_maxrss is KiB on Linux (bytes on macOS)
    scale = 1 if sys.platform == "darwin" else 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale / 2**30


def setup_logging(rank: int) -> None:
    """Plain stdout logging; ranks other than 0 only report warnings and errors."""
    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        format=f"[rank{rank}] %(asctime)s %(message)s",
        datefmt="%H:%M:%S",
        stream=sys.stdout,
        force=True,
    )


class MetricsLogger:
    """Formats and writes step metrics; only the writer rank touches files."""

    def __init__(
        self,
        dump_folder: str,
        cfg: MetricsConfig,
        *,
        is_writer: bool,
        device: torch.device,
        flops_per_token: int,
        tokens_per_step: int,
        world_size: int,
        total_steps: int,
        resume_step: int = 0,
        run_name: str = "run",
    ) -> None:
        self.cfg = cfg
        self.is_writer = is_writer
        self.device = device
        self.flops_per_token = flops_per_token
        self.tokens_per_step = tokens_per_step
        self.world_size = world_size
        self.total_steps = total_steps
        self.peak_flops = device_peak_flops(device)
        self._jsonl = None
        self._trackers: list[Tracker] = []
        if is_writer and cfg.jsonl:
            path = os.path.join(dump_folder, "metrics.jsonl")
            dropped = truncate_jsonl(path, resume_step)
            if dropped:
                logger.info(
                    f"metrics.jsonl: dropped {dropped} records after step {resume_step} (resumed from it)"
                )
            self._jsonl = open(path, "a", encoding="utf-8")  # noqa: SIM115
        if is_writer:
            self._trackers = build_trackers(cfg, dump_folder, resume_step, run_name)
        self._last_time = time.perf_counter()
        self._last_step: Optional[int] = None

    def reset_timer(self, step: int) -> None:
        """Start the throughput window at ``step`` (after setup or a resume)."""
        self._last_time = time.perf_counter()
        self._last_step = step

    def log_step(
        self, step: int, loss: float, grad_norm: float, lr: float, extra: Optional[dict[str, Any]] = None
    ) -> dict[str, Any]:
        """Log one training step's metrics; throughput is averaged since the previous call.

        ``extra`` (the loader's ``data_wait_s``; the MoE statistics ``aux_loss``,
        ``moe_imbalance_max/mean``, per-layer ``moe_imbalance`` and ``moe_tokens_per_expert``) is
        merged into the record; nested values become ``key/sub/...`` tracker scalars."""
        now = time.perf_counter()
        steps = step - (self._last_step if self._last_step is not None else step - 1)
        elapsed = max(now - self._last_time, 1e-9)
        self._last_time, self._last_step = now, step
        tokens_per_sec = self.tokens_per_step * steps / elapsed / self.world_size  # per device
        tflops = self.flops_per_token * tokens_per_sec / 1e12
        mfu = None if self.peak_flops is None else 100.0 * tflops * 1e12 / self.peak_flops
        eta_s = elapsed / steps * (self.total_steps - step)
        record = {
            "step": step,
            "loss": loss,
            "grad_norm": grad_norm,
            "lr": lr,
            "tokens_per_sec": tokens_per_sec,
            "tflops": tflops,
            "mfu": mfu,
            "memory_gib": memory_gib(self.device),
            "step_time_s": elapsed / steps,
            "eta_s": eta_s,
            **(extra or {}),
        }
        mfu_str = "n/a" if mfu is None else f"{mfu:.1f}%"
        logger.info(
            f"step {step:>6}/{self.total_steps}  loss {loss:8.4f}  grad_norm {grad_norm:8.4f}  lr {lr:.3e}  "
            f"tok/s/dev {tokens_per_sec:9.0f}  TFLOP/s {tflops:7.3f}  MFU {mfu_str}  "
            f"mem {record['memory_gib']:.2f} GiB  eta {_fmt_time(eta_s)}"
        )
        if "moe_imbalance_max" in record:
            aux = record.get("aux_loss")
            logger.info(
                f"moe    {step:>6}  aux_loss {'n/a' if aux is None else f'{aux:.5f}'}  load imbalance "
                "max/mean "
                f"{record['moe_imbalance_max']:.2f} (worst layer), {record['moe_imbalance_mean']:.2f} (layer "
                "mean)"
            )
            for layer, counts in record.get("moe_tokens_per_expert", {}).items():
                shown = counts if len(counts) <= 16 else f"{counts[:16]} ... ({len(counts)} experts)"
                logger.info(f"moe    {step:>6}  {layer} tokens per expert {shown}")
        self._write(record, step)
        return record

    def log_eval(self, step: int, loss: float, num_tokens: int) -> dict[str, Any]:
        """Log an evaluation on the validation split."""
        import math

        record = {
            "step": step,
            "eval_loss": loss,
            "eval_perplexity": math.exp(min(loss, 50.0)),
            "eval_tokens": num_tokens,
        }
        logger.info(f"eval  step {step:>6}  loss {loss:8.4f}  ppl {record['eval_perplexity']:.2f}")
        self._write(record, step)
        return record

    def log_validation(self, step: int, sets: dict[str, tuple[float, int]]) -> dict[str, Any]:
        """Log the named validation sets (``eval.validation``):
        ``validation/<name>/{loss,perplexity,tokens}``."""
        import math

        values = {
            name: {"loss": loss, "perplexity": math.exp(min(loss, 50.0)), "tokens": tokens}
            for name, (loss, tokens) in sets.items()
        }
        for name, v in values.items():
            logger.info(f"eval  step {step:>6}  {name}: loss {v['loss']:8.4f}  ppl {v['perplexity']:.2f}")
        record = {"step": step, "validation": values}
        self._write(record, step)
        return record

    def log_tasks(self, step: int, tasks: dict[str, dict[str, float]], seconds: float) -> dict[str, Any]:
        """Log downstream task scores (``eval.tasks``): ``tasks/<name>/<metric>`` in the trackers."""
        record = {"step": step, "tasks": tasks, "tasks_time_s": seconds}
        self._write(record, step)
        return record

    def write(self, record: dict[str, object], step: int) -> None:
        """Write a record of the caller's own (a skipped step's figures) as it is."""
        self._write(record, step)

    def write_header(self, step: int, entries: dict[str, object]) -> None:
        """A run-description record (``{"step": step, "header": entries}``, e.g. the float8 linears) in
        ``metrics.jsonl`` only, at the start of a run (``step``: the resumed step, so a resume keeps it)."""
        if self._jsonl is not None:
            self._jsonl.write(json.dumps({"step": step, "header": entries}) + "\n")
            self._jsonl.flush()

    def _write(self, record: dict[str, Any], step: int) -> None:
        if self._jsonl is not None:
            self._jsonl.write(json.dumps(record) + "\n")
            self._jsonl.flush()
        for tracker in self._trackers:
            tracker.log(record, step)

    def close(self) -> None:
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None
        trackers, self._trackers = self._trackers, []
        for tracker in trackers:
            tracker.close()


def _fmt_time(seconds: float) -> str:
    seconds = int(max(seconds, 0))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h:d}:{m:02d}:{s:02d}"
