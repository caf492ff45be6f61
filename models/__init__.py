"""Model families, each a package defining a ``ModelSpec`` (see ``models/spec.py``).

``MODEL_SPECS`` is the table of families; a new family is one package plus one entry here (or, for a
family defined outside this package, e.g. in a test or a user's own module, one call of
:func:`register_family` before its config is built).
"""

from __future__ import annotations

from models.deepseek_v3 import DEEPSEEK_V3_SPEC
from models.errors import ConfigError
from models.llama import LLAMA_SPEC
from models.moe import MOE_SPEC
from models.qwen3 import QWEN3_SPEC
from models.qwen3_5 import QWEN3_5_MOE_SPEC, QWEN3_5_SPEC, QWEN3_NEXT_SPEC
from models.spec import ModelSpec

MODEL_SPECS: dict[str, ModelSpec] = {
    spec.family: spec
    for spec in (
        LLAMA_SPEC,
        MOE_SPEC,
        QWEN3_SPEC,
        DEEPSEEK_V3_SPEC,
        QWEN3_5_SPEC,
        QWEN3_5_MOE_SPEC,
        QWEN3_NEXT_SPEC,
    )
}


def register_family(spec: ModelSpec) -> ModelSpec:
    """Add ``spec`` to the table of families (idempotent for the same spec); returns it.

    Call it at import time of the module that defines the family, so that every process that
    unpickles the family's args (spawned ranks) registers it too. A Hydra schema for the family's
    presets (``base_model_<family>``) exists once ``trainer.config.register_configs()`` runs after this.
    """
    known = MODEL_SPECS.get(spec.family)
    if known is not None and known != spec:
        raise ConfigError(
            f"model family {spec.family!r} is already registered with another spec; "
            "choose another family name."
        )
    MODEL_SPECS[spec.family] = spec
    return spec


def get_spec(family: str) -> ModelSpec:
    """The spec of ``family``; a ``ConfigError`` listing the known families otherwise."""
    if family not in MODEL_SPECS:
        raise ConfigError(
            f"model.family={family!r} is not a known model family; choose one of {sorted(MODEL_SPECS)}."
        )
    return MODEL_SPECS[family]


__all__ = ["MODEL_SPECS", "get_spec", "register_family"]
