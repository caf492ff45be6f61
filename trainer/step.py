"""One step context and one loss, shared by the plain trainer step, the pipeline schedule and
evaluation.

- ``token_loss_sum(logits, labels)``: summed cross-entropy over the target tokens (labels equal
  to ``IGNORE_INDEX`` are skipped), a plain scalar also when the logits are a vocab-sharded
  DTensor (TP loss parallel). The step normalises it by the GLOBAL number of target tokens
  (``loss_scale``), so every layout trains on the single-process mean.
- ``StepContext``: everything a forward/backward must run inside -- autocast for bf16, torch's
  ``loss_parallel()`` for vocab-sharded logits -- and the slot where context parallelism
  shards each batch along the sequence (``shard_batch``) and enters its attention context.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from contextlib import AbstractContextManager as ContextManager
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from models.common import IGNORE_INDEX

__all__ = ["StepBatch", "StepContext", "document_positions", "mtp_targets", "token_loss_sum"]


def token_loss_sum(logits: Tensor, labels: Tensor) -> Tensor:
    """Sum of token cross-entropies of (B, S, V) ``logits`` against (B, S) ``labels`` in fp32.

    Under loss parallel ``logits`` is a DTensor sharded on the vocabulary and the call must run
    inside ``StepContext()`` (torch's ``loss_parallel()``); the result is then reduced to a plain
    tensor so callers never see a DTensor.
    """
    loss = F.cross_entropy(
        logits.flatten(0, 1).float(), labels.flatten(0, 1), ignore_index=IGNORE_INDEX, reduction="sum"
    )
    return loss.full_tensor() if isinstance(loss, DTensor) else loss


def count_targets(labels: Tensor) -> Tensor:
    """Number of target tokens (labels not ``IGNORE_INDEX``), as a tensor (no host sync)."""
    return (labels != IGNORE_INDEX).sum()


def document_positions(tokens: Tensor, bos_id: Optional[int], eos_id: Optional[int]) -> Tensor:
    """Per-token positions (B, S) that restart at 0 at every document start of packed ``tokens``.

    A document starts at a BOS token and right after an EOS token (the loader packs
    ``[bos] doc [eos] [bos] doc [eos] ...``, so the two coincide); the window's first token starts
    one too. A tokenizer whose BOS and EOS are one id starts documents at that id only. With
    ``model.attention_mask=block_causal`` these positions drive both RoPE and the
    document mask (``models/attention.py``: a document is the tokens sharing ``index - position``).
    """
    B, S = tokens.shape
    starts = torch.zeros_like(tokens, dtype=torch.bool)
    if bos_id is not None:
        starts |= tokens == bos_id
    if eos_id is not None and eos_id != bos_id:
        starts[:, 1:] |= tokens[:, :-1] == eos_id
    starts[:, 0] = True
    index = torch.arange(S, device=tokens.device).expand(B, S)
    # Index of the latest start at or before each token: a running max over the start indices.
    start_index = torch.where(starts, index, torch.zeros_like(index)).cummax(dim=1).values
    return index - start_index  # (B, S)


def mtp_targets(
    inputs: Tensor, labels: Tensor, depth: int, positions: Optional[Tensor] = None
) -> tuple[Tensor, Tensor]:
    """Multi-token-prediction inputs and targets of a whole (B, S) window, before any split along it.

    Returns (B, S, D) ids of token i+k and (B, S, D) targets ``labels[i+k]`` (token i+k+1) of
    position i for k = 1..D; a target is ``IGNORE_INDEX`` past the window's end, where the label
    is ignored (padding), and, with per-document ``positions`` (block-causal masking), when token
    i+k or token i+k+1 lies in another document than token i (the window's last label, whose
    token is outside the window, counts as in i's document, as for the next-token loss).
    Context parallelism then shards these like the labels, so each rank gets the tokens of other
    ranks' shards that its positions need.
    """
    B, S = inputs.shape
    index = torch.arange(S, device=inputs.device)
    ext_ids = torch.cat([inputs, inputs.new_zeros(B, depth)], dim=1)  # (B, S + D)
    ext_labels = torch.cat([labels, labels.new_full((B, depth), IGNORE_INDEX)], dim=1)
    ids = torch.stack([ext_ids[:, k : k + S] for k in range(1, depth + 1)], dim=-1)  # (B, S, D)
    targets = torch.stack([ext_labels[:, k : k + S] for k in range(1, depth + 1)], dim=-1)  # (B, S, D)
    if positions is not None:
        doc = (index - positions).expand(B, S)  # a document's first index, per token
        big = torch.iinfo(doc.dtype).max  # past the window: "unknown", never equal
        ext_doc = torch.cat([doc, doc.new_full((B, depth + 1), big)], dim=1)
        ext_doc[:, S] = doc[:, -1]  # token S (the last label) counts as in the last token's document
        for k in range(1, depth + 1):
            same = (ext_doc[:, k : k + S] == doc) & (ext_doc[:, k + 1 : k + 1 + S] == doc)
            targets[..., k - 1] = targets[..., k - 1].masked_fill(~same, IGNORE_INDEX)
    return ids, targets


@dataclass
class StepBatch:
    """What one step feeds the model: token ids, labels and optional per-token positions, plus the
    multi-token-prediction inputs and targets (``mtp_targets``) for models with MTP modules."""

    inputs: Tensor  # (B, S)
    labels: Tensor  # (B, S)
    positions: Optional[Tensor] = None  # (B, S) or (S,); None = 0..S-1
    mtp_inputs: Optional[Tensor] = None  # (B, S, D)
    mtp_labels: Optional[Tensor] = None  # (B, S, D)


@dataclass
class StepContext:
    """The context every training/evaluation forward and backward runs in.

    ``StepContext()`` (call) enters autocast and loss parallel as configured, plus any
    ``extra`` context (context parallel's attention dispatch). ``shard_batch`` is the hook
    context parallel fills to split each batch along the sequence; by default it is the
    identity.
    """

    device_type: str = "cpu"
    autocast_dtype: Optional[torch.dtype] = None
    loss_parallel: bool = False
    extra: list[Callable[[], ContextManager]] = field(default_factory=list)
    batch_sharder: Optional[Callable[[StepBatch], StepBatch]] = None

    def __call__(self) -> contextlib.ExitStack:
        stack = contextlib.ExitStack()
        if self.loss_parallel:  # cross-entropy on vocab-sharded logits, forward and backward
            stack.enter_context(loss_parallel())
        if self.autocast_dtype is not None:
            stack.enter_context(torch.autocast(self.device_type, dtype=self.autocast_dtype))
        for make in self.extra:
            stack.enter_context(make())
        return stack

    def shard_batch(self, batch: StepBatch) -> StepBatch:
        """This rank's part of ``batch`` (context parallel splits the sequence); identity by default."""
        return self.batch_sharder(batch) if self.batch_sharder is not None else batch
