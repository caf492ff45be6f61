"""The mixture-of-experts family: ``MOE_SPEC``, what the rest of the stack sees of it.

``model.py`` holds the modules (router, MoE layer with its load balancing, blocks), the counts and
the TP plan; ``args.py`` the arguments (``MoEArgs``); ``experts.py`` the stacked experts
(``GroupedExperts``); ``hf.py`` the Hugging Face adapter (Mixtral, Qwen3-MoE). The model never imports
the adapter; this file joins the two.
"""

from __future__ import annotations

from models.llama.model import attention_mask, qk_norm, ties_embeddings
from models.moe.args import MoEArgs
from models.moe.hf import MoEHF
from models.moe.model import (
    TP_PLAN,
    MoE,
    MoETransformer,
    expert_modules,
    flops_per_token,
    moe_layers,
    param_counts,
    planner_terms,
    tp_divisible,
)
from models.spec import ModelSpec

__all__ = [
    "MOE_SPEC",
    "MoE",
    "MoEArgs",
    "MoEHF",
    "MoETransformer",
    "expert_modules",
    "moe_layers",
    "param_counts",
]

MOE_SPEC = ModelSpec(
    family="moe",
    args_cls=MoEArgs,
    model_cls=MoETransformer,
    param_counts=param_counts,
    flops_per_token=flops_per_token,
    tp_plan=TP_PLAN,
    tp_divisible=tp_divisible,
    hf=MoEHF(),
    moe_layers=moe_layers,
    expert_modules=expert_modules,
    ties_embeddings=ties_embeddings,
    attention_mask=attention_mask,
    qk_norm=qk_norm,
    planner_terms=planner_terms,
)
