"""Batched scoring of task requests on the running (possibly sharded) model, and the task metrics.

Every rank takes part, as in the validation pass: the requests (sorted by length, longest first,
so a batch wastes little padding) are cut into global batches of ``batch_size`` rows per
data-parallel rank; every rank runs the same number of forwards (FSDP gathers, expert-parallel
all-to-alls and pipeline sends stay in step), a rank without requests left runs a padding row.
A batch is right-padded to its longest row, rounded up to ``align`` (what context and sequence
parallelism need to split the sequence). ``forward(inputs, labels) -> (B, 3)`` is the trainer's:
it runs the model as the step does (context-parallel shards, the pipeline's stages, vocab-sharded
logits) and returns, per row, this rank's share of ``ROW_STATS``; the shares are summed over the
data- and context-parallel ranks into one (num_requests, 3) table, the same on every rank. No
weight is gathered: only logits of the scored positions and three numbers per row move.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor, Shard

from models.common import IGNORE_INDEX
from trainer.eval.tasks import Request, Task

__all__ = ["ROW_STATS", "row_stats", "score_requests", "task_metrics"]

ROW_STATS = (
    "loglik",
    "mismatches",
    "num_targets",
)  # per row: summed target log-prob, non-argmax targets, targets


def row_stats(logits: Tensor, labels: Tensor) -> Tensor:
    """(B, 3) ``ROW_STATS`` of (B, S, V) ``logits`` against (B, S) ``labels`` (``IGNORE_INDEX``: not
    scored), in fp32. Vocab-sharded (loss-parallel) logits are gathered for the scored positions."""
    mask = labels != IGNORE_INDEX  # (B, S)
    rows = mask.nonzero()[:, 0]  # (T,) row of every scored position
    picked = _scored_logits(logits, mask).float()  # (T, V)
    targets = labels[mask]  # (T,)
    token_ll = torch.log_softmax(picked, dim=-1).gather(1, targets[:, None])[:, 0]  # (T,)
    mismatch = (picked.argmax(dim=-1) != targets).float()  # (T,)
    out = torch.zeros(labels.shape[0], len(ROW_STATS), dtype=torch.float32, device=logits.device)
    out[:, 0].index_add_(0, rows, token_ll)
    out[:, 1].index_add_(0, rows, mismatch)
    out[:, 2].index_add_(0, rows, torch.ones_like(token_ll))
    return out


def _scored_logits(logits: Tensor, mask: Tensor) -> Tensor:
    """(T, V) full-vocabulary logits of the scored positions. Vocab-sharded logits (TP loss
    parallel) are cut to those positions on each rank before the shards are gathered."""
    if not isinstance(logits, DTensor):
        return logits[mask]
    if all(isinstance(p, Shard) and p.dim in (-1, logits.dim() - 1) for p in logits.placements):
        local = logits.to_local()[mask]  # (T, V / tp): every tp rank holds the same rows
        return DTensor.from_local(
            local, logits.device_mesh, [Shard(1)] * len(logits.placements)
        ).full_tensor()
    return logits.full_tensor()[mask]


def _round_up(n: int, align: int) -> int:
    return -(-n // align) * align


def _batch(
    requests: list[Request], length: int, rows: int, pad_id: int, device: torch.device
) -> tuple[Tensor, Tensor]:
    """(inputs, labels) of shape (rows, length): each request right-padded; missing rows are padding."""
    inputs = torch.full((rows, length), pad_id, dtype=torch.long)
    labels = torch.full((rows, length), IGNORE_INDEX, dtype=torch.long)
    for r, req in enumerate(requests):
        n = len(req.tokens) - 1
        inputs[r, :n] = torch.tensor(req.tokens[:-1])
        labels[r, n - req.num_targets : n] = torch.tensor(req.tokens[-req.num_targets :])
    return inputs.to(device), labels.to(device)


@torch.no_grad()
def score_requests(
    requests: list[Request],
    forward: Callable[[Tensor, Tensor], Tensor],
    *,
    batch_size: int,
    dp_rank: int,
    dp_size: int,
    align: int,
    max_len: int,
    pad_id: int,
    device: torch.device,
    reduce_group: Optional[dist.ProcessGroup] = None,
) -> Tensor:
    """(len(requests), 3) ``ROW_STATS`` of every request (float64, identical on every rank).

    ``reduce_group`` sums the per-rank shares (data-parallel ranks score disjoint rows; context-
    parallel ranks hold parts of the same rows); None when this is the only rank that scores.
    """
    order = sorted(range(len(requests)), key=lambda i: (-len(requests[i].tokens), i))
    per_global = batch_size * dp_size
    stats = torch.zeros(len(requests), len(ROW_STATS), dtype=torch.float64, device=device)
    for start in range(0, len(order), per_global):
        chunk = order[start : start + per_global]
        # The same length on every rank of the global batch (a cp group must agree on it).
        longest = max(len(requests[i].tokens) - 1 for i in chunk)
        length = min(_round_up(longest, align), max_len)  # max_len: a multiple of align
        mine = chunk[dp_rank * batch_size : (dp_rank + 1) * batch_size]
        inputs, labels = _batch([requests[i] for i in mine], length, batch_size, pad_id, device)
        out = forward(inputs, labels)  # (batch_size, 3): this rank's share
        if mine:
            stats[torch.tensor(mine, device=device)] += out[: len(mine)].double()
    if reduce_group is not None:
        dist.all_reduce(stats, group=reduce_group)
    return stats


def task_metrics(task: Task, requests: list[Request], stats: Tensor) -> tuple[dict[str, float], list[dict]]:
    """(metrics, per-example details) of ``task`` from its requests' ``ROW_STATS``.

    Multiple choice: ``acc``, ``acc_norm`` (per character of the choice), ``acc_bytes`` (per UTF-8
    byte), as lm-evaluation-harness (ties go to the first choice, as ``np.argmax``); generation:
    ``exact_match``. Details: per example its log-likelihoods (or greedy match) for comparisons.
    """
    per_example: dict[int, list[tuple[float, bool]]] = {}
    for req, row in zip(requests, stats.tolist()):
        per_example.setdefault(req.example, []).append((row[0], row[1] == 0))
    sums: dict[str, float] = {}
    counts: dict[str, int] = {}  # a file may mix both kinds: each metric averages its own examples
    details: list[dict] = []
    for i, ex in enumerate(task.examples):
        scored = per_example[i]
        lls = [ll for ll, _ in scored]
        if ex.is_choice:
            assert ex.choices is not None and ex.gold is not None  # is_choice
            chars = [ll / len(c) for ll, c in zip(lls, ex.choices)]
            nbytes = [ll / len(c.encode("utf-8")) for ll, c in zip(lls, ex.choices)]
            result = {
                "acc": float(_argmax(lls) == ex.gold),
                "acc_norm": float(_argmax(chars) == ex.gold),
                "acc_bytes": float(_argmax(nbytes) == ex.gold),
            }
            details.append({"loglikelihoods": lls, "is_greedy": [g for _, g in scored], **result})
        else:
            result = {"exact_match": float(scored[0][1])}
            details.append({"loglikelihood": lls[0], **result})
        for key, value in result.items():
            sums[key] = sums.get(key, 0.0) + value
            counts[key] = counts.get(key, 0) + 1
    metrics: dict[str, float] = {key: sums[key] / counts[key] for key in sums}
    metrics["examples"] = len(task.examples)
    return metrics, details


def _argmax(values: list[float]) -> int:
    """Index of the first largest value (``np.argmax``'s tie rule)."""
    return max(range(len(values)), key=values.__getitem__)
