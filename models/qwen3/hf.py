"""Hugging Face adapter of the Qwen3 family (``Qwen3ForCausalLM``, model_type ``qwen3``).

Tensor names are Llama's plus the head norms::

    layers.{i}.attention.q_norm.weight   model.layers.{i}.self_attn.q_norm.weight   (head_dim,)
    layers.{i}.attention.k_norm.weight   model.layers.{i}.self_attn.k_norm.weight   (head_dim,)

``config.json`` carries ``head_dim`` explicitly; the shared reader (``models/hf_config.py``) refuses
a sliding window (``use_sliding_window`` with sliding layers) and attention biases: meshwright's
attention is full causal without biases.
"""

from __future__ import annotations

from models.hf_config import DECODER_ROWS, FFN_ROW, GQA_ROWS, Derived, HFFormat, SlidingWindow
from models.hf_tensors import LLAMA_HF_LAYER_NAMES
from models.llama.hf import LlamaHF
from models.llama.model import LlamaArgs

__all__ = ["QWEN3_HF_FORMAT", "QWEN3_HF_LAYER_NAMES", "Qwen3HF"]

QWEN3_HF_LAYER_NAMES = {
    **LLAMA_HF_LAYER_NAMES,
    "attention.q_norm": "self_attn.q_norm",
    "attention.k_norm": "self_attn.k_norm",
}


def _full_attention_layers(args: LlamaArgs) -> dict[str, object]:
    """Every layer full attention (what an export writes; the window itself is switched off)."""
    return {"max_window_layers": args.n_layers, "layer_types": ["full_attention"] * args.n_layers}


QWEN3_HF_FORMAT: HFFormat[LlamaArgs] = HFFormat(
    family="qwen3",
    model_type="qwen3",
    architecture="Qwen3ForCausalLM",
    rows=(*DECODER_ROWS, *GQA_ROWS, FFN_ROW, Derived(write=_full_attention_layers)),
    fixed={"qk_norm": True},
    hf_fixed={"attention_bias": False, "use_sliding_window": False, "sliding_window": None},
    sliding_window=SlidingWindow(switch="use_sliding_window", per_layer=True),
)


class Qwen3HF(LlamaHF):
    """Hugging Face ``Qwen3ForCausalLM`` <-> meshwright Qwen3 (config and tensor names)."""

    hf_format = QWEN3_HF_FORMAT
    layer_names = QWEN3_HF_LAYER_NAMES
