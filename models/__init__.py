"""Model families, each a module defining a ``ModelSpec`` (see ``models/spec.py``).

``MODEL_SPECS`` is the table of families; a new family is one module plus one entry here.
"""

from __future__ import annotations

from models.deepseek_v3 import DEEPSEEK_V3_SPEC
from models.errors import ConfigError
from models.llama import LLAMA_SPEC
from models.moe import MOE_SPEC
from models.qwen3 import QWEN3_SPEC
from models.spec import ModelSpec

MODEL_SPECS: dict[str, ModelSpec] = {
    spec.family: spec for spec in (LLAMA_SPEC, MOE_SPEC, QWEN3_SPEC, DEEPSEEK_V3_SPEC)
}


def get_spec(family: str) -> ModelSpec:
    """The spec of ``family``; a ``ConfigError`` listing the known families otherwise."""
    if family not in MODEL_SPECS:
        raise ConfigError(
            f"model.family={family!r} is not a known model family; choose one of {sorted(MODEL_SPECS)}."
        )
    return MODEL_SPECS[family]


__all__ = ["MODEL_SPECS", "get_spec"]
