"""A trained model for inference: from a ``step-N`` checkpoint or an exported Hugging Face folder.

``load_model`` builds the family's plain model (one process, no parallelism) with the full
weights in fp32, in eval mode, and the tokenizer the folder names. Used by
``python -m trainer.generate`` and the tests that compare against transformers.
"""

from __future__ import annotations

import json
import os
from typing import Optional, Protocol, cast

import torch
from torch import nn

from models import get_spec
from models.errors import ConfigError
from models.spec import ModelArgs, ModelSpec
from trainer.checkpoint.checkpointer import MARKER, load_full_state, read_marker, verify_files
from trainer.checkpoint.hf import CONFIG_FILE, MESHWRIGHT_FILE, read_hf
from trainer.data.tokenizer import Tokenizer, build_tokenizer

__all__ = ["load_model"]


class _RopeModel(Protocol):
    """Every family's model: its rotary cache, computed again after ``to_empty``."""

    def reset_rope_cache(self, device: Optional[torch.device] = None) -> None: ...


def _build(
    spec: ModelSpec, args: ModelArgs, state: dict[str, torch.Tensor], device: torch.device
) -> nn.Module:
    with torch.device("meta"):
        model = spec.build(args)
    model.to_empty(device=device)
    cast(_RopeModel, model).reset_rope_cache(device)
    missing = sorted(set(model.state_dict()) - set(state))
    if missing:
        raise ConfigError(f"the weights lack {missing[0]!r} ({len(missing)} tensors missing).")
    model.load_state_dict({k: v.to(torch.float32) for k, v in state.items()}, strict=True)
    return model.eval()


def load_model(path: str, device: str | torch.device = "cpu") -> tuple[nn.Module, Optional[Tokenizer]]:
    """(model in eval mode, tokenizer or None) from a ``step-N`` checkpoint or a HF model folder."""
    device = torch.device(device)
    if os.path.isfile(os.path.join(path, MARKER)):
        info = read_marker(path)
        verify_files(path, info)
        spec = get_spec(info["model"].get("family", "llama"))
        model = _build(spec, spec.make_args(info["model"]), load_full_state(path, "model."), device)
        tokenizer = info.get("tokenizer", "byte")
    elif os.path.isfile(os.path.join(path, CONFIG_FILE)):
        model_spec, args, state = read_hf(path)
        model = _build(model_spec, args, state, device)
        tokenizer = None
        extra_path = os.path.join(path, MESHWRIGHT_FILE)
        if os.path.isfile(extra_path):
            with open(extra_path, encoding="utf-8") as f:
                tokenizer = json.load(f).get("tokenizer")
        elif os.path.isfile(os.path.join(path, "tokenizer.json")):
            tokenizer = "tokenizer.json"
        if tokenizer not in (None, "byte"):
            tokenizer = os.path.join(path, tokenizer)
    else:
        raise ConfigError(
            f"{path} is neither a meshwright checkpoint (no {MARKER}) nor a Hugging Face folder (no "
            f"{CONFIG_FILE}); pass e.g. outputs/debug/checkpoints/step-300."
        )
    return model, (build_tokenizer(tokenizer) if tokenizer else None)
