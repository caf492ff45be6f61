"""The model spec: everything the rest of the stack needs to know about a model family.

Each family (a package ``models/<family>/``: ``model.py``, ``hf.py``, and its ``__init__.py`` joining
them) defines one ``ModelSpec``, listed in ``models/__init__.py``'s ``MODEL_SPECS``. The trainer picks
it with ``get_spec(model.family)``; ``parallelisms/`` receives the spec and never a concrete model
class, so a new family plugs in without touching any strategy:

- ``args_cls`` / ``model_cls``: the typed args (also the Hydra schema of the family's presets)
  and the ``nn.Module`` built from them (on meta, then ``init_weights(init)``);
- ``param_counts`` / ``flops_per_token``: analytic counts from args alone (total and active
  parameters; training FLOPs per token), used for logs, MFU and the planner;
- ``blocks`` / ``first_modules`` / ``last_modules``: the name of the ``ModuleDict`` of repeated
  blocks (the unit of FSDP, activation checkpointing, compile and pipeline splitting) and the
  modules that go with the first and the last pipeline stage;
- ``tp_plan``: module-name pattern -> abstract style (``colwise``, ``rowwise``, ...), data that
  ``parallelisms/tensor_parallel.py`` turns into torch ``ParallelStyle`` objects;
- ``tp_divisible``: the sizes tensor parallelism must divide (head counts, hidden sizes, vocab);
- ``hf``: the Hugging Face adapter (config conversion through the shared ``models/hf_config.py`` and
  a per-format table, tensor-name mapping);
- optional features, declared here rather than probed on the args: ``moe_layers`` /
  ``expert_modules`` (a mixture-of-experts family's routed layers and stacked experts, for expert
  parallel, FSDP and the planner; ``has_experts`` / ``num_experts(args)``), ``ties_embeddings(args)``
  and ``attention_mask(args)`` (both with the dense, untied, causal answer as the default), and
  ``mtp_depth(args)`` (multi-token-prediction modules, 0 by default; DeepSeek-V3),
  ``batch_inputs(args, inputs, labels, positions)`` (the family's extra keyword inputs of a training
  window, e.g. MTP's shifted ids and targets: the model's one call is
  ``model(tokens, positions=..., **extras)``), and
  ``qk_norm(args)`` (per-head q/k RMSNorms before RoPE, off by default; Qwen3, Qwen3-MoE, a Llama
  that asks for them), ``qk_clip`` (whether the attention supports QK-clip), ``lr_scale(args)``
  (µP's per-parameter factors of the LR; None, every factor 1, by default),
  ``generation_cores(model, max_len)`` (the cache each token mixer's core is swapped for during
  generation: KV caches by default, a recurrent state for linear attention; Qwen3.5), and
  ``sequential_state`` (whether token mixers carry a state along the sequence, ``RecurrentCore``s of
  ``models/attention.py``: context parallelism hands it from rank to rank, which needs contiguous slices
  in rank order, i.e. ``cp_load_balance=none`` and the all-gather implementation; Qwen3.5);
- ``planner_terms(args)``: the planner's view of the family's blocks (``PlannerTerms``): what the
  attention moves under CP / TP beyond the plan's kinds (``AttentionComm``) and what a block saves
  for backward per token (the family's own arithmetic, from a ``BlockLayout``), so that
  ``trainer/planner/`` never probes the args.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Optional, Protocol, cast

import torch
from torch import nn

from models.attention import attention_cache_cores

__all__ = [
    "AttentionComm",
    "AttentionShape",
    "BlockLayout",
    "ExpertGroups",
    "HFAdapter",
    "ModelArgs",
    "ModelSpec",
    "RecurrentMixerTerms",
    "ParamCounts",
    "PlannerTerms",
]


@dataclass
class ModelArgs:
    """Fields every family's args share: the preset name and the family that builds it."""

    name: str = "model"  # preset name, shown in logs and metrics
    family: str = ""  # set by each family's args class (e.g. "llama", "moe")

    def validate(self) -> None:  # pragma: no cover - every family overrides it
        """Raise ``ConfigError`` naming the bad value and the fix."""


@dataclass(frozen=True)
class ParamCounts:
    """Analytic parameter counts. ``active`` counts what one token touches (MoE: top-k experts)."""

    total: int
    active: int
    embedding: int  # token-embedding parameters (a lookup, not a matmul)


class DecoderArgs(Protocol):
    """The shape fields every family's args have (a new family's too): what ``parallelisms/`` and the
    trainer read of any family's args. A structural type rather than fields of ``ModelArgs``: fields
    declared on the base would come first in every family's dataclass, reordering its Hydra schema and
    its saved config.yaml."""

    @property
    def name(self) -> str: ...
    @property
    def family(self) -> str: ...
    @property
    def vocab_size(self) -> int: ...
    @property
    def dim(self) -> int: ...
    @property
    def n_layers(self) -> int: ...
    @property
    def n_heads(self) -> int: ...
    @property
    def kv_heads(self) -> int: ...  # key/value heads (grouped-query attention; n_heads without)
    @property
    def max_seq_len(self) -> int: ...


class ExpertArgs(DecoderArgs, Protocol):
    """The fields a mixture-of-experts family's args add (``ModelSpec.has_experts``), as expert
    parallelism and its load balancer read them."""

    @property
    def num_experts(self) -> int: ...  # routed experts per MoE layer
    @property
    def aux_loss_coeff(self) -> float: ...  # auxiliary load-balancing loss weight (0: off)
    @property
    def grouped_mm(self) -> str: ...  # auto | on | off
    def is_moe_layer(self, layer_id: int) -> bool: ...


class MoELayer(Protocol):
    """What expert parallelism and its load balancer (``parallelisms/expert_parallel.py``) use of a
    family's routed mixture-of-experts module (``ModelSpec.moe_layers``)."""

    # (rows sorted by expert, rows per expert, the stacked experts, rows per expert on the host when
    # the routing knows them, else None) -> rows; None: the local experts
    dispatcher: Optional[Callable[[torch.Tensor, torch.Tensor, nn.Module, Optional[list[int]]], torch.Tensor]]
    balanced_routing: bool  # copy j of a forward's token copies to expert j mod E (a rehearsal sets it)
    aux_grad_scale: Optional[float]  # weight of one forward's aux term per token (None: 1 per forward)
    step_records: list[torch.Tensor]  # one (E + 2,) row per forward of the current step

    def reset_stats(self) -> None: ...
    def step_stats(self, skip: int = 0) -> torch.Tensor: ...
    def update_bias(self, counts: torch.Tensor) -> None: ...


class MTPModel(Protocol):
    """What the trainer's multi-token-prediction hook (``trainer/observe/mtp.py``) uses of a model (or a
    pipeline stage of it) whose family has ``mtp_depth(args) > 0``: the forwards' recorded (D, 2) MTP
    losses and the weight and loss function of the MTP term in backward."""

    mtp_records: list[torch.Tensor]
    mtp_grad_scale: Optional[float]  # per token of the step (None: the forward's own tokens)
    mtp_loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (logits, labels) -> summed CE

    def reset_mtp_stats(self) -> None: ...


class StackedExperts(nn.Module):
    """Base class of a family's stacked routed experts (``ModelSpec.expert_modules``): every parameter
    holds the E experts on dim 0, which expert parallelism shards; ``grad_scale`` multiplies the
    weights' gradients (expert parallelism sets 1 / ep)."""

    grad_scale: float
    group_multiple: int  # > 1: the token groups are padded to a multiple of it (``pad_token_groups``)

    def pad_token_groups(self, multiple: int) -> None:
        """Run the experts as ``torch._grouped_mm`` calls (the op torchao's low-precision expert
        weights intercept) with every expert's token group padded with zero rows to a multiple of
        ``multiple`` (16 for float8 rowwise, 32 for MXFP8): called only when the experts convert."""
        raise NotImplementedError(f"{type(self).__name__} has no padded grouped-GEMM path")


class HFTensorReader(Protocol):
    """Reads slices of a Hugging Face folder's tensors (``trainer/checkpoint/hf.py``): what an
    adapter's ``read_slice`` gets, so that each rank reads only its shard."""

    def read(self, hf_name: str, index: tuple[slice, ...]) -> torch.Tensor: ...  # tensor[index]


class HFAdapter(Protocol):
    """Conversion between a family's args / tensor names and a Hugging Face architecture. The config
    side is one table per HF format, read and written by ``models/hf_config.py``."""

    @property
    def architecture(self) -> str: ...  # e.g. "LlamaForCausalLM" (of the main format)

    @property
    def model_type(self) -> str: ...  # config.json's model_type, e.g. "llama" (of the main format)

    @property
    def model_types(self) -> tuple[str, ...]: ...  # every model_type the adapter reads

    def to_hf_config(
        self, args: Any, *, bos_id: Optional[int], eos_id: Optional[int], dtype: str
    ) -> dict: ...

    def args_from_hf_config(self, cfg: dict[str, Any]) -> dict[str, Any]: ...

    def to_hf_state(
        self, state: dict[str, torch.Tensor], args: Any
    ) -> Iterator[tuple[str, torch.Tensor]]: ...

    def from_hf_state(self, hf_state: dict[str, torch.Tensor], args: Any) -> dict[str, torch.Tensor]: ...

    def hf_names_of(self, name: str, args: Any) -> list[str]: ...

    def full_shape(self, name: str, hf_shapes: list[list[int]], args: Any) -> list[int]: ...

    def read_slice(
        self, name: str, index: tuple[slice, ...], reader: HFTensorReader, args: Any
    ) -> torch.Tensor: ...

    # A folder's tensor name -> the name ``hf_names_of`` uses (the same for a folder of the adapter's
    # own architecture; a vision-language folder's text decoder is renamed), or None for a tensor the
    # model does not use by design (a vision tower): skipped, and named in the log.
    def folder_name(self, hf_name: str) -> Optional[str]: ...


def _untied(_args: Any) -> bool:
    return False


def _causal(_args: Any) -> str:
    return "causal"


def _no_mtp(_args: Any) -> int:
    return 0


def _no_mtp_flops(_args: object, _seq_len: int) -> int:
    return 0


def _no_inputs(
    _args: Any, _inputs: torch.Tensor, _labels: torch.Tensor, _positions: Optional[torch.Tensor]
) -> dict[str, torch.Tensor]:
    return {}


def _no_qk_norm(_args: Any) -> bool:
    return False


def _no_lr_scale(_args: ModelArgs) -> Optional[Callable[[str, int], float]]:
    return None


def _any_device(_args: ModelArgs, _device_type: str) -> None:
    return None


@dataclass(frozen=True)
class AttentionComm:
    """What an attention layer communicates beyond the TP plan's kinds (the planner's ``PlannerTerms.comm``).

    ``cp_gather_dim``: numbers per token all-gathered over cp (Llama: K and V of the kv heads, 2 x
    n_kv_heads x head_dim; MLA: the latent, kv_lora_rank + qk_rope_head_dim). ``tp_entry_partial``:
    whether the gradient of the attention input comes back as partial sums over tp (a column-wise
    projection reads it directly: reduce-scatter under SP, all-reduce without), or complete (only
    replicated modules read it: a local slice). ``tp_backward_all_reduces``: the all-reduces over tp
    in backward inside the attention, one per entry: (numbers per token, what the reduced gradient's
    tensor is: ``"norm"``, a norm's output, in the residual stream's dtype; ``"matmul"``, a matmul's
    output, in the compute dtype) (MLA: the query and KV latents fed to the column-wise
    up-projections after their norms, and the shared RoPE key off ``wkv_a``)."""

    cp_gather_dim: int
    tp_entry_partial: bool = True
    tp_backward_all_reduces: tuple[tuple[int, str], ...] = ()
    # Saved-activation numbers per token of the attention's projections, when they differ from
    # Llama's (q, k, v and the output projection's input, H each): (split by tp: per-head tensors,
    # not split: latents computed on the whole sequence by replicated modules); None = Llama's. Read by the
    # seed article's per-layer rule (``trainer/planner/activations.py``'s ``layer_activation_bytes``).
    saved: Optional[tuple[int, int]] = None


@dataclass(frozen=True)
class ExpertGroups:
    """Low-precision stacked experts as the planner's precision term sees them
    (``trainer/planner/low_precision.py``): the experts run as grouped GEMMs over each expert's token
    group padded with zero rows to a multiple of ``multiple`` (``StackedExperts.pad_token_groups``);
    torchao's grouped GEMM saves its input rows as they come (``rows_in`` bytes: the MoE input's dtype,
    padded) and returns ``out``-byte outputs. ``tokens``: the local tokens of one microbatch the MoE
    layer routes; ``ep``: the expert-parallel degree (the rank runs num_experts / ep experts)."""

    multiple: int
    out: int
    rows_in: int
    tokens: int
    ep: int = 1


@dataclass(frozen=True)
class BlockLayout:
    """How one rank runs a block, as far as a family's saved-activation arithmetic needs it
    (``PlannerTerms``); the planner derives it from the layout and its dtype policy."""

    tp: int  # tensor-parallel degree: heads and hidden sizes are split by it
    cp: int  # context-parallel degree: gathered keys and values (latents) cover cp x the local tokens
    compute: int  # bytes of a matmul or attention output (2 under bf16 autocast or bf16 FSDP params, else 4)
    cast_each: bool  # bf16 autocast over an fp32 stream: each matmul saves its own bf16 cast of its input
    keys: int  # key positions each query sees (the training sequence, the whole of it under CP)
    # SDPA has a fused kernel for q/k head sizes unlike v's (CUDA's memory-efficient attention); on CPU
    # (gloo) torch runs its math path instead, which saves other tensors
    fused_attention: bool
    # the attention kernel takes grouped K/V heads as they are, without the repeat copy to n_heads
    # (FlexAttention, which the GPU runs for masked attention: block-causal documents, context parallel)
    grouped_kv: bool = False
    experts: Optional[ExpertGroups] = None  # the stacked experts in low precision (None: high precision)
    autocast: bool = False  # bf16 autocast is on (over any stream, bf16 FSDP parameters too): matmuls in bf16


@dataclass(frozen=True)
class AttentionShape:
    """The attention's heads as Llama's rules count them: the seed article's per-layer rule and the
    op-level selective-checkpointing cache (``trainer/planner/activations.py``). ``head_dim``: the q/k/v
    projections' head size (MLA, which has none: dim / n_heads)."""

    n_heads: int
    kv_heads: int
    head_dim: int
    qk_norm: bool = False  # per-head q/k RMSNorms (Qwen3)


@dataclass(frozen=True)
class RecurrentMixerTerms:
    """The planner's view of a recurrent token mixer (linear attention: Qwen3.5's Gated DeltaNet), on
    the blocks that have one instead of softmax attention (``PlannerTerms.recurrent_blocks``).

    ``saved(layout)``: what the mixer saves for backward per local token, by term, after the block's
    input norm (which feeds ``norm_consumers`` matmuls); no rotary rows. ``cp_handoff(compute)``: the
    all-gathers of the context-parallel hand-off per layer and forward (``RecurrentCore`` with a
    ``StateHandoff``), as (what, bytes per sequence of one rank's input) for each call, given the
    compute dtype's bytes; each is reduce-scattered back in backward."""

    saved: Callable[[BlockLayout], dict[str, float]]
    norm_consumers: int
    cp_handoff: Callable[[int], list[tuple[str, float]]]


def _swiglu_consumers(moe: bool) -> int:
    return 2


@dataclass(frozen=True)
class PlannerTerms:
    """The planner's view of a family's blocks (``ModelSpec.planner_terms(args)``): the family's own
    numbers and arithmetic; the generic parts (the blocks' input norms, the rotary rows, the dtype
    policy, checkpointing, schedules, collectives) stay in ``trainer/planner/``.

    ``attention_saved(layout)``: what the attention saves for backward per local token, by term, after
    its input norm (that norm feeds ``attention_norm_consumers`` matmuls). ``ffn_saved(layout, moe)``:
    the same for the feed-forward after its norm; ``moe``: the block is one of the spec's
    ``moe_layers`` (the planner's parameter table knows which; an MTP block never is).
    ``expert_padding_flops(groups)``: the forward matmul FLOPs one MoE layer's padding rows add per
    microbatch when the experts run padded (``ExpertGroups``; the family's own static bound)."""

    comm: AttentionComm  # what the attention moves under CP / TP beyond the plan's kinds
    shape: AttentionShape
    rope_dim: int  # rotary size: the rows gathered per token when positions are passed; the table's width
    ffn_hidden_dim: int  # the dense SwiGLU's hidden size (MoE families: their dense layers and MTP blocks)
    attention_saved: Callable[[BlockLayout], dict[str, float]]
    ffn_saved: Callable[[BlockLayout, bool], dict[str, float]]
    attention_norm_consumers: int = 3  # matmuls the attention's input norm feeds (Llama: wq, wk, wv)
    # matmuls the feed-forward's input norm feeds, by ``moe`` (Llama: w1, w3; an MoE layer: its router
    # and shared experts -- the routed experts read gathered rows, not the norm's output)
    ffn_norm_consumers: Callable[[bool], int] = _swiglu_consumers
    experts_per_token: int = 0  # routed copies of each token (top_k); 0 without experts
    # Hybrid families: the blocks whose token mixer is recurrent (``recurrent``) rather than attention
    recurrent: Optional[RecurrentMixerTerms] = None
    # the blocks' and the final RMSNorms keep their normalised input in fp32 (a zero-centred fp32 gain
    # 1 + w multiplies it before the cast: Qwen3.5), not in the stream's dtype (Llama's RMSNorm)
    norm_normed_fp32: bool = False
    recurrent_blocks: frozenset[int] = frozenset()
    expert_padding_flops: Optional[Callable[[ExpertGroups], float]] = None  # None: no padded expert path


@dataclass(frozen=True)
class ModelSpec:
    """A model family, as the rest of the stack sees it (see the module docstring)."""

    family: str
    args_cls: type[ModelArgs]
    model_cls: type[nn.Module]
    param_counts: Callable[[Any], ParamCounts]
    flops_per_token: Callable[[Any, int], int]
    tp_plan: dict[str, str]
    tp_divisible: Callable[[Any], dict[str, int]]
    hf: Optional[HFAdapter] = None
    blocks: str = "layers"
    first_modules: tuple[str, ...] = ("tok_embeddings",)
    last_modules: tuple[str, ...] = ("norm", "output")
    moe_layers: Optional[Callable[[nn.Module], Sequence[tuple[str, MoELayer]]]] = None
    expert_modules: Optional[Callable[[nn.Module], Sequence[StackedExperts]]] = None
    ties_embeddings: Callable[[Any], bool] = _untied
    attention_mask: Callable[[Any], str] = _causal
    mtp_depth: Callable[[Any], int] = _no_mtp  # multi-token-prediction modules (0: none)
    # the share of ``flops_per_token`` that the MTP modules and their passes through the head take
    # (activation checkpointing wraps the blocks only: that share is never recomputed)
    mtp_flops_per_token: Callable[..., int] = _no_mtp_flops  # (args, seq_len)
    # The family's extra keyword inputs of a TRAINING window (B, S, ...), built on the whole window
    # before context parallelism splits it (DeepSeek-V3: MTP's shifted ids and targets); the model is
    # called ``model(tokens, positions=..., **extras)`` for training, evaluation and pipeline stages.
    batch_inputs: Callable[
        [Any, torch.Tensor, torch.Tensor, Optional[torch.Tensor]], dict[str, torch.Tensor]
    ] = _no_inputs
    qk_norm: Callable[[Any], bool] = _no_qk_norm  # per-head RMSNorm of q and k before RoPE (Qwen3)
    # The planner's view of the blocks (its traffic and saved activations); None: the planner refuses
    planner_terms: Optional[Callable[[Any], PlannerTerms]] = None
    # Whether the blocks' attention records per-head max logits and has per-head wq / wk rows to
    # scale (QK-clip, ``optimizer.qk_clip_tau``): Llama's attention (MoE, Qwen3) does; MLA does not yet.
    qk_clip: bool = True
    # Per-parameter factors of optimizer.lr (µP, ``model.mup``): (args) -> None (every factor 1) or a
    # function (parameter name as the model names it, its ndim) -> factor
    lr_scale: Callable[[ModelArgs], Optional[Callable[[str, int], float]]] = _no_lr_scale
    # (module, generation core) for each token mixer of a model (``models/generation.py`` swaps
    # ``module.core`` for it); default: the attention layers' KV caches.
    generation_cores: Callable[[nn.Module, int], list[tuple[nn.Module, nn.Module]]] = attention_cache_cores
    # Token mixers carrying a state along the sequence (RecurrentCore): CP needs contiguous slices
    sequential_state: bool = False
    # (args, the run's device type) -> None, or ConfigError for options this device cannot run (an
    # optional kernel forced without its device or package); the trainer calls it before any collective
    device_check: Callable[[ModelArgs, str], None] = _any_device

    @property
    def has_experts(self) -> bool:
        """Whether the family has mixture-of-experts layers (``moe_layers`` and ``expert_modules``)."""
        return self.moe_layers is not None

    def num_experts(self, args: ModelArgs) -> int:
        """Routed experts per MoE layer; 0 for a dense family."""
        return expert_args(args).num_experts if self.has_experts else 0

    def build(self, args: ModelArgs) -> nn.Module:
        """The model for ``args`` (call under ``torch.device("meta")`` to allocate nothing)."""
        return self.model_cls(args)

    def block_items(self, model: nn.Module) -> list[tuple[str, nn.Module]]:
        """The repeated blocks of ``model`` (or a pipeline stage of it) as (key, module), in order."""
        container = getattr(model, self.blocks, None)
        return list(container.items()) if container is not None else []

    def replace_block(self, model: nn.Module, key: str, module: nn.Module) -> None:
        """Swap one block (e.g. for its checkpoint-wrapped or compiled version)."""
        getattr(model, self.blocks).register_module(key, module)

    def make_args(self, fields: dict[str, Any]) -> ModelArgs:
        """``args_cls`` from a plain dict (e.g. a checkpoint marker or ``asdict``); unknown keys are
        dropped and nested dataclass fields (``rope_scaling``) rebuilt from their dicts."""
        return _from_dict(self.args_cls, fields)

    def module_names(self, args: ModelArgs) -> list[str]:
        """Every top-level unit in forward order, e.g. ``tok_embeddings, layers.0, ..., norm, output``."""
        return [
            *self.first_modules,
            *(f"{self.blocks}.{i}" for i in range(decoder_args(args).n_layers)),
            *self.last_modules,
        ]


def _from_dict(cls: type, values: dict[str, Any]) -> Any:
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if f.name not in values:
            continue
        value = values[f.name]
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        if dataclasses.is_dataclass(default) and isinstance(value, dict):
            value = _from_dict(type(default), value)
        kwargs[f.name] = value
    return cls(**kwargs)


def decoder_args(args: ModelArgs) -> DecoderArgs:
    """``args`` (a family's args class: e.g. a config's ``model``) with the shape fields every family has."""
    return cast(DecoderArgs, args)


def expert_args(args: ModelArgs) -> ExpertArgs:
    """``args`` of a family with experts (``ModelSpec.has_experts``) with the fields those families add."""
    return cast(ExpertArgs, args)


def args_of(model: nn.Module) -> ModelArgs:
    """The args ``model`` (a whole model or a pipeline stage of it) was built from: every family's
    model keeps them as ``model.args`` (``ModelSpec.build``)."""
    return cast(ModelArgs, model.args)
