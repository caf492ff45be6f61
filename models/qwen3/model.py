"""Qwen3 dense decoder (Qwen3-0.6B ... 32B), free of any parallelism.

Qwen3 is the Llama decoder (``models/llama/model.py``: pre-norm blocks, SwiGLU, RoPE in the
rotate_half layout, grouped-query attention) with three differences, all features of the shared
``Attention`` / ``LlamaArgs`` rather than new modules:

* q/k norm: an RMSNorm (gain of size head_dim, shared by the heads) over each query and key head,
  after the projections and BEFORE RoPE, as in transformers' ``Qwen3Attention``
  (``layers.{i}.attention.{q_norm,k_norm}.weight``);
* an explicit head size (``attn_head_dim``, 128 in every published size), independent of
  dim / n_heads (Qwen3-0.6B: 16 heads x 128 = 2048 > dim 1024);
* RoPE base 1e6 and, for the small sizes, the output head tied to the embedding.

The module tree is Llama's, so the TP plan, pipeline splitting, FSDP units, context parallel and
the KV-cache generation apply unchanged; what the family adds is its name, its defaults, the
check that q/k norm is on, and the Hugging Face format (``models/qwen3/hf.py``: Qwen3ForCausalLM).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from models.errors import ConfigError
from models.llama.model import LlamaArgs

__all__ = ["Qwen3Args"]


@dataclass
class Qwen3Args(LlamaArgs):
    """A Llama decoder with Qwen3's q/k head norms, explicit head size and RoPE base."""

    family: str = "qwen3"
    attn_head_dim: Optional[int] = 128  # explicit head size; null = dim / n_heads
    qk_norm: bool = True  # always on in Qwen3 (the HF architecture has no switch)
    norm_eps: float = 1e-6
    rope_theta: float = 1000000.0

    def validate(self) -> None:
        """Llama's checks, and q/k norm on (``ConfigError`` naming the fix otherwise)."""
        if self.qk_norm is not True:
            raise ConfigError(
                f"model.qk_norm={self.qk_norm!r}: every Qwen3 model normalises its q/k heads "
                "(Qwen3ForCausalLM has no switch); set model.qk_norm=true, or use model.family=llama for "
                "attention without it."
            )
        super().validate()
