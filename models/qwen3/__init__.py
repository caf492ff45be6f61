"""The Qwen3 dense family: ``QWEN3_SPEC``, what the rest of the stack sees of it (``models/spec.py``).

``model.py`` holds the arguments (the modules, counts and TP plan are Llama's, with q/k head
norms and an explicit head size switched on); ``hf.py`` the Hugging Face adapter
(``Qwen3ForCausalLM``). The model never imports the adapter; this file joins the two.
"""

from __future__ import annotations

from models.llama.model import (
    TP_PLAN,
    Transformer,
    attention_mask,
    num_flops_per_token,
    param_counts,
    planner_terms,
    qk_norm,
    ties_embeddings,
    tp_divisible,
)
from models.qwen3.hf import Qwen3HF
from models.qwen3.model import Qwen3Args
from models.spec import ModelSpec

__all__ = ["QWEN3_SPEC", "Qwen3Args", "Qwen3HF"]

QWEN3_SPEC = ModelSpec(
    family="qwen3",
    args_cls=Qwen3Args,
    model_cls=Transformer,
    param_counts=param_counts,
    flops_per_token=num_flops_per_token,
    tp_plan=TP_PLAN,
    tp_divisible=tp_divisible,
    hf=Qwen3HF(),
    ties_embeddings=ties_embeddings,
    attention_mask=attention_mask,
    qk_norm=qk_norm,
    planner_terms=planner_terms,
)
