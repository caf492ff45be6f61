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
and, emulated, return their input's dtype: no term in fp32 (torchao's real MX GEMM on SM100 returns
bf16: not verified here). Measured (moe_debug cut to 1 layer, FSDP x2, fp32,
``tests/trainer/test_rehearse_float8.py``): FLOPs 1.055 -> 0.999, saved activations 0.853 -> 1.000
and peak 0.918 -> 0.999 of the plan before -> after these terms (bf16 FSDP parameters: FLOPs 1.055 ->
0.999, activations 1.034 -> 1.000; with bf16 autocast too: activations 1.000, peak 1.021).

Under bf16 autocast over fp32 weights (:func:`autocast_saves`): autocast's own linear saves a bf16 cast
of its input per matmul and a bf16 copy of its weight; a converted linear does neither. torchao's
``Float8Linear`` runs its autograd function on the fp32 input and the fp32 weight (the casts are its own,
inside the matmul) and returns bf16, and the MXFP8 weight wrapper takes the matmul before autocast
does. What the converted linear saves is read off the trainer's own conversion of one small linear,
run under CPU autocast with ``saved_tensors_hooks`` (its input saved as given; no bf16 weight): the
plan then drops the converted weights' copies (:func:`converted_weight_copies`) and, when every linear
of the blocks is converted (not the MoE blocks: the router stays), saves each block norm's fp32 output
once for its matmuls instead of one bf16 cast each (:func:`autocast_casts_each`). Measured (debug cut
to 1 layer, FSDP x2): saved activations 0.904 -> 1.000 for tensorwise, rowwise and
rowwise_with_gw_hp.

The casts' temporaries (:func:`converted_backward_transient`): torchao's dynamic casts in a converted
linear's backward (an fp32 scaled copy of the output gradient, the weight and the input, their float8
or MX bytes, emulated the dequantized fp32 operands) are live while its matmuls run; the rehearsal
found the peak there, in the last block's first linear backward. Measured on the same run (debug, 1
layer, FSDP x2), the peak before -> after the term: fp32 tensorwise / rowwise 1.082 -> 0.994,
rowwise_with_gw_hp 1.026 -> 0.987, MXFP8 1.168 -> 0.994; bf16 autocast 1.088 -> 0.963 (tensorwise)
and 1.041 -> 0.961 (rowwise_with_gw_hp); MXFP8 over bf16 FSDP parameters 1.197 -> 0.957.

Emulated MXFP8 under bf16 autocast over fp32 weights is refused (``parallelisms/float8.py``): torchao's
emulated matmul multiplies the operands in their own dtypes, and SDPA's bf16 output into ``wo``'s fp32
weight fails in a real run; the fake-tensor rehearsal, whose mm did not check dtypes (now it does:
``rehearse_trace.check_matmul_dtypes``), had measured activations 1.192 (dense) and 0.835 (experts) of
the plan there. With FSDP's bf16 parameters nothing is cast and no term applies."""

from __future__ import annotations

import copy
import dataclasses
import functools
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from models import get_spec
from models.spec import ExpertGroups
from parallelisms.float8 import (
    Float8Config,
    Float8Plan,
    convert_to_low_precision,
    float8_weight_names,
    torchao_linear_config,
)
from parallelisms.tensor_parallel import tp_kinds, tp_shard_dim
from trainer.planner.context import PlanContext

__all__ = [
    "AMAX_BYTES",
    "TP_AMAX_BYTES",
    "AutocastSaves",
    "autocast_casts_each",
    "attention_inputs_as_given",
    "autocast_saves",
    "converted_backward_transient",
    "converted_weight_copies",
    "converted_weights",
    "expert_groups",
    "expert_padding_flops",
    "float8_gathered",
    "gathered_bytes",
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


def converted_weights(c: PlanContext) -> list[tuple[int, float]]:
    """Per weight of a converted (float8 / MXFP8) linear: (its block's index in ``c.table.blocks``, its
    elements on one tp rank, unsharded by FSDP). A linear the TP plan shards is divided by tp; one it
    replicates (an MoE layer's shared experts, MLA's ``wq_a`` / ``wkv_a``) is whole on every tp rank,
    as the parameter table counts it (``tensor_parallel.tp_shard_dim``). Empty without float8."""
    model, spec, f8 = c.table.model, c.spec, c.cfg.training.float8
    if not f8.enable or model is None:
        return []
    index = {key: i for i, (key, _) in enumerate(spec.block_items(model))}
    params, kinds = dict(model.named_parameters()), tp_kinds(model, spec)
    out = []
    for name in float8_weight_names(model, f8, spec):
        module = name[: -len(".weight")]
        sharded = tp_shard_dim(kinds.get(module), model.get_submodule(module), "weight") is not None
        tp = c.dims.tp if sharded else 1
        out.append((index[_block_key(spec.blocks, name)], params[name].numel() / tp))
    return out


def float8_weights(c: PlanContext) -> list[tuple[int, float]]:
    """:func:`converted_weights` when FSDP all-gathers them in float8; empty without
    ``fsdp_float8_all_gather``."""
    return converted_weights(c) if _all_gathers_float8(c) else []


def float8_gathered(c: PlanContext) -> list[float]:
    """Per block (``c.table.blocks``' order): the elements FSDP all-gathers in float8 (one byte each)."""
    out = [0.0] * len(c.table.blocks)
    for block, elements in float8_weights(c):
        out[block] += elements
    return out


def gathered_bytes(c: PlanContext, elements: float, float8: float) -> float:
    """The bytes of one gathered FSDP unit of ``elements`` local parameters, ``float8`` of them
    all-gathered in float8 (:func:`float8_gathered`): one byte each, the rest ``param_dtype``'s. What
    FSDP's all-gather carries and what the unsharded unit holds until it is resharded."""
    g = c.param_gather_bytes
    return elements * g - float8 * (g - 1)


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


@dataclass(frozen=True)
class AutocastSaves:
    """What one converted linear keeps for backward under bf16 autocast over an fp32 input and fp32
    weight (:func:`autocast_saves`), where autocast's own linear saves a bf16 cast of each."""

    input_as_given: bool  # the fp32 input tensor itself (shared by the linears reading it), no bf16 cast
    weight_copy: bool  # a bf16 copy of the weight


def autocast_saves(c: PlanContext) -> Optional[AutocastSaves]:
    """What the run's converted linears save under bf16 autocast over fp32 weights (see the module
    docstring); None without float8, autocast, or with FSDP's bf16 parameters (nothing to cast)."""
    f8 = c.cfg.training.float8
    fsdp_bf16 = c.dims.fsdp_enabled and c.param_gather_bytes == 2
    if not f8.enable or c.cfg.training.mixed_precision != "bf16" or fsdp_bf16:
        return None
    return _autocast_probe(f8.recipe, c.spec.family)


@functools.cache
def _autocast_probe(recipe: str, family: str) -> AutocastSaves:
    """Run one linear converted by the trainer's own conversion (``convert_to_low_precision``,
    emulated: the same autograd function) forward under CPU bf16 autocast on an fp32 input, and read
    what it saves off ``torch.autograd.graph.saved_tensors_hooks``."""
    spec = get_spec(family)
    f8 = Float8Config(enable=True, recipe=recipe, emulate=True, min_features=1, exclude=[])
    saved: list[torch.Tensor] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t)
        return t

    with torch.random.fork_rng(devices=[]):  # the run's RNG stays untouched (the plan may precede init)
        holder = nn.ModuleDict({spec.blocks: nn.ModuleDict({"0": nn.Linear(64, 64, bias=False)})})
        convert_to_low_precision(holder, Float8Plan(f8, [], torch.bfloat16), spec)
        linear = holder[spec.blocks]["0"]
        assert isinstance(linear, nn.Module)
        x = torch.randn(32, 64, requires_grad=True)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                linear(x)
    as_given = any(t.dtype == x.dtype and t.data_ptr() == x.data_ptr() for t in saved)
    copy = any(t.dtype == torch.bfloat16 and t.numel() == 64 * 64 for t in saved)
    return AutocastSaves(input_as_given=as_given, weight_copy=copy)


def autocast_casts_each(c: PlanContext) -> bool:
    """Whether each matmul of the blocks saves its own bf16 cast of its fp32 input under autocast:
    false when every linear of the blocks is converted and saves its input as given."""
    saves, model = autocast_saves(c), c.table.model
    if saves is None or not saves.input_as_given or model is None:
        return True
    prefix = f"{c.spec.blocks}."
    linears = sum(1 for n, m in model.named_modules() if isinstance(m, nn.Linear) and n.startswith(prefix))
    return len(converted_weights(c)) < linears


def converted_backward_transient(
    c: PlanContext, block: int, ffn_saved: float, experts_grad: float = 0.0
) -> float:
    """What the backward of block ``block`` (``c.table.blocks``' order) allocates at most for its
    converted linears beyond plain linears' of the same shapes (:func:`_backward_extra`: torchao's
    dynamic casts of the output gradient, the weight and the input -- an fp32 scaled copy, then the
    float8 or MX bytes; emulated, the dequantized fp32 operands too -- live while the backward's two
    matmuls run), at the run's micro-batch tokens, tp-local shapes and dtypes (FSDP's bf16 parameters,
    or fp32 ones under bf16 autocast). The planner adds it at the blocks' backward instant, every
    block's saved bytes live: the rehearsal found the peak in the last block's first linear backward
    (``w2``: debug, 1 layer, FSDP x2, tensorwise, fp32: 1.082 of the plan before this term). In an MoE
    layer's block the linears outside the MoE layer (attention's) run their backward after it, whose
    saved bytes (``ffn_saved``: its norm's and its own) are freed by then; the MoE layer's own converted
    linears (its shared experts) run theirs first in the block's, before its experts' gradients are made:
    where the instant counts those (``experts_grad``: FSDP's unsharded block gradient), they are not
    live beside these casts (measured at TP x2 x FSDP x2 with float8 all-gather, the peak 0.940 ->
    0.982 of the plan on deepseek_v3_debug, 2 layers, 0.927 -> 0.982 on qwen3_5_moe_debug, 1 layer).
    0 without float8."""
    f8, model, spec = c.cfg.training.float8, c.table.model, c.spec
    if not f8.enable or model is None:
        return 0.0
    tp, kinds, modules = c.dims.tp, tp_kinds(model, spec), dict(model.named_modules())
    prefix, moe = _block_scope(c, block)
    fsdp_bf16 = c.dims.fsdp_enabled and c.param_gather_bytes == 2
    autocast = c.cfg.training.mixed_precision == "bf16"
    # the rehearsal and a CPU run emulate; torchao's real MX matmul needs Triton (absent): MXFP8 is
    # probed emulated (the real SM100 kernel's temporaries are not verified)
    emulate = f8.emulate if f8.emulate is not None else c.cfg.training.device != "cuda"
    emulate = emulate or f8.recipe == "mxfp8"
    out = 0.0
    for name in float8_weight_names(model, f8, spec):
        module = name[: -len(".weight")]
        if not module.startswith(prefix):
            continue
        linear = modules[module]
        assert isinstance(linear, nn.Linear)
        kind = kinds.get(module, "") if tp > 1 else ""
        in_f = linear.in_features // (tp if kind == "rowwise" else 1)
        out_f = linear.out_features // (tp if kind == "colwise" else 1)
        extra = _backward_extra(
            f8.recipe, emulate, spec.family, c.micro_tokens, in_f, out_f, fsdp_bf16, autocast
        )
        inside = _inside(module, moe)
        out = max(out, extra - (experts_grad if inside else ffn_saved if moe else 0.0))
    return out


@functools.cache
def _backward_extra(
    recipe: str, emulate: bool, family: str, tokens: int, in_f: int, out_f: int, bf16: bool, autocast: bool
) -> float:
    """Peak bytes of one (tokens, in_f) x (in_f, out_f) linear's backward, converted by the trainer's
    own conversion (``convert_to_low_precision``) minus a plain ``nn.Linear``'s (its gradients), on
    fake tensors under torch's ``MemTracker``: the memory of the same allocations the rehearsal counts,
    at any shape, for nothing."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker

    spec = get_spec(family)
    dtype = torch.bfloat16 if bf16 else torch.float32
    f8 = Float8Config(enable=True, recipe=recipe, emulate=emulate, min_features=1, exclude=[])
    compute = torch.bfloat16 if (bf16 or autocast) else torch.float32

    def backward(convert: bool) -> float:
        """The peak's rise over what is live when the backward starts (the forward's, if higher)."""
        tracker = MemTracker()
        with FakeTensorMode(), tracker:
            holder = nn.ModuleDict(
                {spec.blocks: nn.ModuleDict({"0": nn.Linear(in_f, out_f, bias=False, dtype=dtype)})}
            )
            if convert:
                convert_to_low_precision(holder, Float8Plan(f8, [], compute), spec)
            x = torch.empty(tokens, in_f, dtype=dtype, requires_grad=True)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                y = holder[spec.blocks]["0"](x)
            grad = torch.empty_like(y)
            live = _cpu_total(tracker.get_tracker_snapshot())
            y.backward(grad)
            return _cpu_total(tracker.get_tracker_snapshot("peak")) - live

    return max(0.0, backward(True) - backward(False))


def _cpu_total(snapshot: dict) -> float:  # type: ignore[type-arg]
    (total,) = [s["Total"] for device, s in snapshot.items() if device.type == "cpu"]
    return float(total)


def attention_inputs_as_given(c: PlanContext, block: int) -> bool:
    """Whether block ``block``'s (``c.table.blocks``' order) linears outside its MoE layer -- the
    attention's -- are all converted and save their fp32 input as given under bf16 autocast, so the
    attention norm's output is saved once in fp32 rather than cast per matmul. An MoE layer's router
    is never converted, so :func:`autocast_casts_each` keeps the per-matmul casts for the whole model;
    its attention's inputs are as given all the same (measured: moe_debug with float8 under bf16
    autocast, saved activations 0.976 of the plan with the casts). A dense block: every linear."""
    saves, model, spec = autocast_saves(c), c.table.model, c.spec
    if saves is None or not saves.input_as_given or model is None:
        return False
    prefix, moe = _block_scope(c, block)
    converted = {name[: -len(".weight")] for name in float8_weight_names(model, c.cfg.training.float8, spec)}
    linears = [
        name
        for name, m in model.named_modules()
        if isinstance(m, nn.Linear) and name.startswith(prefix) and not _inside(name, moe)
    ]
    return bool(linears) and all(name in converted for name in linears)


def _block_scope(c: PlanContext, block: int) -> tuple[str, list[str]]:
    """Block ``block``'s module-name prefix (``<blocks>.<key>.``) and its MoE layers' names."""
    model, spec = c.table.model, c.spec
    assert model is not None
    prefix = f"{spec.blocks}.{spec.block_items(model)[block][0]}."
    moe = [name for name, _ in spec.moe_layers(model)] if spec.moe_layers is not None else []
    return prefix, [name for name in moe if name.startswith(prefix)]


def _inside(module: str, layers: list[str]) -> bool:
    return any(module.startswith(f"{layer}.") for layer in layers)


def converted_weight_copies(c: PlanContext) -> list[float]:
    """Per block (``c.table.blocks``' order): the converted linears' weight elements (one tp rank)
    that autocast does not copy to bf16 (their wrapper takes the matmul before autocast)."""
    out = [0.0] * len(c.table.blocks)
    saves = autocast_saves(c)
    if saves is None or saves.weight_copy:
        return out
    for block, elements in converted_weights(c):
        out[block] += elements
    return out
