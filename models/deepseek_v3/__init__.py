"""The DeepSeek-V3 family (multi-head latent attention, group-limited sigmoid routing, YaRN, MTP):
``DEEPSEEK_V3_SPEC``, what the rest of the stack sees of it (``models/spec.py``).

``model.py`` holds the arguments, the modules, the counts and the TP plan; ``hf.py`` the Hugging
Face adapter (``DeepseekV3ForCausalLM``). The model never imports the adapter; this file joins them.
"""

from __future__ import annotations

from models.deepseek_v3.hf import DeepSeekV3HF
from models.deepseek_v3.model import (
    TP_PLAN,
    DeepSeekV3Args,
    DeepSeekV3Transformer,
    MLAttention,
    batch_inputs,
    flops_per_token,
    mtp_depth,
    mtp_flops_per_token,
    param_counts,
    planner_terms,
    tp_divisible,
)
from models.llama.model import attention_mask, ties_embeddings
from models.moe.model import expert_modules, moe_layers
from models.spec import ModelSpec

__all__ = ["DEEPSEEK_V3_SPEC", "DeepSeekV3Args", "DeepSeekV3HF", "DeepSeekV3Transformer", "MLAttention"]

DEEPSEEK_V3_SPEC = ModelSpec(
    family="deepseek_v3",
    args_cls=DeepSeekV3Args,
    model_cls=DeepSeekV3Transformer,
    param_counts=param_counts,
    flops_per_token=flops_per_token,
    tp_plan=TP_PLAN,
    tp_divisible=tp_divisible,
    hf=DeepSeekV3HF(),
    moe_layers=moe_layers,
    expert_modules=expert_modules,
    ties_embeddings=ties_embeddings,
    attention_mask=attention_mask,
    mtp_depth=mtp_depth,
    mtp_flops_per_token=mtp_flops_per_token,
    batch_inputs=batch_inputs,
    planner_terms=planner_terms,
    last_modules=("norm", "output", "mtp"),  # MTP modules share the final norm and the head
    qk_clip=False,  # MLA: QK-clip would scale only the non-RoPE q/k parts (Kimi K2); not built yet
)
