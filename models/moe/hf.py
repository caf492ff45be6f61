"""Hugging Face adapter of the MoE family (``models/moe/model.py``): Mixtral and Qwen3-MoE configs and
tensor names, with stacked experts <-> per-expert tensors. Attention, norms and embeddings reuse
Llama's names (``models/llama/hf.py``)."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any, Optional

import torch
from torch import Tensor

from models.errors import ConfigError
from models.llama.hf import (
    LLAMA_HF_LAYER_NAMES,
    LLAMA_HF_TOP_NAMES,
    decoder_hf_config,
    finish_state_from_hf,
    rope_scaling_from_hf,
)
from models.moe.model import MoEArgs, MoETransformer

__all__ = ["MoEHF"]

logger = logging.getLogger("meshwright")


# --------------------------------------------------------------------------------------------
# Hugging Face adapter (MixtralForCausalLM, Qwen3MoeForCausalLM)
# --------------------------------------------------------------------------------------------
#
# Attention, norms and embeddings use Llama's names. MoE layers (Mixtral / Qwen3-MoE):
#
#   layers.{i}.moe.router.gate.weight   block_sparse_moe.gate.weight  / mlp.gate.weight
# layers.{i}.moe.experts.w1[j]        block_sparse_moe.experts.{j}.w1.weight /
# mlp.experts.{j}.gate_proj.weight
#   layers.{i}.moe.experts.w3[j]        ...experts.{j}.w3.weight  / mlp.experts.{j}.up_proj.weight
#   layers.{i}.moe.experts.w2[j]        ...experts.{j}.w2.weight  / mlp.experts.{j}.down_proj.weight
#   layers.{i}.attention.q_norm/k_norm  self_attn.q_norm / self_attn.k_norm (Qwen3)
#   layers.{i}.moe.expert_bias          none: HF routes without a bias. Import starts it at zero
#                                       (a fresh model's value); export refuses a non-zero one.
#
# Stacked expert tensors are the per-expert HF tensors stacked on a new dim 0 (no transpose).

_EXPERT_NAMES = {
    "mixtral": ("block_sparse_moe", {"w1": "w1", "w2": "w2", "w3": "w3"}),
    "qwen3_moe": ("mlp", {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}),
}
_ARCHITECTURES = {"mixtral": "MixtralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}


class MoEHF:
    """Hugging Face Mixtral / Qwen3-MoE <-> meshwright MoE. ``model_types`` lists both; the format
    of an export follows the args (``qk_norm`` -> Qwen3-MoE, else Mixtral)."""

    architecture = "MixtralForCausalLM"
    model_type = "mixtral"
    model_types = ("mixtral", "qwen3_moe")

    @staticmethod
    def format_of(args: MoEArgs) -> str:
        """The HF format for ``args``; ``ConfigError`` when neither can represent the model."""
        fmt = "qwen3_moe" if args.qk_norm else "mixtral"
        problems = []
        if args.num_shared_experts:
            problems.append("shared experts")
        if args.score_func != "softmax":
            problems.append("sigmoid router scores")
        if args.route_scale != 1.0:
            problems.append(f"route_scale={args.route_scale}")
        if args.n_group > 1:
            problems.append(f"group-limited routing (n_group={args.n_group})")
        if fmt == "mixtral" and (not args.route_norm or len(args.moe_layer_ids) != args.n_layers):
            problems.append("Mixtral needs route_norm=true and every layer MoE")
        if fmt == "mixtral" and args.top_k == 1:
            problems.append(
                "top_k=1 (Mixtral renormalises the one routing weight to 1, meshwright keeps the score)"
            )
        if fmt == "qwen3_moe" and (args.moe_layer_freq != 1):
            problems.append("moe_layer_freq != 1")
        if problems:
            raise ConfigError(
                f"the MoE model cannot be written as Hugging Face {fmt}: {', '.join(problems)} have no "
                "equivalent there."
            )
        return fmt

    def to_hf_config(
        self, args: MoEArgs, *, bos_id: Optional[int], eos_id: Optional[int], dtype: str
    ) -> dict:
        fmt = self.format_of(args)
        cfg: dict[str, Any] = {
            **decoder_hf_config(
                args,
                architecture=_ARCHITECTURES[fmt],
                model_type=fmt,
                bos_id=bos_id,
                eos_id=eos_id,
                dtype=dtype,
            ),
            "num_experts_per_tok": args.top_k,
            "output_router_logits": False,
            "router_aux_loss_coef": args.aux_loss_coeff,
        }
        if fmt == "mixtral":
            cfg.update(
                intermediate_size=args.moe_hidden_dim, num_local_experts=args.num_experts, sliding_window=None
            )
        else:
            cfg.update(
                intermediate_size=args.hidden_dim,
                moe_intermediate_size=args.moe_hidden_dim,
                num_experts=args.num_experts,
                num_local_experts=args.num_experts,
                norm_topk_prob=bool(args.route_norm and args.top_k > 1),
                decoder_sparse_step=1,
                mlp_only_layers=list(range(args.first_k_dense)),
                attention_bias=False,
                use_sliding_window=False,
                sliding_window=None,
            )
        return cfg

    def args_from_hf_config(self, cfg: dict[str, Any]) -> dict[str, Any]:
        """Our ``MoEArgs`` fields from a Mixtral / Qwen3-MoE ``config.json``; ``ConfigError`` naming the
        field when the folder's model computes something meshwright's cannot."""
        fmt = cfg.get("model_type")
        if fmt not in self.model_types:
            raise ConfigError(
                f"config.json has model_type={fmt!r}; the moe family reads {list(self.model_types)}."
            )
        _refuse_attention_and_mlp(cfg, fmt)
        top_k = cfg["num_experts_per_tok"]
        route_norm = True if fmt == "mixtral" else bool(cfg.get("norm_topk_prob", False))
        if top_k == 1 and route_norm:
            field = "" if fmt == "mixtral" else " and norm_topk_prob=true"
            raise ConfigError(
                f"config.json has num_experts_per_tok=1{field}: {fmt} renormalises the one routing weight to "
                "1, meshwright keeps the router score; they route the same tokens but scale them "
                "differently."
            )
        training_only = {k: cfg[k] for k in ("router_jitter_noise", "attention_dropout") if cfg.get(k)}
        if training_only:
            logger.warning(
                f"config.json sets {', '.join(f'{k}={v}' for k, v in training_only.items())}: training-time "
                f"noise meshwright does not apply (the model computes the same in evaluation)."
            )
        theta, scaling = rope_scaling_from_hf(cfg)
        dim, n_heads = cfg["hidden_size"], cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or dim // n_heads
        out: dict[str, Any] = {
            "family": "moe",
            "dim": dim,
            "n_layers": cfg["num_hidden_layers"],
            "n_heads": n_heads,
            "n_kv_heads": cfg.get("num_key_value_heads", n_heads),
            "attn_head_dim": None if head_dim == dim // n_heads else head_dim,
            "vocab_size": cfg["vocab_size"],
            "norm_eps": cfg.get("rms_norm_eps", 1e-6),
            "rope_theta": theta,
            "rope_scaling": scaling,
            "max_seq_len": cfg.get("max_position_embeddings", 2048),
            "tie_embeddings": bool(cfg.get("tie_word_embeddings", False)),
            "top_k": top_k,
            "score_func": "softmax",
            "route_scale": 1.0,
            "route_norm": route_norm,
            "num_shared_experts": 0,
            "moe_layer_freq": 1,
        }
        if fmt == "mixtral":
            out.update(
                num_experts=cfg["num_local_experts"],
                moe_hidden_dim=cfg["intermediate_size"],
                ffn_hidden_dim=cfg["intermediate_size"],
                qk_norm=False,
                first_k_dense=0,
            )
            return out
        step = cfg.get("decoder_sparse_step", 1)
        dense = sorted(cfg.get("mlp_only_layers") or [])
        if step != 1 or dense != list(range(len(dense))):
            raise ConfigError(
                f"config.json: decoder_sparse_step={step}, mlp_only_layers={dense}; meshwright reads "
                "Qwen3-MoE with "
                f"every layer sparse except a leading run of dense layers."
            )
        out.update(
            num_experts=cfg.get("num_experts", cfg.get("num_local_experts")),
            moe_hidden_dim=cfg["moe_intermediate_size"],
            ffn_hidden_dim=cfg["intermediate_size"],
            qk_norm=True,
            first_k_dense=len(dense),
        )
        return out

    # -- names ------------------------------------------------------------------------
    def _layer_map(self, args: MoEArgs) -> dict[str, str]:
        fmt = self.format_of(args)
        moe_prefix, _ = _EXPERT_NAMES[fmt]
        names = {k + ".weight": v + ".weight" for k, v in LLAMA_HF_LAYER_NAMES.items()}
        names.update(
            {
                "attention.q_norm.weight": "self_attn.q_norm.weight",
                "attention.k_norm.weight": "self_attn.k_norm.weight",
                "moe.router.gate.weight": f"{moe_prefix}.gate.weight",
            }
        )
        return names

    def hf_names_of(self, name: str, args: MoEArgs) -> list[str]:
        """HF tensor(s) of our ``name``: one, one per expert for stacked expert weights, or none for
        the routing bias (``expert_bias``), which HF does not store: it is zero on import."""
        if name.endswith(".moe.expert_bias"):
            return []
        if name in LLAMA_HF_TOP_NAMES:
            return [LLAMA_HF_TOP_NAMES[name]]
        parts = name.split(".")
        if len(parts) >= 3 and parts[0] == "layers":
            layer, local = parts[1], ".".join(parts[2:])
            if local.startswith("moe.experts.") and parts[-1] in ("w1", "w2", "w3"):
                moe_prefix, proj = _EXPERT_NAMES[self.format_of(args)]
                return [
                    f"model.layers.{layer}.{moe_prefix}.experts.{j}.{proj[parts[-1]]}.weight"
                    for j in range(args.num_experts)
                ]
            mapping = self._layer_map(args)
            if local in mapping:
                return [f"model.layers.{layer}.{mapping[local]}"]
        raise ConfigError(f"parameter {name!r} has no Hugging Face {self.format_of(args)} equivalent.")

    def full_shape(self, name: str, hf_shapes: list[list[int]], args: Any) -> list[int]:
        if name.split(".")[-1] in ("w1", "w2", "w3") and ".moe.experts." in name:
            return [len(hf_shapes), *hf_shapes[0]]
        return hf_shapes[0]

    def read_slice(self, name: str, index: tuple[slice, ...], reader: Any, args: Any) -> Tensor:
        hf_names = self.hf_names_of(name, args)
        if len(hf_names) == 1 and ".moe.experts." not in name:
            return reader.read(hf_names[0], index)
        experts = range(args.num_experts)[index[0]]
        return torch.stack([reader.read(hf_names[j], index[1:]) for j in experts])

    def to_hf_state(self, state: dict[str, Tensor], args: MoEArgs) -> Iterator[tuple[str, Tensor]]:
        for name, tensor in state.items():
            if name.endswith("expert_bias"):  # no HF tensor; a meta tensor (a dry run) has no value to check
                if not tensor.is_meta and torch.count_nonzero(tensor):
                    raise ConfigError(
                        f"{name} is non-zero (aux-loss-free balancing moved it); Hugging Face "
                        f"{self.format_of(args)} has no expert bias, so routing would change. Export a model "
                        f"trained with model.bias_update_coeff=0."
                    )
                continue
            if args.tie_embeddings and name == "output.weight":
                continue
            hf_names = self.hf_names_of(name, args)
            if len(hf_names) == 1 and ".moe.experts." not in name:
                yield hf_names[0], tensor
            else:
                yield from zip(hf_names, tensor.unbind(0))

    def from_hf_state(self, hf_state: dict[str, Tensor], args: MoEArgs) -> dict[str, Tensor]:
        """HF tensors -> our full state dict (parameters and the routing bias, which starts at zero).
        ``ConfigError`` naming a tensor the folder lacks, or one it has that the model does not."""
        with torch.device("meta"):
            shapes = {n: t.shape for n, t in MoETransformer(args).state_dict().items()}
        state, used = {}, set()
        for name, shape in shapes.items():
            hf_names = self.hf_names_of(name, args)
            if not hf_names:  # state HF does not hold: what a fresh model has
                state[name] = torch.zeros(shape)
                continue
            missing = [n for n in hf_names if n not in hf_state]
            if missing:
                if name == "output.weight" and args.tie_embeddings:
                    continue
                raise ConfigError(f"Hugging Face state has no tensor {missing[0]!r} (for {name!r}).")
            used.update(hf_names)
            if len(hf_names) == 1 and ".moe.experts." not in name:
                state[name] = hf_state[hf_names[0]]
            else:
                state[name] = torch.stack([hf_state[n] for n in hf_names])
        return finish_state_from_hf(state, hf_state, used, args, self.format_of(args))


def _refuse_attention_and_mlp(cfg: dict[str, Any], fmt: Any) -> None:
    """``ConfigError`` for attention biases, a non-SwiGLU activation or a sliding window."""
    if cfg.get("attention_bias"):
        raise ConfigError("config.json has attention_bias=true; meshwright's attention has no biases.")
    if cfg.get("hidden_act", "silu") != "silu":
        raise ConfigError(
            f"config.json has hidden_act={cfg['hidden_act']!r}; meshwright's experts are SwiGLU (silu)."
        )
    max_pos = cfg.get("max_position_embeddings", 2048)
    window = cfg.get("sliding_window") if fmt == "mixtral" or cfg.get("use_sliding_window") else None
    if window is not None and window < max_pos:
        raise ConfigError(
            f"config.json has sliding_window={window} (below max_position_embeddings={max_pos}"
            f"{', use_sliding_window=true' if fmt == 'qwen3_moe' else ''}); meshwright's attention is "
            f"full causal, without a sliding window."
        )
