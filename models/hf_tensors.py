"""Hugging Face tensor names and state pieces every decoder family's adapter shares (its config
side is ``models/hf_config.py``).

HF's Llama names, which Llama, Qwen3 and the MoE family use for attention, norms and embeddings
(our attention uses HF's rotate_half RoPE layout, so q/k projections need no row permutation)::

    tok_embeddings.weight              model.embed_tokens.weight
    layers.{i}.attention.wq/wk/wv/wo   model.layers.{i}.self_attn.q_proj/k_proj/v_proj/o_proj
    layers.{i}.feed_forward.w1/w3/w2   model.layers.{i}.mlp.gate_proj/up_proj/down_proj
    layers.{i}.attention_norm          model.layers.{i}.input_layernorm
    layers.{i}.ffn_norm                model.layers.{i}.post_attention_layernorm
    norm.weight                        model.norm.weight
    output.weight                      lm_head.weight (absent when tie_word_embeddings)
"""

from __future__ import annotations

from torch import Tensor

from models.errors import ConfigError
from models.llama.model import LlamaArgs

__all__ = ["LLAMA_HF_LAYER_NAMES", "LLAMA_HF_TOP_NAMES", "finish_state_from_hf"]

LLAMA_HF_LAYER_NAMES = {  # our name in a block -> HF's (without .weight)
    "attention.wq": "self_attn.q_proj",
    "attention.wk": "self_attn.k_proj",
    "attention.wv": "self_attn.v_proj",
    "attention.wo": "self_attn.o_proj",
    "feed_forward.w1": "mlp.gate_proj",
    "feed_forward.w3": "mlp.up_proj",
    "feed_forward.w2": "mlp.down_proj",
    "attention_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
LLAMA_HF_TOP_NAMES = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def finish_state_from_hf(
    state: dict[str, Tensor], hf_state: dict[str, Tensor], used: set[str], args: LlamaArgs, fmt: str
) -> dict[str, Tensor]:
    """The end of a stacked-expert reader (MoE, DeepSeek-V3): every HF tensor was read (the rotary
    ``inv_freq`` buffers aside), else a ConfigError naming one; a tied head is the embedding."""
    extra = sorted(k for k in hf_state if k not in used and not k.endswith("rotary_emb.inv_freq"))
    if extra:
        raise ConfigError(
            f"Hugging Face state has tensor {extra[0]!r} ({len(extra)} in all) that a {fmt} model of this "
            "config.json lacks."
        )
    if args.tie_embeddings and "output.weight" not in state:
        state["output.weight"] = state["tok_embeddings.weight"]
    return state
