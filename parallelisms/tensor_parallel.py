"""Tensor parallel (Megatron-style), sequence parallel and loss parallel for any model family.

The plan is data kept beside the model (``ModelSpec.tp_plan``: module-name pattern -> abstract
kind); ``tp_plan`` turns it into torch ``ParallelStyle`` objects (seed article, section 5 "TP"),
applied by ``parallelize_module`` on the 1-D ``tp`` mesh. For the Llama family:

=====================  ==========================  ================================================
module                 style                       what it does
=====================  ==========================  ================================================
tok_embeddings         RowwiseParallel             weight sharded over the vocab; each rank looks up
                                                   its ids, zeros elsewhere, then a sum over tp
attention.wq/wk/wv     ColwiseParallel             n_heads / tp query and n_kv_heads / tp kv heads
attention.wo           RowwiseParallel             partial sums -> all_reduce (or reduce_scatter)
feed_forward.w1/w3     ColwiseParallel             hidden F / tp columns
feed_forward.w2        RowwiseParallel             partial sums -> all_reduce (or reduce_scatter)
output                 ColwiseParallel             logits sharded over the vocab
=====================  ==========================  ================================================

A family's plan may also name ``shard_params`` (``ShardParamsParallel``: a module's per-head or
per-channel tensors sharded on dim 0 with the heads, e.g. a Gated DeltaNet's convolution kernels
and decay vectors, models/qwen3_5), ``head_norm`` (a per-head norm on the local heads),
``replicate``, ``sum_grad`` and ``moe_io`` (below).

The local head counts need no bookkeeping: ``Attention`` reads them from the (local) shapes
of ``wq/wk`` outputs, so column sharding leaves ``n_heads // tp`` and ``n_kv_heads // tp``
heads per rank; ``repeat_kv`` keeps query head j on kv head j // n_rep inside any contiguous
slice of heads, hence grouped-query attention stays correct.

Sequence parallel (``sequence_parallel=True``) keeps the residual stream sharded along the
sequence (``Shard(1)``) between the TP regions: the norms run on S / tp tokens
(``SequenceParallel``), ``PrepareModuleInput`` all-gathers the sequence on entry to attention
and the FFN (the article's f), and ``wo/w2`` reduce-scatter (g) instead of all-reducing. The
communicated bytes are the same; the activations outside the TP regions shrink by tp.

Loss parallel (``loss_parallel=True``) keeps the logits a DTensor sharded on the vocab; the
trainer then computes cross-entropy inside ``torch.distributed.tensor.parallel.loss_parallel()``
(one all-reduce of a (B, S) field instead of all-gathering (B, S, V) logits). Without it the
head all-gathers and returns plain full logits.
"""

from __future__ import annotations

import os
import re
import warnings
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import (
    DTensor,
    Placement,
    Replicate,
    Shard,
    distribute_module,
    distribute_tensor,
)
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch.distributed.tensor.parallel.style import ParallelStyle

from models.spec import ModelSpec
from parallelisms.config import ParallelismConfig

__all__ = [
    "ReplicateParallel",
    "ShardParamsParallel",
    "SumGradParallel",
    "apply_tp",
    "check_tp_fits_node",
    "keep_gradients_sharded",
    "tp_kinds",
    "tp_plan",
    "tp_shard_dim",
]


class ReplicateParallel(ParallelStyle):
    """Replicate a module's parameters over the tp mesh and run it on replicated inputs.

    Used for the norms when sequence parallel is off: they compute on the full (replicated)
    residual stream, the same on every rank. Making their weights ``Replicate`` DTensors keeps
    every parameter of the model a DTensor on the same tp mesh, so FSDP turns all of them into
    2-D DTensors and the gradient norm is one DTensor reduction (no mix of plain tensors and
    DTensors). Input and output stay plain tensors for the caller.
    """

    @staticmethod
    def _replicate_params(name: str, module: nn.Module, mesh: DeviceMesh) -> None:
        for p_name, param in list(module.named_parameters(recurse=False)):
            # Values are written later by init_weights (copy_full_into); from_local just wraps.
            dparam = DTensor.from_local(param.data, mesh, [Replicate()], run_check=False)
            module.register_parameter(p_name, nn.Parameter(dparam, param.requires_grad))

    @staticmethod
    def _prepare_input(module: nn.Module, inputs: tuple[Any, ...], mesh: DeviceMesh) -> tuple[Any, ...]:
        x = inputs[0]
        if not isinstance(x, DTensor):
            x = DTensor.from_local(x, mesh, [Replicate()], run_check=False)
        return (x, *inputs[1:])

    @staticmethod
    def _prepare_output(module: nn.Module, output: Any, mesh: DeviceMesh) -> Any:
        return output.to_local() if isinstance(output, DTensor) else output

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(
            module,
            device_mesh,
            self._replicate_params,
            # torch annotates input_fn as returning None, yet installs it as a forward pre-hook and
            # uses the inputs it returns (as its own parallel styles do)
            self._prepare_input,  # type: ignore[arg-type]
            self._prepare_output,
        )


class ShardParamsParallel(ParallelStyle):
    """Shard every parameter of a module on dim 0 over the tp mesh (``Shard(0)``), for per-head or
    per-channel tensors that go with a column-parallel projection's heads: a linear-attention layer's
    convolution kernels (channels x 1 x K) and per-head decay vectors. The module reads its local
    rows (its inputs are the column-parallel projections' local outputs), so its gradient is local
    too; inputs and outputs pass unchanged."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def shard(_name: str, mod: nn.Module, mesh: DeviceMesh) -> None:
            for name, param in list(mod.named_parameters(recurse=False)):
                sharded = nn.Parameter(distribute_tensor(param, mesh, [Shard(0)]), param.requires_grad)
                mod.register_parameter(name, sharded)

        return distribute_module(module, device_mesh, shard)


class _AllReduceGrad(torch.autograd.Function):
    """Identity forward; backward all-reduces the gradient over the tp group (Megatron's f)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class SumGradParallel(ParallelStyle):
    """For a parameterless pass-through module whose output every rank's heads use (MLA's shared RoPE
    key, ``rope_key``): forward unchanged, backward sums the gradient over tp, since each rank's heads
    contribute only their part of it."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        group = device_mesh.get_group()
        module.register_forward_hook(lambda _m, _inputs, out: _AllReduceGrad.apply(out, group))
        return module


def _style(kind: str, *, sequence_parallel: bool, loss_parallel: bool) -> ParallelStyle:
    """The torch ``ParallelStyle`` for one abstract kind of a model's TP plan (``ModelSpec.tp_plan``)."""
    # Layout of the residual stream between TP regions: sequence-sharded under SP.
    stream: Placement = Shard(1) if sequence_parallel else Replicate()
    if kind == "embedding":  # vocab-sharded lookup, summed (or reduce-scattered) over tp
        return RowwiseParallel(input_layouts=Replicate(), output_layouts=stream)
    if kind == "norm":
        return SequenceParallel() if sequence_parallel else ReplicateParallel()
    if kind == "gather_input":
        # Gather the sequence of the block's input x (f). Keyword inputs (the rotary cache,
        # positions) pass through as plain tensors. Also without SP, x enters as ONE
        # replicated DTensor shared by wq/wk/wv (w1/w3), so their partial input gradients add
        # up first and f costs one backward all_reduce, not three.
        return PrepareModuleInput(input_layouts=(stream,), desired_input_layouts=(Replicate(),))
    if kind == "colwise":
        return ColwiseParallel()
    if kind == "rowwise":  # partial sums -> all_reduce, or reduce_scatter under SP (g)
        return RowwiseParallel(output_layouts=stream)
    if kind == "head":
        logits: Placement = Shard(-1) if loss_parallel else Replicate()
        return ColwiseParallel(
            input_layouts=stream, output_layouts=logits, use_local_output=not loss_parallel
        )
    if kind == "replicate":
        return ReplicateParallel()
    if kind == "sum_grad":  # a tensor shared by the heads of every rank: all-reduce its gradient
        return SumGradParallel()
    if kind == "shard_params":  # per-head / per-channel tensors of the local heads: Shard(0)
        return ShardParamsParallel()
    if kind == "head_norm":  # per-head norm (qk-norm) on this rank's heads: weight replicated
        return SequenceParallel(sequence_dim=2, use_local_output=True)
    if kind == "moe_io":
        # A token-wise module run replicated inside the tp group (MoE: experts are expert-
        # parallel over the data axes instead): gather the tokens on entry (f) and keep this
        # rank's share of the residual stream on exit (a local slice; all-gather in backward).
        return PrepareModuleInputOutput(
            input_layouts=(stream,),
            desired_input_layouts=(Replicate(),),
            use_local_input=True,
            output_layouts=(Replicate(),),
            desired_output_layouts=(stream,),
            use_local_output=True,
        )
    raise ValueError(f"unknown tensor-parallel style {kind!r} in the model's TP plan")


def tp_shard_dim(kind: Optional[str], module: nn.Module, param: str) -> Optional[int]:
    """The dim on which the style of ``kind`` (``_style``) shards ``module``'s own parameter ``param`` over
    tp (its ``Shard(dim)``); None where it replicates it or leaves it a plain tensor. What reads the
    plan's placements without applying it (the planner) reads them here. Torch's ``ColwiseParallel``
    (``colwise``, ``head``) shards a Linear's output features (weight and bias dim 0) and an Embedding's
    features (dim 1); ``RowwiseParallel`` (``rowwise``, ``embedding``) a Linear's input features (weight
    dim 1; its bias is replicated) and an Embedding's vocabulary (dim 0); ``ShardParamsParallel``
    (``shard_params``) every parameter on dim 0. The other kinds replicate a module's parameters or
    leave them as they are."""
    if kind == "shard_params":
        return 0
    colwise = kind in ("colwise", "head")
    if not colwise and kind not in ("rowwise", "embedding"):
        return None
    if isinstance(module, nn.Embedding):
        return 1 if colwise else 0
    if param == "bias":
        return 0 if colwise else None
    return 0 if colwise else 1


def tp_kinds(model: nn.Module, spec: ModelSpec) -> dict[str, str]:
    """The model's TP plan expanded for ``model`` (possibly a pipeline stage): module name -> kind.

    ``spec.tp_plan`` maps name patterns (``*`` = a block key) to abstract kinds; only modules
    present in ``model`` get an entry (a stage may lack the embedding, the head or some blocks).
    The only copy of the wildcard expansion: ``tp_plan`` and the planner's parameter table use it.
    """
    keys = [key for key, _ in spec.block_items(model)]
    names = [name for name, _ in model.named_modules()]
    present = set(names)
    kinds: dict[str, str] = {}
    for pattern, kind in spec.tp_plan.items():
        if pattern.startswith(f"{spec.blocks}.*"):  # block patterns: in block order
            candidates = [pattern.replace("*", key) for key in keys]
        elif "*" in pattern:  # other containers (MTP modules): "*" is one name component
            regex = re.compile(re.escape(pattern).replace(r"\*", r"[^.]+"))
            candidates = [name for name in names if regex.fullmatch(name)]
        else:
            candidates = [pattern]
        for name in candidates:
            if name in present:
                kinds[name] = kind
    return kinds


def tp_plan(
    model: nn.Module, spec: ModelSpec, *, sequence_parallel: bool = True, loss_parallel: bool = True
) -> dict[str, ParallelStyle]:
    """The model's TP plan resolved for ``model`` (possibly a pipeline stage): module name -> style."""
    return {
        name: _style(kind, sequence_parallel=sequence_parallel, loss_parallel=loss_parallel)
        for name, kind in tp_kinds(model, spec).items()
    }


def apply_tp(
    model: nn.Module,
    spec: ModelSpec,
    tp_mesh: DeviceMesh,
    cfg: ParallelismConfig,
    *,
    device_type: str = "cpu",
) -> nn.Module:
    """Shard ``model`` (usually still on meta) over the 1-D ``tp_mesh`` by the spec's plan.

    Parameters become DTensors on ``tp_mesh``; FSDP applied afterwards makes them 2-D
    (``dp_shard_cp`` x ``tp``). ``cfg.async_tp`` turns on Inductor's micro-pipelined TP (CUDA,
    ``torch.compile`` and sequence parallel required; checked by ``ParallelDims``).
    """
    check_tp_fits_node(tp_mesh.size(), device_type)
    plan = tp_plan(model, spec, sequence_parallel=cfg.sequence_parallel, loss_parallel=cfg.loss_parallel)
    parallelize_module(model, tp_mesh, plan)
    replicate_uncovered(model, tp_mesh)
    # The embedding (Rowwise) and the head (Colwise) both shard the (V, H) weight on dim 0, so
    # a tied weight keeps one placement; parallelize_module replaced each Parameter separately.
    tie = getattr(model, "tie_weights", None)
    if tie is not None:
        tie()
    if cfg.async_tp:
        # Inductor rewrites the all_gather -> matmul and matmul -> reduce_scatter pairs of
        # sequence parallel into chunked, overlapped ops over symmetric memory.
        import torch._inductor.config as inductor_config
        from torch.distributed._symmetric_memory import enable_symm_mem_for_group

        inductor_config._micro_pipeline_tp = True
        enable_symm_mem_for_group(tp_mesh.get_group().group_name)
    return model


def replicate_uncovered(model: nn.Module, tp_mesh: DeviceMesh) -> None:
    """Make every parameter the plan left a plain tensor a ``Replicate`` DTensor on the tp mesh.

    Such parameters belong to modules that run replicated inside the tp group on gathered inputs and
    read their weights locally (the stacked experts of an MoE layer without expert parallelism,
    ``moe_io``): every tp rank computes the same gradient, so Replicate is exact, and every parameter
    is then a DTensor on the same mesh (the optimizer's foreach kernels and the grad norm need that).
    Expert parallelism, applied later, replaces the expert weights with its own shards."""
    for module in model.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            if not isinstance(param, DTensor):
                dparam = DTensor.from_local(param.data, tp_mesh, [Replicate()], run_check=False)
                module.register_parameter(name, nn.Parameter(dparam, param.requires_grad))


def keep_gradients_sharded(model: nn.Module) -> None:
    """Give each sharded parameter's gradient the parameter's own placement as soon as it is
    accumulated, when the gradient came back replicated.

    torch's vocab-sharded embedding (``RowwiseParallel`` on ``nn.Embedding``) returns a Replicate
    gradient for its Shard(0) weight: the whole table's gradient would sit on every tp rank until
    the optimizer step (found by the communication/memory ledger: +(tp-1)/tp of the embedding per
    rank). Replicate -> Shard is a local slice: no communication, the full gradient is freed at
    once. Call after the parameters are materialised (hooks live on the Parameter objects);
    FSDP handles its own gradients and does not need it.
    """
    for p in model.parameters():
        if isinstance(p, DTensor) and any(isinstance(pl, Shard) for pl in p.placements):
            p.register_post_accumulate_grad_hook(_reshard_replicated_grad)


def _reshard_replicated_grad(param: torch.Tensor) -> None:
    grad = param.grad
    if (
        isinstance(param, DTensor)  # true: the hook is registered on DTensor parameters only
        and isinstance(grad, DTensor)
        and grad.placements != param.placements
        and all(isinstance(pl, Replicate) for pl in grad.placements)
    ):
        param.grad = grad.redistribute(param.device_mesh, param.placements)


def check_tp_fits_node(tp: int, device_type: str) -> None:
    """Warn when tp exceeds one node's GPUs: its collectives would then cross the network
    on the critical path (article: "TP 只在 NVLink 范围内做"). GPU runs only."""
    if device_type != "cuda" or tp <= 1:
        return
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "0")) or torch.cuda.device_count()
    if local and tp > local:
        warnings.warn(
            f"parallelism.tp={tp} exceeds the {local} GPUs of one node: tensor-parallel collectives "
            f"(4 per layer per step, on the critical path) would cross nodes. Use tp <= {local} and "
            f"put the remaining degree into dp_shard / dp_replicate / pp.",
            stacklevel=2,
        )
