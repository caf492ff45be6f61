"""Low-precision training: float8 (tensorwise, rowwise, rowwise_with_gw_hp) and MXFP8 linears via torchao.

The conversion is one step of ``parallelize_part``, applied on the meta device before tensor
parallel and FSDP (as torchtitan orders it): the chosen ``nn.Linear`` modules of the repeated blocks
become torchao's ``Float8Linear`` (float8 recipes) or carry MXFP8 training weights (``mxfp8``). The
weights stay high-precision parameters (fp32 masters, the same state-dict names), so checkpoints,
optimizers and reshards see an ordinary model; only the matmuls (forward, grad-input and, except
``rowwise_with_gw_hp``, grad-weight) cast their operands to float8 with dynamic scales.

===========================  ====================================================================
recipe                       scaling (torchao)
===========================  ====================================================================
tensorwise                   one scale per tensor (input, weight, grad); the only one whose weight
                             can be all-gathered in float8 by FSDP2 (``fsdp_float8_all_gather``)
rowwise                      one scale per row (axiswise), power-of-two scales
rowwise_with_gw_hp           rowwise forward / grad-input; the weight gradient in high precision
mxfp8                        MX blocks of 32 elements with e8m0 scales (torchao prototype; SM100+)
===========================  ====================================================================

Which linears convert (``module_filter``): only those inside the repeated blocks (never the
embedding, the output head, MTP modules or anything else in ``ModelSpec.first_modules`` /
``last_modules``), not named in ``exclude`` (by default the MoE router ``gate``: its scores pick the
experts), with both ``in_features`` and ``out_features`` at least ``min_features`` and divisible by
16 (32 for MXFP8, its block size) -- the shapes float8 GEMMs accept. torchao's own automatic filter
is tuned for speed on large GPUs and skips every linear below a few thousand features, i.e. every
linear of the debug model; this filter is about validity, not speed.

``emulate`` runs the same casts and a high-precision matmul of the dequantized operands (torchao's
emulation): the numerics of float8 on any device, not its speed. It is on by default where the
device has no float8 matmul (CPU; CUDA below SM89; below SM100 for MXFP8).

Composition (what the issue's tests run on gloo; GPU-only limits are refused in ``check_float8``):
FSDP2/HSDP with or without ``fsdp_float8_all_gather`` (tensorwise; the dynamic scales of all
float8 weights are precomputed after each optimizer step in one all-reduce, :class:`Float8ScaleHook`);
tensor parallel with torch's plain ``ColwiseParallel`` / ``RowwiseParallel`` over the float8
linears (the activations are communicated in high precision; torchao's float8 TP styles need
float8 collectives, which gloo lacks; MXFP8's weight wrapper is bypassed by DTensor, so mxfp8 with
tp > 1 is refused); custom DDP and ZeRO-1 (without float8 all-gather), pipeline parallel, activation
checkpointing and context parallel (each rank scales its own sequence chunk's activations). torchao
is imported only when float8 is enabled.

MoE experts (``experts=true``; ``recipe=mxfp8``, or ``rowwise`` where torchao's float8 grouped GEMM
runs): the stacked experts' weights carry torchao's training weight wrapper (``quantize_`` with its
``moe_training`` config, one helper for both recipes), which intercepts ``torch._grouped_mm``; the
experts then always take the grouped-GEMM path (``model.grouped_mm`` is overridden to ``on``) with
every expert's token group padded with zero rows to the GEMM's alignment
(``StackedExperts.pad_token_groups``; torchao asserts the groups are already aligned). The padded
length is a static bound, so no host sync; padding rows give zero outputs and add nothing to the
gradients (bf16: bit-identical rows); runs without ``experts`` never pad. EP (``ep > 1``) runs with
both recipes: expert parallel's sharding keeps torchao's weight wrapper on every rank's experts.

- ``mxfp8``: torchao's MXFP8 grouped GEMM, groups of 32 rows (it contracts the weight gradient over
  tokens in blocks of 32). Emulated (CPU, or CUDA below SM100) and real on SM100; below SM100 without
  emulation the dense MXFP8 refusal applies. It returns bf16 only and every wrapped weight must share
  one config (fused optimizers dispatch over all of them at once), so with ``experts=true`` that
  config's ``out_dtype`` is bf16 (the dense MXFP8 linears ignore it: they return their input's dtype;
  the planner's term: trainer/planner/low_precision.py). Verified on gloo: one process, FSDP x2, EP x2
  and EP x2 x FSDP x2 (parity; the last without clipping, whose coefficient carries the grad norm's
  fp32 reduction order into every weight, where an e4m3 rounding boundary can amplify it: measured
  1.3e-4). Under EP each expert's weight gradient is one grouped GEMM over the tokens of the whole ep
  group, rounded to bf16 once, so its one-process reference is the micro-batch times ep (one process
  accumulating ep micro-batches rounds each: 6.9e-4 loss by step 4 in the test, the size of bf16
  rounding the weight gradient, not of the recipe: 5.8e-3 from high-precision experts). Where MXFP8's
  blocks of 32 tokens fall does not matter here: e8m0 scales are powers of two, so a value's e4m3
  rounding depends on its block only where it falls below e4m3's normal range (measured: padding each
  source rank's tokens separately changes no loss bit).
- ``rowwise``: torchao's float8 rowwise grouped GEMM (``Float8TrainingOpConfig``, recipe
  ``FP8_ROWWISE``: per-row scales rounded to powers of two, weight gradient from per-group column
  scales, all in float8 e4m3), groups of 16 rows. It runs only as Triton scale-and-cast kernels and
  ``torch._scaled_grouped_mm``, which torch allows on CUDA compute capability 9.x and 10.x only (not
  SM89, not SM120): :func:`has_float8_grouped_mm`. There is no emulation, so anywhere else (CPU, other
  GPUs, no Triton) it is refused by name -- the experts would otherwise silently stay in high
  precision. The dense linears stay torchao's ``Float8Linear`` (emulated or not, their own dtype);
  only the expert weights are wrapped, all with one config, and the experts' GEMMs return bf16
  (``torch._scaled_grouped_mm``'s only output dtype; autograd casts their input gradient back).
  Verified on CPU with torchao's own ``_Float8GroupedMM`` forward and backward and the CUDA-only pieces
  replaced by pure-torch reference kernels (tests/trainer/test_float8_grouped.py): one process, FSDP x2
  and TP x2 (parity), and EP x2 against one process at micro-batch times ep, as for MXFP8 (loss 7.1e-8,
  grad norm 2.1e-6; against one process accumulating ep micro-batches: 6.9e-4 loss by step 4, each
  micro-batch's weight gradient rounded to bf16). The weight gradient's per-expert column scales are the
  absmax over the tokens of that expert's one GEMM (zero padding rows change none), so EP, handing an
  expert the whole ep group's tokens at once, scales them as one process with that micro-batch does. The
  real kernels are exercised only on a GPU (``benchmarks/gpu_check.py``).
- checkpoints: the wrapped weights are written as their plain data (``parallelisms.utils.plain_tensor``,
  used by the checkpointer's model and optimizer states and the HF export), so they load with or
  without float8 and under ``weights_only``.
- ``tensorwise`` and ``rowwise_with_gw_hp`` with ``experts=true`` are refused: torchao's float8 grouped
  GEMM has no tensorwise or high-precision weight-gradient variant. Experts whose matrices are not
  multiples of the alignment (16, MXFP8 32) are refused too.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

import torch
from torch import nn

from models.errors import ConfigError, check_choice
from models.spec import ModelArgs, ModelSpec, StackedExperts

if TYPE_CHECKING:
    from torchao.float8 import Float8LinearConfig
    from torchao.prototype.moe_training.config import TrainingOpBaseConfig

    from parallelisms.config import ParallelismConfig
    from parallelisms.parallel_dims import ParallelDims

__all__ = [
    "FLOAT8_RECIPES",
    "Float8Config",
    "Float8Plan",
    "Float8ScaleHook",
    "check_float8",
    "convert_to_low_precision",
    "float8_weight_names",
    "has_float8_matmul",
    "has_mxfp8_matmul",
    "module_filter",
    "plan_float8",
    "resolve_emulate",
    "torchao_linear_config",
]

FLOAT8_RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp", "mxfp8")
_MX_BLOCK = 32  # MXFP8 scales one block of 32 elements along the contraction dimension
_F8_ALIGN = 16  # torch._scaled_mm: both matrix dimensions a multiple of 16
_F8_GROUP = 16  # torchao's float8 grouped GEMM: every token group a multiple of 16 rows
EXPERT_RECIPES = ("rowwise", "mxfp8")  # the recipes torchao has a grouped GEMM for


@dataclass
class Float8Config:
    """``training.float8``: float8 / MXFP8 linears (parallelisms/float8.py)."""

    enable: bool = False
    recipe: str = "tensorwise"  # tensorwise | rowwise | rowwise_with_gw_hp | mxfp8
    emulate: Optional[bool] = None  # None = on where the device has no float8 (mxfp8: MX) matmul, e.g. CPU
    fsdp_float8_all_gather: bool = False  # tensorwise + FSDP: all-gather the weights in float8
    min_features: int = 16  # convert a linear only if in and out features are >= this (and a multiple of 16)
    exclude: list[str] = field(default_factory=lambda: ["gate"])  # module names (a dotted part or the fqn)
    experts: bool = (
        False  # MoE stacked experts too: recipe=mxfp8, or rowwise on CUDA SM90/SM100 (the docstring)
    )


def has_float8_matmul(device: torch.device) -> bool:
    """Whether ``device`` runs float8 matmuls (``torch._scaled_mm``): CUDA SM89 (Ada) or newer."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def has_mxfp8_matmul(device: torch.device) -> bool:
    """Whether ``device`` runs MXFP8 matmuls: CUDA SM100 (Blackwell) or newer."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (10, 0)


def has_float8_grouped_mm(device: torch.device) -> bool:
    """Whether ``device`` runs torchao's float8 rowwise grouped GEMM: ``torch._scaled_grouped_mm``
    (CUDA compute capability 9.x or 10.x exactly: Hopper, datacenter Blackwell; not Ada, not SM120)
    and Triton (torchao's scale-and-cast kernels)."""
    if device.type != "cuda" or torch.version.hip is not None:
        return False
    from torch.utils._triton import has_triton

    return torch.cuda.get_device_capability(device)[0] in (9, 10) and has_triton()


def resolve_emulate(cfg: Float8Config, device: torch.device) -> bool:
    """``emulate`` as configured, else on where ``device`` lacks the recipe's matmul."""
    if cfg.emulate is not None:
        return cfg.emulate
    native = has_mxfp8_matmul(device) if cfg.recipe == "mxfp8" else has_float8_matmul(device)
    return not native


def _alignment(cfg: Float8Config) -> int:
    return _MX_BLOCK if cfg.recipe == "mxfp8" else _F8_ALIGN


def module_filter(cfg: Float8Config, spec: ModelSpec, fqn: str, module: nn.Module) -> bool:
    """Whether the linear ``fqn`` converts (see the module docstring): inside a block, not excluded,
    both dimensions >= ``min_features`` and a multiple of 16 (MXFP8: 32)."""
    if not isinstance(module, nn.Linear):
        return False
    parts = fqn.split(".")
    if parts[0] != spec.blocks or parts[0] in (*spec.first_modules, *spec.last_modules):
        return False
    if fqn in cfg.exclude or any(p in cfg.exclude for p in parts):
        return False
    align = _alignment(cfg)
    dims = (module.in_features, module.out_features)
    return all(d >= cfg.min_features and d % align == 0 for d in dims)


def _convertible(model: nn.Module, cfg: Float8Config, spec: ModelSpec) -> list[str]:
    return [name for name, m in model.named_modules() if module_filter(cfg, spec, name, m)]


def expert_names(model: nn.Module, cfg: Float8Config) -> list[str]:
    """The stacked-experts modules of ``model`` (a whole model or a stage) that ``cfg`` converts."""
    if not cfg.experts:
        return []
    return [name for name, m in model.named_modules() if isinstance(m, StackedExperts)]


def float8_weight_names(model: nn.Module, cfg: Float8Config, spec: ModelSpec) -> list[str]:
    """The parameter names (``<linear>.weight``) of ``model`` that ``cfg`` converts (model on any device)."""
    return [f"{name}.weight" for name in _convertible(model, cfg, spec)]


def _check_experts(cfg: Float8Config, device: torch.device, model: nn.Module) -> None:
    """``training.float8.experts=true``: a recipe torchao has a grouped GEMM for, on a device that runs
    it (float8: no emulation exists), experts whose matrix dimensions the GEMM accepts."""
    where = f"training.float8.experts=true on {_device_name(device)} with training.float8.recipe={cfg.recipe}"
    if cfg.recipe not in EXPERT_RECIPES:
        raise ConfigError(
            f"{where}: torchao's float8 grouped GEMM scales rowwise only (per-row scales, weight gradient "
            "in float8); it has no tensorwise or high-precision weight-gradient variant; set "
            "training.float8.recipe=rowwise (CUDA SM90/SM100) or mxfp8, or training.float8.experts=false."
        )
    if cfg.recipe == "rowwise" and not has_float8_grouped_mm(device):
        raise ConfigError(
            f"{where}: torchao's float8 grouped GEMM runs only on CUDA SM90/SM100 "
            "(torch._scaled_grouped_mm and Triton kernels) and has no emulation, so the experts would "
            "silently stay in high precision; set training.float8.recipe=mxfp8 (emulated off SM100) or "
            "training.float8.experts=false."
        )
    align = _alignment(cfg)
    for name, module in model.named_modules():
        if not isinstance(module, StackedExperts):
            continue
        shapes = [tuple(p.shape[1:]) for p in module.parameters()]  # dim 0 holds the experts
        if any(d % align for shape in shapes for d in shape):
            raise ConfigError(
                f"{where}: {name}'s expert matrices {shapes} are not multiples of {align} (what torchao's "
                f"grouped GEMM accepts); resize the experts to multiples of {align} or set "
                "training.float8.experts=false."
            )


def _check_float8_all_gather(cfg: Float8Config, parallelism: ParallelismConfig, dims: ParallelDims) -> None:
    """``training.float8.fsdp_float8_all_gather``: tensorwise scales, under FSDP2."""
    if cfg.recipe != "tensorwise":
        raise ConfigError(
            f"training.float8.fsdp_float8_all_gather=true with training.float8.recipe={cfg.recipe}: only "
            "tensorwise scales let FSDP all-gather float8 weights; set training.float8.recipe=tensorwise "
            "or training.float8.fsdp_float8_all_gather=false."
        )
    if not dims.fsdp_enabled:
        if dims.dp_replicate == 1:
            what = "no data-parallel sharding"
        elif parallelism.ddp.sharded_optimizer:
            what = "ZeRO-1 over dp_replicate"
        else:
            what = "DDP over dp_replicate"
        raise ConfigError(
            f"training.float8.fsdp_float8_all_gather=true with parallelism.dp_shard={dims.dp_shard} "
            f"({what}): the float8 all-gather is FSDP2's; set parallelism.dp_shard > 1 or "
            "training.float8.fsdp_float8_all_gather=false."
        )


def check_float8(
    cfg: Float8Config,
    parallelism: ParallelismConfig,
    dims: ParallelDims,
    device: torch.device,
    model: nn.Module,
    spec: ModelSpec,
) -> list[str]:
    """Every float8 check of a run, before any process group exists; ``model`` is the model on the
    meta device. Returns the names of the linears that convert. Raises one ``ConfigError`` each."""
    check_choice(cfg.recipe, FLOAT8_RECIPES, "training.float8.recipe")
    if cfg.min_features < 1:
        raise ConfigError(
            f"training.float8.min_features={cfg.min_features} must be >= 1; set it to 16 (the default) "
            "or more."
        )
    emulate = resolve_emulate(cfg, device)
    if cfg.recipe == "mxfp8" and not emulate and not has_mxfp8_matmul(device):
        raise ConfigError(
            f"training.float8.recipe=mxfp8 with training.float8.emulate=false on {_device_name(device)}: "
            "MXFP8 matmuls need an SM100 (Blackwell) GPU; set training.float8.emulate=true (numerics only) "
            "or pick a float8 recipe (tensorwise, rowwise)."
        )
    if cfg.recipe != "mxfp8" and not emulate and not has_float8_matmul(device):
        raise ConfigError(
            f"training.float8.emulate=false on {_device_name(device)}, which has no float8 matmul (needs "
            "CUDA SM89+: Ada, Hopper, Blackwell); set training.float8.emulate=true (numerics only) or "
            "training.float8.enable=false."
        )
    if cfg.fsdp_float8_all_gather:
        _check_float8_all_gather(cfg, parallelism, dims)
    if cfg.recipe == "mxfp8" and dims.tp > 1:
        raise ConfigError(
            f"training.float8.recipe=mxfp8 with parallelism.tp={dims.tp}: torchao's MXFP8 weight wrapper is "
            "bypassed under tensor parallel (the sharded matmuls run in high precision, measured equal to "
            "a run without float8); set training.float8.recipe=tensorwise (or rowwise) with tp, or "
            "parallelism.tp=1."
        )
    if cfg.experts and not spec.has_experts:
        raise ConfigError(
            f"training.float8.experts=true but model.family={spec.family} has no experts; "
            "set training.float8.experts=false."
        )
    if cfg.experts:
        _check_experts(cfg, device, model)
    names = _convertible(model, cfg, spec)
    if not names:
        raise ConfigError(
            f"training.float8 converts no linear of model {type(model).__name__}: none inside "
            f"'{spec.blocks}' has both dimensions >= training.float8.min_features={cfg.min_features} and a "
            f"multiple of {_alignment(cfg)}, outside training.float8.exclude={list(cfg.exclude)}; lower "
            "min_features, shorten exclude, or set training.float8.enable=false."
        )
    return names


@dataclass
class Float8Plan:
    """A run's float8 conversion, settled before any process group: the config with ``emulate``
    resolved, the linears that convert (whole model, by name) and the MXFP8 output dtype."""

    config: Float8Config
    linears: list[str]
    dtype: torch.dtype = torch.float32
    experts: list[str] = field(default_factory=list)  # stacked-experts modules (``experts=true``)

    def summary(self) -> dict[str, object]:
        """What start-up prints and ``metrics.jsonl``'s header records."""
        c = self.config
        return {
            "recipe": c.recipe,
            "emulate": c.emulate,
            "fsdp_float8_all_gather": c.fsdp_float8_all_gather,
            "converted": len(self.linears),
            "linears": list(self.linears),
            "experts_converted": len(self.experts),
            "experts": list(self.experts),
        }


def plan_float8(
    cfg: Float8Config,
    parallelism: ParallelismConfig,
    dims: ParallelDims,
    device: torch.device,
    spec: ModelSpec,
    model_args: ModelArgs,
    *,
    compute_dtype: torch.dtype,
) -> Optional[Float8Plan]:
    """The run's :class:`Float8Plan` (None when ``cfg.enable`` is false), after every check of
    :func:`check_float8` on the model built on the meta device."""
    if not cfg.enable:
        return None
    with torch.device("meta"):
        model = spec.build(model_args)
    names = check_float8(cfg, parallelism, dims, device, model, spec)
    resolved = dataclasses.replace(cfg, emulate=resolve_emulate(cfg, device), exclude=list(cfg.exclude))
    bf16_weights = dims.fsdp_enabled and parallelism.fsdp.param_dtype == "bfloat16"
    if cfg.recipe == "mxfp8" and resolved.emulate and compute_dtype == torch.bfloat16 and not bf16_weights:
        # torchao's weight wrapper takes the linears before autocast; its emulated matmul multiplies
        # the dequantized operands in their own dtypes: bf16 activations (SDPA's) x fp32 weights fail
        raise ConfigError(
            "training.float8.recipe=mxfp8 emulated with training.mixed_precision=bf16 and float32 weights "
            f"(parallelism.fsdp.param_dtype={parallelism.fsdp.param_dtype}"
            f"{'' if dims.fsdp_enabled else ', no FSDP'}): torchao's emulated MXFP8 matmul fails on "
            "autocast's bf16 activations against fp32 weights; set parallelism.fsdp.param_dtype=bfloat16 "
            "(with FSDP), training.mixed_precision=fp32, or run on SM100 with training.float8.emulate=false."
        )
    return Float8Plan(resolved, names, compute_dtype, expert_names(model, cfg))


def _device_name(device: torch.device) -> str:
    if device.type != "cuda":
        return device.type
    major, minor = torch.cuda.get_device_capability(device)
    return f"{torch.cuda.get_device_name(device)} (SM{major}{minor})"


def torchao_linear_config(cfg: Float8Config, emulate: bool) -> Float8LinearConfig:
    """torchao's ``Float8LinearConfig`` of a float8 recipe (not ``mxfp8``): what the conversion applies."""

    from torchao.float8 import Float8LinearConfig

    if cfg.recipe == "tensorwise":
        return Float8LinearConfig(enable_fsdp_float8_all_gather=cfg.fsdp_float8_all_gather, emulate=emulate)
    # from_recipe_name builds the recipe's cast configs but takes no emulate flag
    return dataclasses.replace(Float8LinearConfig.from_recipe_name(cfg.recipe), emulate=emulate)


def _wrap_weights(
    model: nn.Module, config: TrainingOpBaseConfig, modules: set[str], experts: set[str], multiple: int
) -> None:
    """torchao's ``quantize_`` with a ``moe_training`` ``config``: the weights of the modules named in
    ``modules`` become torchao's training weight wrapper (it intercepts ``linear`` and
    ``torch._grouped_mm``: dynamic casts, then the low-precision GEMM); the stacked experts among them
    then pad every token group to a multiple of ``multiple`` rows (what the grouped GEMM requires)."""
    from torchao.quantization import quantize_

    # torchao logs one INFO line per swapped weight; the start-up summary names them once
    swaps = logging.getLogger("torchao.prototype.moe_training.conversion_utils")
    level = swaps.level
    swaps.setLevel(max(level, logging.WARNING))
    try:
        quantize_(model, config, filter_fn=lambda m, fqn: fqn in modules)
    finally:
        swaps.setLevel(level)
    for name, module in model.named_modules():
        if name in experts and isinstance(module, StackedExperts):
            module.pad_token_groups(multiple)


def convert_to_low_precision(model: nn.Module, plan: Float8Plan, spec: ModelSpec) -> list[str]:
    """Convert ``model``'s (a whole model or a pipeline stage) filtered linears in place, on meta
    before TP and FSDP; return their names. MXFP8's grouped GEMMs (the experts) return bf16;
    linears of every recipe return their input's dtype."""
    cfg, dtype = plan.config, plan.dtype
    emulate = bool(cfg.emulate)
    names = set(_convertible(model, cfg, spec))
    experts = set(expert_names(model, cfg))  # only with recipe=mxfp8 or rowwise (check_float8)
    if not names and not experts:
        return []

    def keep(module: nn.Module, fqn: str) -> bool:
        return fqn in names

    if cfg.recipe == "mxfp8":
        from torchao.prototype.moe_training.config import MXFP8TrainingOpConfig, MXFP8TrainingRecipe
        from torchao.quantization.quantize_.common.kernel_preference import KernelPreference

        recipe = MXFP8TrainingRecipe.MXFP8_EMULATED_RCEIL if emulate else MXFP8TrainingRecipe.MXFP8_RCEIL
        mx = MXFP8TrainingOpConfig.from_recipe(recipe)
        # torchao's MXFP8 grouped GEMM returns bf16 only, and every wrapped weight must share one config
        # (fused optimizers dispatch over all of them at once): with experts, out_dtype is bf16
        mx = dataclasses.replace(
            mx,
            out_dtype=torch.bfloat16 if experts else dtype,
            kernel_preference=KernelPreference.EMULATED if emulate else mx.kernel_preference,
        )
        _wrap_weights(model, mx, names | experts, experts, _MX_BLOCK)
    else:
        from torchao.float8 import convert_to_float8_training

        convert_to_float8_training(
            model,
            config=torchao_linear_config(cfg, emulate),
            module_filter_fn=keep,
        )
        if experts:  # recipe=rowwise (check_float8): the linears above stay torchao's Float8Linear
            from torchao.prototype.moe_training.config import Float8TrainingOpConfig, Float8TrainingRecipe

            # float8 rowwise grouped GEMM; returns bf16 (torch._scaled_grouped_mm's only output dtype)
            f8 = Float8TrainingOpConfig.from_recipe(Float8TrainingRecipe.FP8_ROWWISE)
            _wrap_weights(model, f8, experts, experts, _F8_GROUP)
    return sorted(names, key=lambda n: [int(p) if p.isdigit() else p for p in n.split(".")])


class Float8ScaleHook:
    """Step hook: with ``fsdp_float8_all_gather`` (tensorwise), compute the dynamic float8 scales of
    every sharded float8 weight for the next step's all-gathers, in one all-reduce of their amaxes
    (torchao's ``precompute_float8_dynamic_scale_for_fsdp``) instead of one per weight inside each
    unit's all-gather: after every optimizer step, and before the first step of a run (fresh or
    resumed; the scales are not checkpointed). The precompute reduces over the weight's whole mesh;
    without it, torchao's all-gather takes the amax over the FSDP mesh only, i.e. per TP shard under
    TP x FSDP, so the first step of a run would scale differently from the rest."""

    def __init__(self, parts: Sequence[nn.Module]) -> None:
        self.parts = list(parts)
        self._ready = False

    def _precompute(self) -> None:
        from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

        for part in self.parts:
            precompute_float8_dynamic_scale_for_fsdp(part)
        self._ready = True

    def begin_step(self, _state: object) -> None:
        if not self._ready:
            self._precompute()

    def after_optimizer_step(self, _state: object) -> None:
        self._precompute()
