"""What the Trainer (and ``python -m trainer.evaluate``) calls: the tasks of ``eval.tasks``, read and
tokenized before any collective, scored on the running model every ``eval.freq`` steps."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor

from trainer.data.tokenizer import Tokenizer
from trainer.eval.scoring import score_requests, task_metrics
from trainer.eval.tasks import Request, Task, build_requests, load_task

if TYPE_CHECKING:
    from trainer.eval.config import EvalConfig

__all__ = ["TaskEvaluator", "TaskResult"]

logger = logging.getLogger("meshwright")


@dataclass
class TaskResult:
    metrics: dict[str, float]  # acc / acc_norm / acc_bytes or exact_match, and examples
    details: list[dict[str, Any]]  # per example: log-likelihoods, greedy flags, scores


class TaskEvaluator:
    """The tasks of one run and their token requests (the same on every rank)."""

    def __init__(
        self, cfg: EvalConfig, tokenizer: Tokenizer, *, max_seq_len: int, align: int, default_freq: int
    ) -> None:
        self.cfg = cfg
        self.freq = cfg.freq or default_freq
        self.align = align
        self.max_len = max(align, max_seq_len // align * align)
        self.pad_id = tokenizer.eos_id
        self.tasks: list[Task] = [load_task(spec, cfg.limit) for spec in cfg.tasks]
        self.requests: list[list[Request]] = [build_requests(t, tokenizer, self.max_len) for t in self.tasks]

    @classmethod
    def build(
        cls, cfg: EvalConfig, tokenizer: Tokenizer, *, max_seq_len: int, align: int, default_freq: int
    ) -> Optional[TaskEvaluator]:
        """None without tasks; raises ``ConfigError`` for a bad task file (before any collective)."""
        if not cfg.tasks:
            return None
        return cls(cfg, tokenizer, max_seq_len=max_seq_len, align=align, default_freq=default_freq)

    def due(self, step: int, last_step: int) -> bool:
        """Whether the tasks run after ``step`` (every ``freq`` steps and at the end of training)."""
        return step == last_step or (self.freq > 0 and step % self.freq == 0)

    def run(
        self,
        forward: Callable[[Tensor, Tensor], Tensor],
        *,
        dp_rank: int,
        dp_size: int,
        device: torch.device,
        reduce_group: Optional[dist.ProcessGroup],
    ) -> dict[str, TaskResult]:
        """Score every task on the running model; collective over every rank (see ``score_requests``)."""
        results: dict[str, TaskResult] = {}
        for task, requests in zip(self.tasks, self.requests):
            start = time.perf_counter()
            stats = score_requests(
                requests,
                forward,
                batch_size=self.cfg.batch_size,
                dp_rank=dp_rank,
                dp_size=dp_size,
                align=self.align,
                max_len=self.max_len,
                pad_id=self.pad_id,
                device=device,
                reduce_group=reduce_group,
            )
            metrics, details = task_metrics(task, requests, stats.cpu())
            results[task.name] = TaskResult(metrics, details)
            shown = "  ".join(f"{k} {v:.4f}" for k, v in metrics.items() if k != "examples")
            logger.info(
                f"task  {task.name}: {shown}  ({metrics['examples']} examples, {len(requests)} rows, "
                f"{time.perf_counter() - start:.2f}s)"
            )
        return results
