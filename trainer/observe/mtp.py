"""Multi-token prediction (MTP) per step: the weight of its gradient and its logged loss.

A model with ``ModelSpec.mtp_depth(args) > 0`` (DeepSeek-V3) adds its MTP loss to backward itself
(the reported ``loss`` stays next-token) and records each forward's (D,) MTP losses in
``mtp_records`` ((D, 2): summed cross-entropy and target count per depth). This hook gives it the
per-token weight that makes the step's objective ``LM mean + mtp_loss_weight / D * summed MTP
cross-entropy / tokens per step`` under any data/context parallelism (``mtp_grad_scale = dp_cp /
tokens per step``, as the MoE auxiliary loss) and the loss function that also reduces vocab-sharded
logits (``token_loss_sum``, tensor parallel), and logs ``mtp_loss``: the mean over depths of the
MTP cross-entropy per target, over microbatches and data/context-parallel ranks.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Optional, cast

import torch
import torch.distributed as dist
from torch import Tensor, nn

from models.spec import ModelArgs, ModelSpec, MTPModel
from parallelisms.parallel_dims import ParallelDims
from trainer.step import StepState, TokenLoss, token_loss_sum

__all__ = ["MTPStats"]


class MTPStats:
    """A step hook (``trainer/hooks.py``): ``begin_step`` before the first forward of a step; ``metrics``
    on logging steps (collective over dp x cp)."""

    def __init__(
        self,
        parts: Sequence[MTPModel],
        dims: ParallelDims,
        *,
        tokens_per_step: int,
        loss: Optional[TokenLoss] = None,
    ) -> None:
        self.parts = parts
        # the MTP heads' cross-entropy: chunked like the step's loss under training.loss_chunk_size (the
        # model then hands the MTP loss the normed hidden state), never with the z-loss
        self.loss_fn: Callable[[Tensor, Tensor], Tensor] = (
            TokenLoss(chunk_size=loss.chunk_size, head=loss.head)
            if loss is not None and loss.chunk_size > 0
            else token_loss_sum
        )
        self.grad_scale = dims.dp_cp / tokens_per_step
        self.group = dims.loss_mesh.get_group() if dims.dp_cp > 1 else None
        self.dp_cp = dims.dp_cp

    @classmethod
    def build(
        cls,
        parts: list[nn.Module],
        spec: ModelSpec,
        args: ModelArgs,
        dims: ParallelDims,
        *,
        tokens_per_step: int,
        loss: Optional[TokenLoss] = None,
    ) -> Optional[MTPStats]:
        """A hook for models with MTP modules, None otherwise."""
        if spec.mtp_depth(args) < 1:
            return None
        # every part (a stage too, with or without the MTP modules) is the family's MTP model class
        return cls([cast(MTPModel, part) for part in parts], dims, tokens_per_step=tokens_per_step, loss=loss)

    def begin_step(self, _state: StepState) -> None:
        for part in self.parts:
            part.reset_mtp_stats()
            part.mtp_grad_scale = self.grad_scale
            part.mtp_loss_fn = self.loss_fn

    @torch.no_grad()
    def metrics(self, _state: StepState, device: torch.device) -> dict[str, Any]:
        records = [r for part in self.parts for r in part.mtp_records]
        if not records:  # e.g. a pipeline stage without the MTP modules
            return {}
        total = torch.stack(records).sum(0).to(device, torch.float32)  # (D, 2): loss sum, targets
        if self.group is not None:
            dist.all_reduce(total, group=self.group)
        return {"mtp_loss": (total[:, 0] / total[:, 1].clamp(min=1)).mean().item()}
