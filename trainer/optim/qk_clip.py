"""QK-clip (MuonClip, Kimi K2): keep every attention head's largest pre-softmax logit at or below tau.

The model side (``models/llama/model.py`` ``Attention``, also used by the MoE family) only records,
when asked, the per-local-head max logit of each forward. This file adds what needs the layout, as a
step hook (``trainer/hooks.py``; it acts after any optimizer's step, with either optimizer):

* ``begin_step`` turns recording on and resets the maxima;
* ``after_optimizer_step`` (:meth:`QKClip.clip`) places each rank's per-local-head maxima into one
  ``(layers, heads)`` table (under TP a rank's heads are its ``tp`` coordinate's slice; a PP stage
  fills its own layers), takes the MAX over the world group (dp, cp, tp, pp at once: one
  all-reduce of layers x heads floats), and for every head with ``max > tau`` scales its query
  and key projection rows so the head's logits shrink by ``gamma = tau / max``: MHA: q and k
  rows by ``sqrt(gamma)`` each; GQA: the shared key head by ``sqrt(min gamma of its query
  heads)``, each query head by the rest, so every query head's logits scale by its own gamma.
  The rows are found from each weight's own layout (plain, FSDP / TP DTensor shards:
  ``parallelisms.utils.local_positions``);
* ``metrics`` gives the step's ``qk_max_logit`` (before clipping) and ``qk_clipped_heads``.

A module takes part if it has ``record_max_logit``, ``max_logit``, ``head_dim``, ``wq`` and ``wk``
(Llama/MoE attention). DeepSeek's MLA (other projections, only the non-RoPE parts clipped) needs
its own ``scale_heads``: the seam is :meth:`QKClip.scale_heads`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Optional, Protocol, cast

import torch
import torch.distributed as dist
from torch import Tensor, nn

from models.common import unwrapped_name
from models.spec import decoder_args
from parallelisms.utils import local_positions

if TYPE_CHECKING:
    from models.spec import ModelSpec
    from parallelisms.parallel_dims import ParallelDims
    from trainer.config import TrainConfig
    from trainer.step import StepState


class ClippedAttention(Protocol):
    """What QK-clip uses of an attention module (see the module docstring)."""

    record_max_logit: bool  # when set, the forward keeps the running max logit of each local head
    max_logit: Optional[Tensor]  # (local heads,) fp32
    head_dim: int
    wq: nn.Linear
    wk: nn.Linear


class QKClip:
    """Args: ``attentions``: (global layer index, attention module) of this rank; ``num_layers``,
    ``n_heads``, ``n_kv_heads``: of the whole model; ``tau``: the logit cap; ``tp_rank`` /
    ``tp_size``: this rank's tensor-parallel coordinate (its query heads are that slice)."""

    def __init__(
        self,
        attentions: Sequence[tuple[int, ClippedAttention]],
        *,
        num_layers: int,
        n_heads: int,
        n_kv_heads: int,
        tau: float,
        tp_rank: int = 0,
        tp_size: int = 1,
    ) -> None:
        self.attentions, self.num_layers, self.tau = attentions, num_layers, tau
        self.n_heads, self.n_kv_heads = n_heads, n_kv_heads
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self._rows: dict[int, Tensor] = {}  # id(weight) -> global row of each local element
        self.last_max: Optional[Tensor] = None  # (layers, heads): the step's measured maxima
        self.last_stats: dict[str, float] = {}  # the last step's qk_max_logit and qk_clipped_heads

    def begin_step(self, state: StepState) -> None:
        """Hook point: the attentions record (afresh) their per-head max logits of this step."""
        for _, attn in self.attentions:
            attn.record_max_logit, attn.max_logit = True, None

    @torch.no_grad()
    def measured_max(self) -> Tensor:
        """(layers, heads) max logits of this step over the whole world (collective)."""
        device = next(iter(self.attentions))[1].wq.weight.device if self.attentions else torch.device("cpu")
        table = torch.full((self.num_layers, self.n_heads), float("-inf"), device=_local_device(device))
        local_heads = self.n_heads // self.tp_size
        for layer, attn in self.attentions:
            attn.record_max_logit = False
            if attn.max_logit is not None:
                start = self.tp_rank * local_heads
                table[layer, start : start + local_heads] = attn.max_logit.to(table.device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(table, op=dist.ReduceOp.MAX)
        self.last_max = table
        return table

    def after_optimizer_step(self, state: StepState) -> None:
        """Hook point: measure and clip (:meth:`clip`), keeping the step's statistics for :meth:`metrics`."""
        self.last_stats = self.clip()

    def metrics(self, state: StepState, device: torch.device) -> dict[str, float]:
        """The last step's ``qk_max_logit`` (before clipping) and ``qk_clipped_heads`` (no collective:
        :meth:`clip` reduced them over the world)."""
        return dict(self.last_stats)

    @torch.no_grad()
    def clip(self) -> dict[str, float]:
        """Measure (all-reduce) and clip; returns the step's ``qk_max_logit`` and ``qk_clipped_heads``."""
        table = self.measured_max()
        gamma = torch.where(table > self.tau, self.tau / table, torch.ones_like(table))  # (layers, heads)
        for layer, attn in self.attentions:
            if bool((gamma[layer] < 1).any()):
                self.scale_heads(attn, gamma[layer])
        return {"qk_max_logit": float(table.max()), "qk_clipped_heads": int((gamma < 1).sum())}

    def scale_heads(self, attn: ClippedAttention, gamma: Tensor) -> None:
        """Scale ``attn``'s q and k rows so query head h's logits scale by ``gamma[h]`` (heads,)."""
        n_rep = self.n_heads // self.n_kv_heads
        kv_gamma = gamma.view(self.n_kv_heads, n_rep).amin(dim=1)  # (n_kv,)
        k_scale = kv_gamma.sqrt()
        q_scale = gamma / k_scale.repeat_interleave(n_rep)  # (heads,)
        self._scale_rows(attn.wq.weight, q_scale, attn.head_dim)
        self._scale_rows(attn.wk.weight, k_scale, attn.head_dim)

    def _scale_rows(self, weight: Tensor, head_scale: Tensor, head_dim: int) -> None:
        local = weight.to_local() if hasattr(weight, "to_local") else weight
        rows = self._global_rows(weight)
        factor = head_scale.to(local.device, local.dtype)[rows.to(local.device) // head_dim]
        local.view(-1).mul_(factor)

    def _global_rows(self, weight: Tensor) -> Tensor:
        key = id(weight)
        if key not in self._rows:
            pos = local_positions(weight)
            idx = torch.arange(pos.start, pos.stop) if isinstance(pos, slice) else pos
            self._rows[key] = idx // weight.shape[1]
        return self._rows[key]


def _local_device(device: torch.device) -> torch.device:
    return device if device.type != "meta" else torch.device("cpu")


def build_qk_clip(
    parts: list[nn.Module], spec: ModelSpec, cfg: TrainConfig, dims: ParallelDims
) -> Optional[QKClip]:
    """QK-clip over this rank's attention modules (those of ``spec.blocks`` with
    ``record_max_logit``), or None when ``optimizer.qk_clip_tau`` is 0."""
    tau = cfg.optimizer.qk_clip_tau
    if tau <= 0:
        return None
    prefix = f"{spec.blocks}."
    attentions: list[tuple[int, ClippedAttention]] = []
    for part in parts:
        for name, module in part.named_modules():
            name = unwrapped_name(name)
            if hasattr(module, "record_max_logit") and name.startswith(prefix):
                layer = int(name[len(prefix) :].split(".", 1)[0])
                attentions.append((layer, cast(ClippedAttention, module)))  # a Llama-style attention
    tp_rank = dims.get_mesh("tp").get_local_rank() if dims.tp > 1 else 0
    args = decoder_args(cfg.model)
    return QKClip(
        attentions,
        num_layers=args.n_layers,
        n_heads=args.n_heads,
        n_kv_heads=args.kv_heads,
        tau=tau,
        tp_rank=tp_rank,
        tp_size=dims.tp,
    )
