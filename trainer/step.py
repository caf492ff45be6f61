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
from typing import TYPE_CHECKING, Optional, Union

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.tensor import DeviceMesh, DTensor, Placement, Replicate, Shard
from torch.distributed.tensor.parallel import loss_parallel
from torch.utils.checkpoint import checkpoint

from models.common import IGNORE_INDEX

if TYPE_CHECKING:
    from trainer.data import DataLoader

__all__ = [
    "StepBatch",
    "StepContext",
    "StepState",
    "TokenLoss",
    "chunked_loss_sums",
    "document_positions",
    "log_z_squared_sum",
    "token_loss_sum",
]


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


def log_z_squared_sum(logits: Tensor, labels: Tensor) -> Tensor:
    """Sum over the target tokens of ``logsumexp(logits)**2`` (log Z squared, fp32) of (B, S, V)
    ``logits`` against (B, S) ``labels``: the z-loss's term (PaLM). Under loss parallel ``logits`` is a
    vocab-sharded DTensor; DTensor's reductions make the max and the sum of exponentials global (two
    all-reduces of (B, S) over the tensor-parallel axis, forward and backward), never the logits."""
    x = logits.float()  # (B, S, V)
    m = x.detach().amax(dim=-1, keepdim=True)  # the shift cancels in the gradient of log Z
    log_z = (x - m).exp().sum(dim=-1).log() + m.squeeze(-1)  # (B, S)
    if isinstance(log_z, DTensor):
        log_z = log_z.full_tensor()  # replicated over the vocabulary shards: a local read
    mask = (labels != IGNORE_INDEX).to(log_z.dtype)  # (B, S)
    return (log_z.square() * mask).sum()


def _chunk_sums(
    head: nn.Module,
    z_loss: bool,
    layout: Optional[tuple[DeviceMesh, tuple[Placement, ...]]],
    hidden: Tensor,
    labels: Tensor,
) -> Tensor:
    """(2,) cross-entropy sum and log-Z^2 sum (0 without z-loss) of one chunk of tokens; ``layout``:
    the DTensor layout the chunk of local ``hidden`` had (sequence parallelism)."""
    if layout is not None:
        hidden = DTensor.from_local(hidden, *layout)
    logits = head(hidden)  # (B, c, V); a vocab-sharded DTensor under loss parallel
    ce = token_loss_sum(logits, labels)
    z = log_z_squared_sum(logits, labels) if z_loss else torch.zeros_like(ce)
    return torch.stack([ce, z])


def chunked_loss_sums(
    head: nn.Module, hidden: Tensor, labels: Tensor, chunk_size: int, *, z_loss: bool
) -> Tensor:
    """(2,): the cross-entropy sum and the log-Z^2 sum of ``head(hidden)`` against (B, S) ``labels``,
    computed ``chunk_size`` positions of the sequence at a time (all B rows of a chunk together) so
    the (B, S, V) logits never exist: each chunk's logits live only inside a non-reentrant
    ``torch.utils.checkpoint`` (which keeps the chunk's input and labels, views of the whole) and are
    recomputed, chunk by chunk, in backward. Equal to ``token_loss_sum`` / ``log_z_squared_sum`` of
    the full logits up to the order of the fp32 sums.

    ``hidden`` (B, S, H) is the model's final hidden state (``OutputHead.deferred``). Under sequence
    parallelism it is a DTensor sharded on the sequence over n ranks: each rank takes ``chunk_size``
    positions of its own shard, and the column-parallel head all-gathers them (backward:
    reduce-scatters their gradient) as it does the whole, so the gathered chunk holds positions
    ``r * S/n + [start, start + chunk_size)`` of every rank r, and so do the chunk's labels; each
    chunk's logits are a vocab-sharded DTensor that torch's ``loss_parallel`` cross-entropy takes as
    it takes the whole. The communication is the unchunked head's, in chunks."""
    layout: Optional[tuple[DeviceMesh, tuple[Placement, ...]]] = None
    shards = 1
    if isinstance(hidden, DTensor):
        layout = (hidden.device_mesh, tuple(hidden.placements))
        for dim, placement in enumerate(hidden.placements):
            if isinstance(placement, Shard) and placement.dim in (1, -2):
                shards *= hidden.device_mesh.size(dim)
            elif not isinstance(placement, Replicate):
                raise ValueError(
                    f"the chunked loss takes a sequence-sharded or replicated input, not {placement}"
                )
        hidden = hidden.to_local()  # (B, S / shards, H)
    local_seq = hidden.shape[1]
    by_rank = labels.unflatten(1, (shards, local_seq))  # (B, shards, S / shards): each rank's positions
    sums = []
    for start in range(0, local_seq, chunk_size):
        h = hidden[:, start : start + chunk_size]
        y = by_rank[:, :, start : start + chunk_size].flatten(1)  # the gathered chunk's order
        if torch.is_grad_enabled():
            sums.append(checkpoint(_chunk_sums, head, z_loss, layout, h, y, use_reentrant=False))
        else:
            sums.append(_chunk_sums(head, z_loss, layout, h, y))
    return torch.stack(sums).sum(0)


@dataclass
class TokenLoss:
    """The training loss of every step (plain, pipelined, evaluation): ``token_loss_sum`` and, with
    ``z_loss_weight > 0`` while gradients are on, the z-loss ``weight * sum of log Z^2`` added to the
    gradient only: the returned value is the cross-entropy sum bitwise (``+ (z - z.detach())`` adds an
    exact 0), so the logged loss stays the cross-entropy; the z-loss sums are kept in ``z_sums`` for
    the step's ``z_loss`` record (``trainer/stability.ZLossStats``). The step normalises both by the
    global number of target tokens: the objective is CE mean + weight * mean log Z^2.

    With ``chunk_size > 0`` (``training.loss_chunk_size``) and ``head`` (this rank's deferred
    ``OutputHead``; None on a pipeline stage without it, which never computes the loss) the first
    argument is the final hidden state (B, S, H) and the loss runs the head chunk by chunk
    (:func:`chunked_loss_sums`): the same value and gradients up to the order of the fp32 sums."""

    z_loss_weight: float = 0.0
    z_sums: list[Tensor] = field(default_factory=list)  # this rank's weighted z-loss sums of the step
    chunk_size: int = 0  # tokens of the sequence per loss chunk (training.loss_chunk_size); 0 = off
    head: Optional[nn.Module] = None  # the deferred output head the chunked loss runs

    def __call__(self, logits: Tensor, labels: Tensor) -> Tensor:
        z_on = self.z_loss_weight != 0.0 and torch.is_grad_enabled()
        if self.chunk_size > 0:
            if self.head is None:
                raise RuntimeError("the chunked loss (training.loss_chunk_size) has no output head")
            ce, z_sum = chunked_loss_sums(self.head, logits, labels, self.chunk_size, z_loss=z_on)
            if not z_on:
                return ce
            z = self.z_loss_weight * z_sum
            self.z_sums.append(z.detach())
            return ce + (z - z.detach())
        loss = token_loss_sum(logits, labels)
        if not z_on:
            return loss
        z = self.z_loss_weight * log_z_squared_sum(logits, labels)
        self.z_sums.append(z.detach())
        return loss + (z - z.detach())


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


@dataclass
class StepBatch:
    """What one step feeds the model: token ids, labels, optional per-token positions, and the
    family's extra inputs (``ModelSpec.batch_inputs``: e.g. multi-token prediction's shifted ids
    and targets, (B, S, D)), built on the whole window before context parallelism splits it.

    Every model is called one way, for training, evaluation and pipeline stages alike:
    ``model(batch.inputs, **batch.model_kwargs())``."""

    inputs: Tensor  # (B, S)
    labels: Tensor  # (B, S)
    positions: Optional[Tensor] = None  # (B, S) or (S,); None = 0..S-1
    extras: dict[str, Tensor] = field(default_factory=dict)  # each (B, S, ...)

    def model_kwargs(self) -> dict[str, Tensor]:
        """The keyword arguments of the model call: ``positions`` (when given) and the extras."""
        kwargs = dict(self.extras)
        if self.positions is not None:
            kwargs["positions"] = self.positions
        return kwargs

    def chunk(self, n: int) -> list[StepBatch]:
        """``n`` microbatches along the batch dimension (gradient accumulation)."""
        inputs, labels = self.inputs.chunk(n), self.labels.chunk(n)
        positions = self.positions.chunk(n) if self.positions is not None else [None] * n
        extras = {k: v.chunk(n) for k, v in self.extras.items()}
        return [
            StepBatch(inputs[i], labels[i], positions[i], {k: v[i] for k, v in extras.items()})
            for i in range(n)
        ]


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
    loss: TokenLoss = field(default_factory=TokenLoss)  # the step's loss function (z-loss included)
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


@dataclass
class StepState:
    """What one training step knows, shared with its hooks (see the module docstring)."""

    step: int  # the step being taken (1-based)
    loader: DataLoader  # the training DataLoader (fault tolerance reads and moves its position)
    tokens_seen: int  # tokens trained on before this step
    num_tokens: Optional[torch.Tensor] = None  # target tokens of the step (count_tokens and later)
    replicas: int = 1  # replica groups whose gradients are averaged (fault tolerance)
    loss_sum: Optional[torch.Tensor] = None  # summed token loss (after_clip and later)
    grad_norm: Optional[torch.Tensor] = None  # pre-clip global gradient norm (after_clip and later)
    discard: bool = False  # set by a hook: the step is not applied (the trainer retries)
    # set with ``discard`` by spike skipping (trainer/stability.py): the step's figures; its batch is
    # consumed (not retried) and the record is logged as skipped
    skipped: Optional[dict[str, Union[float, int, str, bool]]] = None
