"""The Qwen3.5 hybrid families (Gated DeltaNet + gated attention): ``QWEN3_5_SPEC`` (dense, Qwen3.5),
``QWEN3_5_MOE_SPEC`` (Qwen3.5-MoE) and ``QWEN3_NEXT_SPEC`` (Qwen3-Next: Qwen3.5-MoE's layers, its own
Hugging Face tensors), what the rest of the stack sees of them (``models/spec.py``).

``model.py`` holds the arguments, modules, counts and TP plan (``delta_rule.py`` the gated delta rule
itself); ``hf.py`` the Hugging Face adapter (``Qwen3_5ForCausalLM``, ``Qwen3_5MoeForCausalLM`` and the
text decoder of the vision-language folders). The model never imports the adapter; this file joins
them. The two families share every module: the MoE one has ``models/moe``'s experts in every block.
"""

from __future__ import annotations

from dataclasses import replace

from models.llama.model import attention_mask, qk_norm, ties_embeddings
from models.moe.model import expert_modules, moe_layers
from models.qwen3_5.args import Qwen3NextArgs
from models.qwen3_5.hf import Qwen3_5HF
from models.qwen3_5.model import (
    TP_PLAN,
    GatedDeltaNet,
    Qwen3_5Args,
    Qwen3_5MoeArgs,
    Qwen3_5Transformer,
    device_check,
    flops_per_token,
    generation_cores,
    param_counts,
    planner_terms,
    tp_divisible,
)
from models.spec import ModelSpec

__all__ = [
    "QWEN3_5_MOE_SPEC",
    "QWEN3_5_SPEC",
    "QWEN3_NEXT_SPEC",
    "Qwen3NextArgs",
    "GatedDeltaNet",
    "Qwen3_5Args",
    "Qwen3_5HF",
    "Qwen3_5MoeArgs",
    "Qwen3_5Transformer",
]

QWEN3_5_SPEC = ModelSpec(
    family="qwen3_5",
    args_cls=Qwen3_5Args,
    model_cls=Qwen3_5Transformer,
    param_counts=param_counts,
    flops_per_token=flops_per_token,
    tp_plan=TP_PLAN,
    tp_divisible=tp_divisible,
    hf=Qwen3_5HF("qwen3_5"),
    ties_embeddings=ties_embeddings,
    attention_mask=attention_mask,
    qk_norm=qk_norm,
    qk_clip=False,  # the gated attention's wq rows interleave queries and gates; QK-clip is not built for it
    generation_cores=generation_cores,
    sequential_state=True,  # the Gated DeltaNet's state and conv window: CP hands them rank to rank
    planner_terms=planner_terms,  # Llama's attention / the MoE feed-forward, and the DeltaNet blocks
    device_check=device_check,  # model.linear_kernel=fla: CUDA and flash-linear-attention
)

QWEN3_5_MOE_SPEC = ModelSpec(
    family="qwen3_5_moe",
    args_cls=Qwen3_5MoeArgs,
    model_cls=Qwen3_5Transformer,
    param_counts=param_counts,
    flops_per_token=flops_per_token,
    tp_plan=TP_PLAN,
    tp_divisible=tp_divisible,
    hf=Qwen3_5HF("qwen3_5_moe"),
    moe_layers=moe_layers,
    expert_modules=expert_modules,
    ties_embeddings=ties_embeddings,
    attention_mask=attention_mask,
    qk_norm=qk_norm,
    qk_clip=False,
    generation_cores=generation_cores,
    sequential_state=True,  # the Gated DeltaNet's state and conv window: CP hands them rank to rank
    planner_terms=planner_terms,  # Llama's attention / the MoE feed-forward, and the DeltaNet blocks
    device_check=device_check,  # model.linear_kernel=fla: CUDA and flash-linear-attention
)

# Qwen3-Next: Qwen3.5-MoE's layers, its own arguments and HF field table (fused in_proj_qkvz / in_proj_ba)
QWEN3_NEXT_SPEC = replace(
    QWEN3_5_MOE_SPEC, family="qwen3_next", args_cls=Qwen3NextArgs, hf=Qwen3_5HF("qwen3_next")
)
