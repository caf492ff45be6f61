"""The dense Llama family: ``LLAMA_SPEC``, what the rest of the stack sees of it (``models/spec.py``).

``model.py`` holds the arguments, the modules, the counts and the TP plan; ``hf.py`` the Hugging
Face adapter. The model never imports the adapter; this file joins the two.
"""

from __future__ import annotations

from models.llama.hf import LlamaHF
from models.llama.model import (
    TP_PLAN,
    LlamaArgs,
    Transformer,
    attention_mask,
    lr_scale,
    num_flops_per_token,
    param_counts,
    planner_terms,
    qk_norm,
    ties_embeddings,
    tp_divisible,
)
from models.spec import ModelSpec

__all__ = ["LLAMA_SPEC", "LlamaArgs", "LlamaHF", "Transformer", "num_flops_per_token", "param_counts"]

LLAMA_SPEC = ModelSpec(
    family="llama",
    args_cls=LlamaArgs,
    model_cls=Transformer,
    param_counts=param_counts,
    flops_per_token=num_flops_per_token,
    tp_plan=TP_PLAN,
    tp_divisible=tp_divisible,
    hf=LlamaHF(),
    ties_embeddings=ties_embeddings,
    attention_mask=attention_mask,
    qk_norm=qk_norm,
    planner_terms=planner_terms,
    lr_scale=lr_scale,
)
