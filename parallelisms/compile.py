"""Per-block ``torch.compile``: applied before FSDP so each block compiles once and
FSDP's hooks stay outside the compiled graphs."""

from __future__ import annotations

import torch
from torch import nn


def apply_compile(model: nn.Module) -> nn.Module:
    """Compile each transformer block in place (the blocks are identical, so Dynamo
    reuses one graph for all of them)."""
    for name, block in list(model.layers.items()):
        model.layers.register_module(name, torch.compile(block, fullgraph=True))
    return model
