"""Hugging Face adapter of the Llama family (``LlamaForCausalLM``): config conversion and tensor
names. Also the shared pieces of every decoder family's adapter (``decoder_hf_config``, the Llama
tensor-name tables, RoPE scaling in HF's spelling)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any, Optional

from torch import Tensor

from models.common import RopeScaling
from models.errors import ConfigError
from models.llama.model import LlamaArgs

__all__ = [
    "LLAMA_HF_LAYER_NAMES",
    "LLAMA_HF_TOP_NAMES",
    "LlamaHF",
    "decoder_hf_config",
    "rope_scaling_from_hf",
    "rope_scaling_to_hf",
]

# --------------------------------------------------------------------------------------------
# Hugging Face adapter (LlamaForCausalLM)
# --------------------------------------------------------------------------------------------
#
# Our attention uses HF's rotate_half RoPE layout, so q/k projections need no row permutation.
#
#   tok_embeddings.weight              model.embed_tokens.weight
#   layers.{i}.attention.wq/wk/wv/wo   model.layers.{i}.self_attn.q_proj/k_proj/v_proj/o_proj
#   layers.{i}.feed_forward.w1/w3/w2   model.layers.{i}.mlp.gate_proj/up_proj/down_proj
#   layers.{i}.attention_norm          model.layers.{i}.input_layernorm
#   layers.{i}.ffn_norm                model.layers.{i}.post_attention_layernorm
#   norm.weight                        model.norm.weight
#   output.weight                      lm_head.weight (absent when tie_word_embeddings)

LLAMA_HF_LAYER_NAMES = {
    "attention.wq": "self_attn.q_proj",
    "attention.wk": "self_attn.k_proj",
    "attention.wv": "self_attn.v_proj",
    "attention.wo": "self_attn.o_proj",
    "feed_forward.w1": "mlp.gate_proj",
    "feed_forward.w3": "mlp.up_proj",
    "feed_forward.w2": "mlp.down_proj",
    "attention_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
LLAMA_HF_TOP_NAMES = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def rope_scaling_to_hf(scaling: RopeScaling, theta: float) -> Optional[dict[str, Any]]:
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


def finish_state_from_hf(
    state: dict[str, Any], hf_state: dict[str, Any], used: set[str], args: Any, fmt: str
) -> dict[str, Any]:
    """The end of a stacked-expert reader (MoE, DeepSeek-V3): every HF tensor was read (the rotary
    ``inv_freq`` buffers aside), else a ConfigError naming one; a tied head is the embedding."""
    extra = sorted(k for k in hf_state if k not in used and not k.endswith("rotary_emb.inv_freq"))
    if extra:
        raise ConfigError(
            f"Hugging Face state has tensor {extra[0]!r} ({len(extra)} in all) that a {fmt} model of this "
            "config.json lacks."
        )
    if args.tie_embeddings and "output.weight" not in state:
        state["output.weight"] = state["tok_embeddings.weight"]
    return state


def rope_scaling_from_hf(cfg: dict[str, Any]) -> tuple[float, dict[str, Any]]:
    """(rope_theta, our ``rope_scaling`` fields) from a HF config (``rope_parameters`` in
    transformers >= 5, ``rope_scaling`` + ``rope_theta`` before)."""
    rope = dict(cfg.get("rope_parameters") or {})
    rope.update({k: v for k, v in (cfg.get("rope_scaling") or {}).items() if k not in rope})
    theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
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


def decoder_hf_config(
    args: Any, *, architecture: str, model_type: str, bos_id: Optional[int], eos_id: Optional[int], dtype: str
) -> dict[str, Any]:
    """The ``config.json`` keys every decoder family shares (sizes, norm, RoPE both ways, tokens)."""
    scaling = rope_scaling_to_hf(args.rope_scaling, args.rope_theta)
    return {
        "architectures": [architecture],
        "model_type": model_type,
        "hidden_size": args.dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.kv_heads,
        "head_dim": args.head_dim,
        "vocab_size": args.vocab_size,
        "max_position_embeddings": args.max_seq_len,
        "rms_norm_eps": args.norm_eps,
        "rope_theta": args.rope_theta,  # transformers < 5
        "rope_scaling": scaling,  # transformers < 5
        "rope_parameters": {"rope_theta": args.rope_theta, **(scaling or {"rope_type": "default"})},  # >= 5
        "hidden_act": "silu",
        "attention_dropout": 0.0,
        "tie_word_embeddings": bool(args.tie_embeddings),
        "initializer_range": args.init_std,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "torch_dtype": dtype,
        "use_cache": True,
    }


class LlamaHF:
    """Hugging Face ``LlamaForCausalLM`` <-> meshwright Llama (config and tensor names).

    Subclasses for other dense decoders (``models.qwen3.Qwen3HF``) change ``architecture``,
    ``model_type``, ``layer_names`` and the config keys."""

    architecture = "LlamaForCausalLM"
    model_type = "llama"
    family = "llama"
    layer_names: dict[str, str] = LLAMA_HF_LAYER_NAMES  # our name in a block -> HF's (without .weight)

    def to_hf_config(
        self, args: LlamaArgs, *, bos_id: Optional[int], eos_id: Optional[int], dtype: str
    ) -> dict:
        """A ``LlamaConfig`` dict for ``args``."""
        if args.qk_norm and "attention.q_norm" not in self.layer_names:
            raise ConfigError(
                "model.qk_norm=true has no equivalent in Hugging Face LlamaForCausalLM (no q/k head norms); "
                "train it as model.family=qwen3 (exported as Qwen3ForCausalLM)."
            )
        return {
            **decoder_hf_config(
                args,
                architecture=self.architecture,
                model_type=self.model_type,
                bos_id=bos_id,
                eos_id=eos_id,
                dtype=dtype,
            ),
            "intermediate_size": args.hidden_dim,
            "attention_bias": False,
            "mlp_bias": False,
        }

    def args_from_hf_config(self, cfg: dict[str, Any]) -> dict[str, Any]:
        """Our ``LlamaArgs`` fields from a HF ``config.json`` (refuses what we cannot represent)."""
        if cfg.get("model_type") not in (self.model_type, None):
            raise ConfigError(
                f"config.json has model_type={cfg.get('model_type')!r}; the {self.family} family reads "
                f"{self.model_type!r}."
            )
        for key in ("attention_bias", "mlp_bias"):
            if cfg.get(key):
                raise ConfigError(
                    f"config.json has {key}=true; meshwright's {self.family} model has no biases."
                )
        if cfg.get("hidden_act", "silu") != "silu":
            raise ConfigError(
                f"config.json has hidden_act={cfg['hidden_act']!r}; meshwright's FFN is SwiGLU (silu)."
            )
        dim, n_heads = cfg["hidden_size"], cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or dim // n_heads
        theta, scaling = rope_scaling_from_hf(cfg)
        return {
            "family": self.family,
            "dim": dim,
            "n_layers": cfg["num_hidden_layers"],
            "n_heads": n_heads,
            "n_kv_heads": cfg.get("num_key_value_heads", n_heads),
            "attn_head_dim": None if head_dim * n_heads == dim else head_dim,
            "vocab_size": cfg["vocab_size"],
            "ffn_hidden_dim": cfg["intermediate_size"],
            "norm_eps": cfg.get("rms_norm_eps", 1e-6),
            "rope_theta": theta,
            "rope_scaling": scaling,
            "max_seq_len": cfg.get("max_position_embeddings", 2048),
            "tie_embeddings": bool(cfg.get("tie_word_embeddings", False)),
        }

    def hf_names_of(self, name: str, args: Any = None) -> list[str]:
        """The HF tensor(s) holding our parameter ``name`` (one for Llama)."""
        if name in LLAMA_HF_TOP_NAMES:
            return [LLAMA_HF_TOP_NAMES[name]]
        parts = name.split(".")
        if len(parts) >= 4 and parts[0] == "layers" and parts[-1] == "weight":
            local = ".".join(parts[2:-1])
            if local in self.layer_names:
                return [f"model.layers.{parts[1]}.{self.layer_names[local]}.weight"]
        raise ConfigError(f"parameter {name!r} has no Hugging Face {self.architecture} equivalent.")

    def from_hf_name(self, hf_name: str) -> str:
        """HF tensor name -> ours."""
        for ours, hf in LLAMA_HF_TOP_NAMES.items():
            if hf_name == hf:
                return ours
        parts = hf_name.split(".")
        if len(parts) >= 5 and parts[:2] == ["model", "layers"] and parts[-1] == "weight":
            local = ".".join(parts[3:-1])
            for ours, hf in self.layer_names.items():
                if local == hf:
                    return f"layers.{parts[2]}.{ours}.weight"
        raise ConfigError(
            f"Hugging Face tensor {hf_name!r} is not part of a {self.architecture} model meshwright supports "
            "(biases and other architectures are not)."
        )

    def full_shape(self, name: str, hf_shapes: list[list[int]], args: Any = None) -> list[int]:
        """Our full shape of ``name`` given the shapes of its HF tensors (one, unchanged)."""
        return hf_shapes[0]

    def read_slice(self, name: str, index: tuple[slice, ...], reader: Any, args: Any = None) -> Tensor:
        """The ``index`` slice of our ``name``, read from the HF files through ``reader.read``."""
        return reader.read(self.hf_names_of(name)[0], index)

    def to_hf_state(self, state: dict[str, Tensor], args: LlamaArgs) -> Iterator[tuple[str, Tensor]]:
        """Our full tensors -> (HF name, tensor); a tied head is written once, as the embedding."""
        for name, tensor in state.items():
            if args.tie_embeddings and name == "output.weight":
                continue
            yield self.hf_names_of(name)[0], tensor

    def from_hf_state(self, hf_state: dict[str, Tensor], args: LlamaArgs) -> dict[str, Tensor]:
        """HF tensors -> our names (derived buffers such as ``rotary_emb.inv_freq`` skipped)."""
        state = {
            self.from_hf_name(k): v for k, v in hf_state.items() if not k.endswith("rotary_emb.inv_freq")
        }
        if args.tie_embeddings and "output.weight" not in state and "tok_embeddings.weight" in state:
            state["output.weight"] = state["tok_embeddings.weight"]
        return state
