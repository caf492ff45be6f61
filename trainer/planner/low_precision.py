"""The planner's float8 terms (``training.float8``; parallelisms/float8.py): with
``fsdp_float8_all_gather`` FSDP2 all-gathers the converted weights in float8 -- one byte an element
instead of ``param_dtype``'s (a quarter of fp32 masters, half of bf16) -- and the step hook
all-reduces one fp32 amax per float8 weight after each optimizer step, then keeps one fp32 scale
per weight for the next all-gathers. Masters, gradients, optimizer state and the gradient
reduce-scatter stay in high precision; without float8 all-gather nothing changes (the casts happen
on the gathered weights, inside each matmul). The precision term of the planner, not a family's:
the converted linears come from the same filter the trainer applies, run on the meta model.

Under tensor parallel the float8 linears see DTensors, and each dynamic scale of a *sharded* operand
needs the amax over the whole tensor: torchao's ``tensor_to_amax`` on a sharded DTensor gives a
``Partial(max)`` that DTensor all-reduces over tp when torchao upcasts it to float64 for the scale
(``amax_to_scale``): one all-reduce of 8 bytes per tensorwise cast, of one float64 per row for an
axiswise (rowwise) cast along the sharded dimension (:func:`float8_tp_amax`). A replicated operand (a
column-wise linear's input, a row-wise linear's output gradient) and an axiswise cast along an
unsharded dimension need none; a weight FSDP all-gathered in float8 arrives cast (scaled by the
precompute) and needs none either.

Low-precision experts (``training.float8.experts``, :func:`expert_groups`): the trainer's conversion
makes the stacked experts run torchao's grouped GEMM over every expert's token group padded with zero
rows to a multiple (``StackedExperts.group_multiple``: 32 for MXFP8) up to the family's static bound,
and the GEMM returns its config's ``out_dtype`` (bf16, as the conversion sets it for the experts).
torchao's autograd functions (``_MXFP8GroupedMM``; the float8 one alike) save their high-precision
operands as given -- the padded input rows in the MoE input's dtype and the weight, no quantized copy
-- so the experts' saved activations are the padded rows' (the family's ``ffn_saved`` with
``BlockLayout.experts``) and the padding rows' matmuls are executed FLOPs
(:func:`expert_padding_flops`). The multiple and the output dtype are read off the trainer's own
conversion (``convert_to_low_precision``) of a meta copy of one expert module, so a recipe with
another multiple needs no change here. Dense MXFP8 linears (``mx_mm``) save their high-precision input
and return their input's dtype: no term. Measured (moe_debug cut to 1 layer, FSDP x2, fp32,
``tests/trainer/test_rehearse_float8.py``): FLOPs 1.055 -> 0.999, saved activations 0.853 -> 1.000
and peak 0.918 -> 0.999 of the plan before -> after these terms (bf16 FSDP parameters: FLOPs 1.055 ->
0.999, activations 1.034 -> 1.000). Not modelled: MXFP8 linears under bf16 autocast (torchao's weight
wrapper takes them before autocast: fp32 input saved, fp32 output), with or without experts."""

from __future__ import annotations

import copy
import dataclasses
from typing import Optional

import torch
from torch import nn

from models.spec import ExpertGroups
from parallelisms.float8 import (
    Float8Plan,
    convert_to_low_precision,
    float8_weight_names,
    torchao_linear_config,
)
from parallelisms.tensor_parallel import tp_kinds
from trainer.planner.context import PlanContext

__all__ = [
    "AMAX_BYTES",
    "TP_AMAX_BYTES",
    "expert_groups",
    "expert_padding_flops",
    "float8_gathered",
    "float8_tp_amax",
    "float8_weights",
]

AMAX_BYTES = 4  # one fp32 amax (all-reduced) and one fp32 scale (kept) per float8 weight
TP_AMAX_BYTES = 8  # a TP amax is all-reduced in float64 (torchao's amax_to_scale upcasts it)

# The six casts of torchao's float8 matmul (``matmul_with_hp_or_float8_args``), in its order: the
# operand (input (T, in), weight transposed (in, out), output gradient (T, out)), the cast config
# it reads, the dimension an axiswise amax reduces, and whether the cast runs in forward.
_CASTS = (
    ("input", "cast_config_input", 1, True),
    ("weight", "cast_config_weight", 0, True),
    ("grad_out", "cast_config_grad_output", 1, False),
    ("weight", "cast_config_weight_for_grad_input", 1, False),
    ("grad_out", "cast_config_grad_output_for_grad_weight", 0, False),
    ("input", "cast_config_input_for_grad_weight", 0, False),
)
# The dimension of each operand that tensor parallel shards (None: replicated), by TP-plan kind
# (parallelisms/tensor_parallel.py): column-wise shards out_features, row-wise in_features.
_SHARDED = {
    "colwise": {"input": None, "weight": 1, "grad_out": 1},
    "rowwise": {"input": 1, "weight": 0, "grad_out": None},
}


def _all_gathers_float8(c: PlanContext) -> bool:
    f8 = c.cfg.training.float8
    return f8.enable and f8.fsdp_float8_all_gather and c.dims.fsdp_enabled and c.table.model is not None


def float8_weights(c: PlanContext) -> list[tuple[int, float]]:
    """Per float8 weight that FSDP all-gathers in float8: (its block's index in ``c.table.blocks``,
    its elements on one tp rank, unsharded by FSDP). Empty without ``fsdp_float8_all_gather``."""
    if not _all_gathers_float8(c):
        return []
    model, spec = c.table.model, c.spec
    assert model is not None  # _all_gathers_float8
    index = {key: i for i, (key, _) in enumerate(spec.block_items(model))}
    params = dict(model.named_parameters())
    out = []
    for name in float8_weight_names(model, c.cfg.training.float8, spec):
        key = name[len(spec.blocks) + 1 :].split(".")[0]  # "<blocks>.<key>.<...>.weight"
        out.append((index[key], params[name].numel() / c.dims.tp))  # every block linear is TP-sharded
    return out


def float8_gathered(c: PlanContext) -> list[float]:
    """Per block (``c.table.blocks``' order): the elements FSDP all-gathers in float8 (one byte each)."""
    out = [0.0] * len(c.table.blocks)
    for block, elements in float8_weights(c):
        out[block] += elements
    return out


def float8_tp_amax(c: PlanContext, pp_rank: int) -> dict[int, float]:
    """The float8 amax all-reduces over tp of one microbatch on ``pp_rank``: {bytes of one call: calls}
    (see the module docstring). Full activation checkpointing repeats every forward cast (measured: the
    exit projection's too, whose output collective the recompute skips). Empty without float8 or tp."""
    f8 = c.cfg.training.float8
    model, spec = c.table.model, c.spec
    if not f8.enable or c.dims.tp == 1 or model is None or f8.recipe == "mxfp8":  # mxfp8 + tp: refused
        return {}
    torchao_cfg = torchao_linear_config(f8, emulate=True)
    from torchao.float8.config import ScalingGranularity, ScalingType

    kinds = tp_kinds(model, spec)
    modules = dict(model.named_modules())
    owned = {b for st in c.ranks[pp_rank] for b in st.blocks}
    index = {key: i for i, (key, _) in enumerate(spec.block_items(model))}
    gathered_f8 = f8.fsdp_float8_all_gather and c.dims.fsdp_enabled
    out: dict[int, float] = {}
    linears = [n[: -len(".weight")] for n in float8_weight_names(model, f8, spec)]
    for name in linears:
        key = _block_key(spec.blocks, name)
        sharded = _SHARDED.get(kinds.get(name, ""))
        if sharded is None or index[key] not in owned:
            continue
        linear = modules[name]
        shape = {
            "input": (c.micro_tokens, linear.in_features),
            "weight": (linear.in_features, linear.out_features),
            "grad_out": (c.micro_tokens, linear.out_features),
        }
        for operand, attr, axis, forward in _CASTS:
            cast = getattr(torchao_cfg, attr)
            dim = sharded[operand]
            if cast.scaling_type is ScalingType.DISABLED or dim is None:
                continue
            if operand == "weight" and gathered_f8:
                continue
            if cast.scaling_granularity is ScalingGranularity.TENSORWISE:
                size = TP_AMAX_BYTES
            elif axis == dim:  # one amax per row of the other (unsharded) dimension
                size = shape[operand][1 - axis] * TP_AMAX_BYTES
            else:
                continue
            out[size] = out.get(size, 0.0) + (2 if forward and c.recompute else 1)
    return out


def _block_key(blocks: str, name: str) -> str:
    """The block key of a module name ``<blocks>.<key>.<...>``."""
    return name[len(blocks) + 1 :].split(".")[0]


def _converted_experts(c: PlanContext) -> Optional[tuple[int, int]]:
    """(group multiple, output bytes) of the stacked experts after the trainer's conversion, run on a
    meta copy of one expert module; None unless ``training.float8.experts`` converts them."""
    f8, model = c.cfg.training.float8, c.table.model
    if not (f8.enable and f8.experts) or c.spec.expert_modules is None or model is None:
        return None
    experts = c.spec.expert_modules(model)
    if not experts:
        return None
    holder = nn.ModuleDict({"experts": copy.deepcopy(experts[0])})  # on meta: shapes only
    emulate = True if f8.emulate is None else f8.emulate  # neither changes the padding nor the dtype
    convert_to_low_precision(holder, Float8Plan(dataclasses.replace(f8, emulate=emulate), []), c.spec)
    probe = holder["experts"]
    assert isinstance(probe, nn.Module)
    out_dtype = next(probe.parameters()).config.out_dtype  # torchao's weight wrapper: its op config
    return int(probe.group_multiple), torch.empty((), dtype=out_dtype).element_size()


def expert_groups(c: PlanContext, rows_in: int) -> Optional[ExpertGroups]:
    """The stacked experts in low precision as ``BlockLayout.experts`` (see the module docstring);
    ``rows_in``: bytes of the MoE input (the residual stream's dtype). None: they stay high precision."""
    converted = _converted_experts(c)
    if converted is None:
        return None
    multiple, out = converted
    return ExpertGroups(multiple=multiple, out=out, rows_in=rows_in, tokens=c.micro_tokens, ep=c.dims.ep)


def expert_padding_flops(c: PlanContext) -> float:
    """Matmul FLOPs one rank executes per step over the experts' padding rows (the rehearsal counts
    ``torch._grouped_mm`` over every row): forward, backward (x 2) and full checkpointing's forward
    again, per MoE layer and microbatch, the MoE layers spread evenly over the pipeline ranks."""
    groups = expert_groups(c, 4)  # the rows' dtype does not change their count
    if groups is None or c.terms.expert_padding_flops is None:
        return 0.0
    passes = 3 + (1 if c.recompute else 0)
    return passes * c.terms.expert_padding_flops(groups) * len(c.table.moe_layers) * c.accum / c.dims.pp
