"""Hugging Face adapter of the Qwen3 family (``Qwen3ForCausalLM``, model_type ``qwen3``).

Tensor names are Llama's plus the head norms::

    layers.{i}.attention.q_norm.weight   model.layers.{i}.self_attn.q_norm.weight   (head_dim,)
    layers.{i}.attention.k_norm.weight   model.layers.{i}.self_attn.k_norm.weight   (head_dim,)

``config.json`` carries ``head_dim`` explicitly; sliding-window attention (``use_sliding_window``
with sliding layers) and attention biases are refused on import: meshwright's attention is full
causal without biases.
"""

from __future__ import annotations

from typing import Any, Optional

from models.errors import ConfigError
from models.llama.hf import LLAMA_HF_LAYER_NAMES, LlamaHF
from models.qwen3.model import Qwen3Args

__all__ = ["QWEN3_HF_LAYER_NAMES", "Qwen3HF"]

QWEN3_HF_LAYER_NAMES = {
    **LLAMA_HF_LAYER_NAMES,
    "attention.q_norm": "self_attn.q_norm",
    "attention.k_norm": "self_attn.k_norm",
}


class Qwen3HF(LlamaHF):
    """Hugging Face ``Qwen3ForCausalLM`` <-> meshwright Qwen3 (config and tensor names)."""

    architecture = "Qwen3ForCausalLM"
    model_type = "qwen3"
    family = "qwen3"
    layer_names = QWEN3_HF_LAYER_NAMES

    def to_hf_config(
        self, args: Qwen3Args, *, bos_id: Optional[int], eos_id: Optional[int], dtype: str
    ) -> dict:
        """A ``Qwen3Config`` dict for ``args`` (full attention in every layer)."""
        cfg = super().to_hf_config(args, bos_id=bos_id, eos_id=eos_id, dtype=dtype)
        cfg.pop("mlp_bias")
        cfg.update(
            use_sliding_window=False,
            sliding_window=None,
            max_window_layers=args.n_layers,
            layer_types=["full_attention"] * args.n_layers,
        )
        return cfg

    def args_from_hf_config(self, cfg: dict[str, Any]) -> dict[str, Any]:
        """Our ``Qwen3Args`` fields from a Qwen3 ``config.json`` (refuses what we cannot represent)."""
        out = super().args_from_hf_config(cfg)  # model_type, biases, activation, shapes, RoPE
        sliding = [t for t in cfg.get("layer_types") or [] if t != "full_attention"]
        if cfg.get("use_sliding_window") and (sliding or not cfg.get("layer_types")):
            raise ConfigError(
                f"config.json has use_sliding_window=true (sliding_window={cfg.get('sliding_window')}); "
                "meshwright's attention is full causal, without a sliding window."
            )
        return {**out, "qk_norm": True}
