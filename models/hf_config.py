"""The one Hugging Face ``config.json`` reader and writer, shared by every family's HF adapter.

A family's adapter declares each HF format it reads as an ``HFFormat``: its ``model_type`` and
architecture and a table of rows, each row one fact in both directions:

- ``Key``: our args field <-> one config.json key (with a default, a converter on import, the value
  written on export), e.g. ``Key("dim", "hidden_size")``;
- ``Derived``: a pair of small functions for what is not one key (RoPE, the head size, Qwen3-MoE's
  dense layers), where a family's own refusals live too;

plus ``fixed`` (our fields the format implies: ``qk_norm=True`` for Qwen3), ``hf_fixed`` (keys every
export holds: ``attention_bias=false``) and how the format switches a sliding window on.

``read_hf_args`` applies the refusals every family shares, worded once (attention or MLP biases, an
activation other than silu, a sliding window shorter than the context, a ``model_type`` of another
family, RoPE types we do not compute), warns about training-time noise we do not apply, then reads
the rows. ``write_hf_config`` writes the same rows back. ``DECODER_ROWS`` (sizes, norm, RoPE,
embedding tie) and ``GQA_ROWS`` (the one head-size rule) are the rows every decoder family shares.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, Literal, Optional, TypeVar, Union

from models.common import RopeScaling
from models.errors import ConfigError
from models.llama.model import LlamaArgs

__all__ = [
    "DECODER_ROWS",
    "FFN_ROW",
    "GQA_ROWS",
    "REQUIRED",
    "Derived",
    "HFConfig",
    "HFFormat",
    "Key",
    "SlidingWindow",
    "read_hf_args",
    "rope_scaling_from_hf",
    "rope_scaling_to_hf",
    "write_hf_config",
]

logger = logging.getLogger("meshwright")

HFConfig = dict[str, Any]  # a config.json as json.load returns it: JSON values of any kind
# Every decoder family's args extend LlamaArgs. Rows only take args (contravariant): a row written
# for LlamaArgs fits a format of any subclass.
A = TypeVar("A", bound=LlamaArgs, contravariant=True)


class _Required:
    """The default of a ``Key`` that config.json must hold."""

    def __repr__(self) -> str:
        return "REQUIRED"


REQUIRED = _Required()
# config.json fields transformers uses only in training mode: read, with a warning.
TRAINING_ONLY = ("router_jitter_noise", "attention_dropout")
# What every export says about the computation (our FFNs are SwiGLU, attention has no dropout).
COMMON_HF_FIXED: Mapping[str, object] = {"hidden_act": "silu", "attention_dropout": 0.0, "use_cache": True}


def _same(value: Any) -> Any:
    return value


@dataclass(frozen=True)
class Key(Generic[A]):
    """One row: our args field ``ours`` <-> the config.json key ``hf``.

    Import reads the first of the keys config.json holds (or ``default``) through ``read``; export
    writes ``write(args)`` (default: the field itself) under every key. ``way`` limits a row to one
    direction."""

    ours: str
    hf: Union[str, tuple[str, ...]]
    default: object = REQUIRED
    read: Callable[[Any], object] = _same
    write: Optional[Callable[[A], object]] = None
    way: Literal["both", "read", "write"] = "both"

    @property
    def keys(self) -> tuple[str, ...]:
        """The config.json keys of this row, the preferred one first."""
        return (self.hf,) if isinstance(self.hf, str) else self.hf

    def import_from(self, cfg: HFConfig, model_type: str) -> dict[str, object]:
        """``{ours: value}`` from ``cfg``; ``ConfigError`` when a required key is absent."""
        if self.way == "write":
            return {}
        key = next((k for k in self.keys if k in cfg), None)
        if key is None and self.default is REQUIRED:
            raise ConfigError(
                f"config.json has no {' or '.join(self.keys)}; a {model_type} config.json needs it "
                f"(meshwright's model.{self.ours})."
            )
        return {self.ours: self.read(cfg[key] if key is not None else self.default)}

    def export(self, args: A) -> dict[str, object]:
        """``{key: value}`` for every config.json key of this row."""
        if self.way == "read":
            return {}
        value = self.write(args) if self.write is not None else getattr(args, self.ours)
        return dict.fromkeys(self.keys, value)


@dataclass(frozen=True)
class Derived(Generic[A]):
    """A row that is not one key: ``read(cfg, model_type)`` -> our fields (raising ``ConfigError`` for
    what the family cannot compute), ``write(args)`` -> config.json keys. Either may be absent."""

    read: Optional[Callable[[HFConfig, str], dict[str, object]]] = None
    write: Optional[Callable[[A], dict[str, object]]] = None

    def import_from(self, cfg: HFConfig, model_type: str) -> dict[str, object]:
        """Our fields from ``cfg`` (a config.json of ``model_type``)."""
        return self.read(cfg, model_type) if self.read is not None else {}

    def export(self, args: A) -> dict[str, object]:
        """config.json keys from ``args``."""
        return self.write(args) if self.write is not None else {}


Row = Union[Key[A], Derived[A]]


@dataclass(frozen=True)
class SlidingWindow:
    """How a format's config.json turns sliding-window attention on (refused: ours is full causal)."""

    switch: Optional[str] = None  # the key that turns it on (Qwen3's use_sliding_window); None: on when set
    per_layer: bool = False  # layer_types names the sliding layers (Qwen3); absent: any layer may slide


@dataclass(frozen=True)
class HFFormat(Generic[A]):
    """One Hugging Face format a family reads and writes: its names and its table of rows."""

    family: str  # ours, e.g. "moe"
    model_type: str  # config.json's, e.g. "mixtral"
    architecture: str  # e.g. "MixtralForCausalLM"
    rows: tuple[Row[A], ...]
    fixed: Mapping[str, object] = field(default_factory=dict)  # our fields the format implies (import)
    hf_fixed: Mapping[str, object] = field(default_factory=dict)  # config.json keys every export holds
    sliding_window: Optional[SlidingWindow] = None  # None: the architecture has no sliding window


def read_hf_args(cfg: HFConfig, formats: Sequence[HFFormat[A]]) -> dict[str, Any]:
    """Our args fields (``family`` included) from a ``config.json`` of one of ``formats`` (one
    family's). ``ConfigError`` naming the key when the folder's model computes something ours cannot."""
    fmt = _format_of(cfg, formats)
    _refuse_common(cfg, fmt)
    training_only = {k: cfg[k] for k in TRAINING_ONLY if cfg.get(k)}
    if training_only:
        logger.warning(
            f"config.json sets {', '.join(f'{k}={v}' for k, v in training_only.items())}: training-time "
            f"noise meshwright does not apply (the model computes the same in evaluation)."
        )
    out: dict[str, Any] = {"family": fmt.family}
    for row in fmt.rows:
        out.update(row.import_from(cfg, fmt.model_type))
    return {**out, **fmt.fixed}


def write_hf_config(
    fmt: HFFormat[A], args: A, *, bos_id: Optional[int], eos_id: Optional[int], dtype: str
) -> HFConfig:
    """The ``config.json`` of ``args`` in ``fmt`` (the family has checked that ``fmt`` can hold it)."""
    cfg: HFConfig = {"architectures": [fmt.architecture], "model_type": fmt.model_type}
    for row in fmt.rows:
        cfg.update(row.export(args))
    cfg.update(COMMON_HF_FIXED)
    cfg.update(fmt.hf_fixed)
    cfg.update(bos_token_id=bos_id, eos_token_id=eos_id, torch_dtype=dtype)
    return cfg


def _format_of(cfg: HFConfig, formats: Sequence[HFFormat[A]]) -> HFFormat[A]:
    """The format of ``cfg`` by its model_type (a family of one format also reads a config.json
    without one, as a hand-written Llama config)."""
    model_type = cfg.get("model_type")
    if model_type is None and len(formats) == 1:
        return formats[0]
    for fmt in formats:
        if fmt.model_type == model_type:
            return fmt
    names = " or ".join(repr(f.model_type) for f in formats)
    raise ConfigError(
        f"config.json has model_type={model_type!r}; the {formats[0].family} family reads {names}."
    )


def _refuse_common(cfg: HFConfig, fmt: HFFormat[A]) -> None:
    """``ConfigError`` for biases, a non-SwiGLU activation or a sliding window shorter than the
    context: no family's model computes them."""
    for key in ("attention_bias", "mlp_bias"):
        if cfg.get(key):
            raise ConfigError(f"config.json has {key}=true; meshwright's {fmt.family} model has no biases.")
    if cfg.get("hidden_act", "silu") != "silu":
        raise ConfigError(
            f"config.json has hidden_act={cfg['hidden_act']!r}; meshwright's FFN is SwiGLU (silu)."
        )
    rule = fmt.sliding_window
    if rule is None or (rule.switch is not None and not cfg.get(rule.switch)):
        return
    window, max_pos = cfg.get("sliding_window"), cfg.get("max_position_embeddings", 2048)
    kinds = cfg.get("layer_types") if rule.per_layer else None
    sliding_layers = not kinds or any(kind != "full_attention" for kind in kinds)
    if window is not None and window < max_pos and sliding_layers:
        switch = f", {rule.switch}=true" if rule.switch else ""
        raise ConfigError(
            f"config.json has sliding_window={window} (below max_position_embeddings={max_pos}{switch}); "
            "meshwright's attention is full causal, without a sliding window."
        )


# --------------------------------------------------------------------------------------------
# RoPE in HF's spelling (transformers >= 5: rope_parameters; before: rope_theta + rope_scaling)
# --------------------------------------------------------------------------------------------


def rope_scaling_to_hf(scaling: RopeScaling) -> Optional[dict[str, Any]]:
    """``RopeScaling`` -> HF's ``rope_scaling`` dict (None for the default RoPE)."""
    if scaling.type == "default":
        return None
    out: dict[str, Any] = {"rope_type": scaling.type, "type": scaling.type, "factor": scaling.factor}
    if scaling.type == "llama3":
        out.update(
            low_freq_factor=scaling.low_freq_factor,
            high_freq_factor=scaling.high_freq_factor,
            original_max_position_embeddings=scaling.original_max_seq_len,
        )
    if scaling.type == "yarn":
        out.update(
            original_max_position_embeddings=scaling.original_max_seq_len,
            beta_fast=scaling.beta_fast,
            beta_slow=scaling.beta_slow,
            **{
                k: getattr(scaling, k)
                for k in ("mscale", "mscale_all_dim", "attention_factor")
                if getattr(scaling, k)
            },
        )
    return out


def rope_scaling_from_hf(cfg: HFConfig) -> tuple[float, dict[str, Any]]:
    """(rope_theta, our ``rope_scaling`` fields) from a HF config (``rope_parameters`` in
    transformers >= 5, ``rope_scaling`` + ``rope_theta`` before)."""
    rope: dict[str, Any] = dict(cfg.get("rope_parameters") or {})
    rope.update({k: v for k, v in (cfg.get("rope_scaling") or {}).items() if k not in rope})
    theta: float = rope["rope_theta"] if "rope_theta" in rope else cfg.get("rope_theta", 10000.0)
    kind = rope.get("rope_type", rope.get("type", "default")) or "default"
    if kind == "default":
        return theta, {"type": "default"}
    if kind not in ("linear", "llama3", "yarn"):
        raise ConfigError(
            f"config.json uses rope_type={kind!r}; meshwright supports default, linear, llama3 and yarn RoPE."
        )
    out: dict[str, Any] = {"type": kind, "factor": float(rope["factor"])}
    if kind == "yarn":
        if rope.get("truncate", True) is False:
            raise ConfigError(
                "config.json sets rope truncate=false; meshwright's YaRN truncates (as DeepSeek-V3)."
            )
        out.update(
            original_max_seq_len=int(
                rope.get("original_max_position_embeddings") or cfg["max_position_embeddings"]
            ),
            beta_fast=float(rope.get("beta_fast") or 32),
            beta_slow=float(rope.get("beta_slow") or 1),
            **{k: float(rope.get(k) or 0.0) for k in ("mscale", "mscale_all_dim", "attention_factor")},
        )
    if kind == "llama3":
        out.update(
            low_freq_factor=float(rope["low_freq_factor"]),
            high_freq_factor=float(rope["high_freq_factor"]),
            # transformers falls back to max_position_embeddings when the key is absent
            original_max_seq_len=int(
                rope.get("original_max_position_embeddings") or cfg["max_position_embeddings"]
            ),
        )
    return theta, dataclasses.asdict(RopeScaling(**out))  # every field, unset ones at their defaults


def _rope_read(cfg: HFConfig, model_type: str) -> dict[str, object]:
    theta, scaling = rope_scaling_from_hf(cfg)
    return {"rope_theta": theta, "rope_scaling": scaling}


def _rope_write(args: LlamaArgs) -> dict[str, object]:
    scaling = rope_scaling_to_hf(args.rope_scaling)
    return {
        "rope_theta": args.rope_theta,  # transformers < 5
        "rope_scaling": scaling,  # transformers < 5
        "rope_parameters": {"rope_theta": args.rope_theta, **(scaling or {"rope_type": "default"})},  # >= 5
    }


# --------------------------------------------------------------------------------------------
# The rows every decoder family shares
# --------------------------------------------------------------------------------------------


def _heads_read(cfg: HFConfig, model_type: str) -> dict[str, object]:
    """The one head-size rule: ``head_dim`` (absent or null: hidden / heads) becomes our explicit
    ``attn_head_dim`` unless heads x head_dim is exactly the hidden size."""
    dim, n_heads = cfg["hidden_size"], cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or dim // n_heads
    return {
        "n_kv_heads": cfg.get("num_key_value_heads", n_heads),
        "attn_head_dim": None if head_dim * n_heads == dim else head_dim,
    }


def _heads_write(args: LlamaArgs) -> dict[str, object]:
    return {"num_key_value_heads": args.kv_heads, "head_dim": args.head_dim}


DECODER_ROWS: tuple[Row[LlamaArgs], ...] = (
    Key("dim", "hidden_size"),
    Key("n_layers", "num_hidden_layers"),
    Key("n_heads", "num_attention_heads"),
    Key("vocab_size", "vocab_size"),
    Key("norm_eps", "rms_norm_eps", 1e-6),
    Key("max_seq_len", "max_position_embeddings", 2048),
    Key("tie_embeddings", "tie_word_embeddings", False, read=bool, write=lambda a: bool(a.tie_embeddings)),
    Derived(_rope_read, _rope_write),
    # Written only: an imported folder's weights are loaded, not drawn, and the run keeps its init_std.
    Key("init_std", "initializer_range", way="write"),
)
# Grouped-query attention (every family but DeepSeek-V3's MLA): KV heads and the head size.
GQA_ROWS: tuple[Row[LlamaArgs], ...] = (Derived(_heads_read, _heads_write),)
# The dense FFN's hidden size (our explicit value or the Llama rule's).
FFN_ROW: Key[LlamaArgs] = Key("ffn_hidden_dim", "intermediate_size", write=lambda a: a.hidden_dim)
