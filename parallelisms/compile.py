"""Per-block ``torch.compile``: applied before FSDP so each block compiles once and
FSDP's hooks stay outside the compiled graphs."""

from __future__ import annotations

from typing import cast

import torch
from torch import nn

from models.spec import ModelSpec


def apply_compile(model: nn.Module, spec: ModelSpec) -> nn.Module:
    """Compile each of the spec's repeated blocks in place (identical blocks share one graph)."""
    for name, block in spec.block_items(model):
        # compiling a Module gives a Module (torch's OptimizedModule); torch.compile is typed for functions
        spec.replace_block(model, name, cast(nn.Module, torch.compile(block, fullgraph=True)))
    return model
