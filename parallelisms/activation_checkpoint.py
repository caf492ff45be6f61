"""Activation checkpointing: trade recomputation for activation memory.

Modes (``training.activation_checkpoint``):

- ``none``      keep every activation.
- ``full``      wrap every block: only block inputs are saved, everything inside is
                recomputed in backward (~1/3 more compute; the seed article's 7B case).
- ``selective`` either every k-th block is fully checkpointed (``ac_selective=layer``,
  ``k = ac_layer_interval``), or every block is op-level checkpointed
  (``ac_selective=op``): outputs of matmuls and attention are saved, the cheap
  element-wise ops (norms, SiLU, RoPE, residual adds) are recomputed.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from models.errors import ConfigError
from models.spec import ModelSpec

# Ops whose outputs are expensive to recompute: keep them.
_SAVE_OPS = {
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_cudnn_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
}
if (
    torch.backends.mkldnn.is_available()
):  # the linears' GEMM under training.cpu_gemm=onednn (models/cpu_gemm.py)
    _SAVE_OPS.add(torch.ops.mkldnn._linear_pointwise.default)


def _save_matmuls(ctx, op, *args, **kwargs) -> CheckpointPolicy:  # noqa: ANN001
    return CheckpointPolicy.MUST_SAVE if op in _SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _op_level_context():  # noqa: ANN202
    return create_selective_checkpoint_contexts(_save_matmuls)


def apply_ac(
    model: nn.Module, spec: ModelSpec, mode: str, *, selective: str = "layer", layer_interval: int = 2
) -> nn.Module:
    """Wrap the spec's repeated blocks in place according to ``mode`` (see the module docstring)."""
    if mode == "none":
        return model
    if mode not in ("full", "selective"):
        raise ConfigError(f"training.activation_checkpoint={mode!r} is not one of none, full, selective.")
    if mode == "selective" and selective not in ("layer", "op"):
        raise ConfigError(f"training.ac_selective={selective!r} is not one of layer, op.")
    if layer_interval < 1:
        raise ConfigError(f"training.ac_layer_interval={layer_interval} must be >= 1.")
    for i, (name, block) in enumerate(spec.block_items(model)):
        if mode == "full" or (selective == "layer" and i % layer_interval == 0):
            wrapped = checkpoint_wrapper(block, preserve_rng_state=False)
        elif selective == "op":
            wrapped = checkpoint_wrapper(block, preserve_rng_state=False, context_fn=_op_level_context)
        else:
            continue
        spec.replace_block(model, name, wrapped)
    return model


__all__ = ["apply_ac"]
