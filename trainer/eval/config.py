"""The ``eval`` config group's schema (``configs/eval/default.yaml`` documents every key)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from models.errors import ConfigError, check_choice

__all__ = ["EvalConfig", "ValidationSource", "validate_eval", "validation_sources"]

VALIDATION_SOURCES = ("builtin", "text", "json", "jsonl", "parquet", "tokens")
VALIDATION_SPLITS = ("validation", "train", "all")


@dataclass
class ValidationSource:
    """One named validation set: a data source read with the run's tokenizer and ``training.seq_len``."""

    source: str = "builtin"  # builtin | text | json (jsonl) | parquet | tokens (a prepared folder)
    path: Optional[str] = None  # file, glob or folder (tokens: the folder trainer.prepare_data wrote)
    text_field: str = "text"  # json / parquet: the column holding the text
    split: str = "validation"  # validation: the held-out share (val_fraction) | train | all: every document
    val_fraction: float = 0.01  # share held out by the hash of the document key, as data.val_fraction
    max_documents: Optional[int] = None  # cap on documents read before the split
    steps: Optional[int] = None  # batches per evaluation; null = training.eval_steps


@dataclass
class EvalConfig:
    tasks: list[str] = field(default_factory=list)  # shipped task names or JSONL task files
    freq: int = 0  # steps between task evaluations (and at the last step); 0 = training.eval_freq
    batch_size: int = 8  # rows (one per choice) per forward per data-parallel rank
    limit: Optional[int] = None  # score only the first N examples of each task; null = all
    # Named validation sets: name -> the fields of a ValidationSource (plain mappings, so that a
    # command-line override like eval.validation={a:{source:builtin}} can add them).
    validation: dict[str, Any] = field(default_factory=dict)


def validate_eval(e: EvalConfig) -> None:
    """Checks that need no file and no process group (task files are read by the Trainer, on every rank)."""
    if e.freq < 0:
        raise ConfigError(f"eval.freq={e.freq} must be >= 0 (0 = every training.eval_freq steps).")
    if e.batch_size < 1:
        raise ConfigError(
            f"eval.batch_size={e.batch_size} must be >= 1 (rows per forward per data-parallel rank)."
        )
    if e.limit is not None and e.limit < 1:
        raise ConfigError(f"eval.limit={e.limit} must be >= 1, or null to score every example.")
    validation_sources(e)
    duplicates = sorted({t for t in e.tasks if e.tasks.count(t) > 1})
    if duplicates:
        raise ConfigError(f"eval.tasks={list(e.tasks)} lists {duplicates} twice; list each task once.")


def validation_sources(e: EvalConfig) -> dict[str, ValidationSource]:
    """``eval.validation`` as typed, checked sets (``ConfigError`` naming an unknown key or bad value)."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    out = {}
    for name, entry in e.validation.items():
        if not isinstance(entry, dict):
            raise ConfigError(
                f"eval.validation.{name}={entry!r}: a set is a mapping, e.g. {{source: builtin}}."
            )
        try:
            v = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ValidationSource), entry))
        except OmegaConfBaseException as err:
            raise ConfigError(
                f"eval.validation.{name}: {str(err).splitlines()[0]} (keys: "
                f"{list(ValidationSource.__dataclass_fields__)})."
            ) from err
        _validate_source(name, v)
        out[name] = v
    return out


def _validate_source(name: str, v: ValidationSource) -> None:
    key = f"eval.validation.{name}"
    if not name.replace("_", "").replace("-", "").isalnum():
        raise ConfigError(
            f"{key}: a validation set's name is letters, digits, '_' or '-' (it becomes a metric key)."
        )
    check_choice(v.source, VALIDATION_SOURCES, f"{key}.source")
    check_choice(v.split, VALIDATION_SPLITS, f"{key}.split")
    if v.source == "builtin" and v.path is not None:
        raise ConfigError(
            f"{key}.path={v.path!r} is set but source=builtin reads the standard library; drop the path."
        )
    if v.source != "builtin" and not v.path:
        raise ConfigError(f"{key}.source={v.source} needs a path: {key}.path=...")
    if v.source == "tokens" and v.split == "all":
        raise ConfigError(f"{key}.split=all: a prepared folder has a train and a validation split; pick one.")
    if not 0.0 <= v.val_fraction < 1.0:
        raise ConfigError(f"{key}.val_fraction={v.val_fraction} must lie in [0, 1).")
    if v.steps is not None and v.steps < 1:
        raise ConfigError(f"{key}.steps={v.steps} must be >= 1, or null for training.eval_steps.")
    if v.max_documents is not None and v.max_documents < 1:
        raise ConfigError(f"{key}.max_documents={v.max_documents} must be >= 1, or null to read everything.")
