"""µP (maximal-update parametrisation, Tensor Programs V) for the Llama-style families: ``model.mup.*``.

Hyper-parameters tuned at the base width ``base_dim`` carry over to a model of width ``dim``: with the
width multiplier ``m = dim / base_dim`` (every hidden size -- heads x head size, the FFN -- is assumed to
grow with ``dim``), TP5's table 8 parametrisation for Adam, with multipliers:

=====================  ======================  =============================  ===================
parameters             initialisation          AdamW learning rate            forward
=====================  ======================  =============================  ===================
token embedding        N(0, 1) (unchanged)     ``optimizer.lr``               x ``input_mult``
hidden matrices        std ``init_std/sqrt(m)``  ``optimizer.lr / m``         --
(attention, FFN)       (depth scaling kept)
output head            std ``base_dim**-0.5``  ``optimizer.lr``               logits x ``output_mult / m``
                       (the base model's)
norm gains (vectors)   ones                    ``optimizer.lr``               --
attention logits       --                      --                             ``attn_mult * q.k / head_dim``
=====================  ======================  =============================  ===================

At ``dim == base_dim`` (m = 1) with the multipliers at 1 this is the standard parametrisation except
for the attention scale (1/head_dim for 1/sqrt(head_dim); TP5's choice, so that q.k, whose entries
become correlated during training, stays O(1) as the head grows). Tied embeddings are refused: the
embedding and the head have different µP rules. Weight decay stays AdamW's decoupled ``lr * wd``, so
it scales with each group's LR. Muon is refused (``trainer/config.py``): its orthogonalised update
already has a width-independent spectral size, with which µP's per-width LR of AdamW does not mix.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from models.errors import ConfigError

__all__ = ["MupArgs"]


@dataclass
class MupArgs:
    """``model.mup.*``: off by default; ``base_dim`` is the width the hyper-parameters were tuned at."""

    enable: bool = False
    base_dim: int = 256  # model.dim of the base (proxy) model whose LR and init were tuned
    input_mult: float = 1.0  # the embedding's output is multiplied by this
    output_mult: float = 1.0  # the logits are multiplied by output_mult * base_dim / dim
    attn_mult: float = 1.0  # attention logits attn_mult * q.k / head_dim

    def validate(self) -> None:
        """``ConfigError`` naming the bad value."""
        if isinstance(self.base_dim, bool) or not isinstance(self.base_dim, int) or self.base_dim <= 0:
            raise ConfigError(f"model.mup.base_dim={self.base_dim!r} must be a positive integer (a width).")
        for name in ("input_mult", "output_mult", "attn_mult"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ConfigError(f"model.mup.{name}={value!r} must be a finite number > 0.")

    def width_mult(self, dim: int) -> float:
        """``m = dim / base_dim``."""
        return dim / self.base_dim

    def hidden_lr_scale(self, dim: int) -> float:
        """The factor of ``optimizer.lr`` for the hidden matrices: ``base_dim / dim``."""
        return self.base_dim / dim

    def attention_scale(self, head_dim: int) -> float:
        """The factor applied to q so that SDPA's own 1/sqrt(head_dim) gives ``attn_mult / head_dim``."""
        return self.attn_mult / math.sqrt(head_dim)

    def logit_scale(self, dim: int) -> float:
        """The factor of the logits: ``output_mult * base_dim / dim``."""
        return self.output_mult * self.base_dim / dim
