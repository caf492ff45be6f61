"""The Qwen3 dense family: ``QWEN3_SPEC``, what the rest of the stack sees of it (``models/spec.py``).

``model.py`` holds the arguments (the modules, counts and TP plan are Llama's, with q/k head
norms and an explicit head size switched on); ``hf.py`` the Hugging Face adapter
(``Qwen3ForCausalLM``). The model never imports the adapter; this file joins the two.
"""

from __future__ import annotations

import dataclasses

from models.llama import LLAMA_SPEC
from models.qwen3.hf import Qwen3HF
from models.qwen3.model import Qwen3Args
from models.spec import ModelSpec

__all__ = ["QWEN3_SPEC", "Qwen3Args", "Qwen3HF"]

# Llama's spec (modules, counts, TP plan, planner terms) with Qwen3's args and HF adapter.
QWEN3_SPEC: ModelSpec = dataclasses.replace(LLAMA_SPEC, family="qwen3", args_cls=Qwen3Args, hf=Qwen3HF())
