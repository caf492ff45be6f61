"""Hugging Face adapter of the MoE family (``models/moe/model.py``): the Mixtral and Qwen3-MoE config
tables (read and written by ``models/hf_config.py``) and tensor names, with stacked experts <->
per-expert tensors. Attention, norms and embeddings use HF's Llama names (``models/hf_tensors.py``).
``routing_rows`` (top-k and its renormalisation) is shared with DeepSeek-V3."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Optional

import torch
from torch import Tensor

from models.errors import ConfigError
from models.hf_config import (
    DECODER_ROWS,
    FFN_ROW,
    GQA_ROWS,
    Derived,
    HFConfig,
    HFFormat,
    Key,
    Row,
    SlidingWindow,
    read_hf_args,
    write_hf_config,
)
from models.hf_tensors import LLAMA_HF_LAYER_NAMES, LLAMA_HF_TOP_NAMES, finish_state_from_hf
from models.moe.args import MoEArgs
from models.moe.model import MoETransformer
from models.spec import HFTensorReader

__all__ = ["MIXTRAL_HF_FORMAT", "QWEN3_MOE_HF_FORMAT", "MoEHF", "routing_rows"]


# --------------------------------------------------------------------------------------------
# Hugging Face adapter (MixtralForCausalLM, Qwen3MoeForCausalLM)
# --------------------------------------------------------------------------------------------
#
# Attention, norms and embeddings use Llama's names. MoE layers (Mixtral / Qwen3-MoE):
#
#   layers.{i}.moe.router.gate.weight   block_sparse_moe.gate.weight  / mlp.gate.weight
#   layers.{i}.moe.experts.w1[j]        ...experts.{j}.w1.weight  / mlp.experts.{j}.gate_proj.weight
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


def routing_rows(norm_topk_prob: Optional[bool]) -> tuple[Row[MoEArgs], ...]:
    """top_k and route_norm. ``norm_topk_prob``: the format's default for that key, or None when the
    format has none and always renormalises (Mixtral). A top-1 router that renormalises is refused:
    HF scales the one expert by 1, ours by its score."""

    def read(cfg: HFConfig, model_type: str) -> dict[str, object]:
        norm = True if norm_topk_prob is None else bool(cfg.get("norm_topk_prob", norm_topk_prob))
        if cfg["num_experts_per_tok"] == 1 and norm:
            field = "" if norm_topk_prob is None else " and norm_topk_prob=true"
            raise ConfigError(
                f"config.json has num_experts_per_tok=1{field}: {model_type} renormalises the one routing "
                "weight to 1, meshwright keeps the router score; they route the same tokens but scale them "
                "differently."
            )
        return {"route_norm": norm}

    def write(args: MoEArgs) -> dict[str, object]:
        # top-1 without renormalising is the raw score on both sides; the family refuses top-1 with it
        return {} if norm_topk_prob is None else {"norm_topk_prob": bool(args.route_norm and args.top_k > 1)}

    return (Key("top_k", "num_experts_per_tok"), Derived(read, write))


def _dense_layers_read(cfg: HFConfig, model_type: str) -> dict[str, object]:
    step = cfg.get("decoder_sparse_step", 1)
    dense = sorted(cfg.get("mlp_only_layers") or [])
    if step != 1 or dense != list(range(len(dense))):
        raise ConfigError(
            f"config.json: decoder_sparse_step={step}, mlp_only_layers={dense}; meshwright reads Qwen3-MoE "
            "with every layer sparse except a leading run of dense layers."
        )
    return {"first_k_dense": len(dense)}


def _dense_layers_write(args: MoEArgs) -> dict[str, object]:
    return {"decoder_sparse_step": 1, "mlp_only_layers": list(range(args.first_k_dense))}


# Softmax routing over routed experts only, every layer after the dense ones MoE.
_ROUTER_FIXED = {"score_func": "softmax", "route_scale": 1.0, "num_shared_experts": 0, "moe_layer_freq": 1}
_AUX_LOSS = Key[MoEArgs]("aux_loss_coeff", "router_aux_loss_coef", way="write")

MIXTRAL_HF_FORMAT: HFFormat[MoEArgs] = HFFormat(
    family="moe",
    model_type="mixtral",
    architecture="MixtralForCausalLM",
    rows=(
        *DECODER_ROWS,
        *GQA_ROWS,
        *routing_rows(None),
        Key("num_experts", "num_local_experts"),
        Key("moe_hidden_dim", "intermediate_size"),
        Key("ffn_hidden_dim", "intermediate_size", way="read"),  # no dense layer: the experts' size
        _AUX_LOSS,
    ),
    fixed={**_ROUTER_FIXED, "qk_norm": False, "first_k_dense": 0},
    hf_fixed={"output_router_logits": False, "sliding_window": None},
    sliding_window=SlidingWindow(),  # on whenever set (Mistral's rule)
)
QWEN3_MOE_HF_FORMAT: HFFormat[MoEArgs] = HFFormat(
    family="moe",
    model_type="qwen3_moe",
    architecture="Qwen3MoeForCausalLM",
    rows=(
        *DECODER_ROWS,
        *GQA_ROWS,
        FFN_ROW,
        *routing_rows(False),
        Key("num_experts", ("num_experts", "num_local_experts")),  # transformers 5 writes the second
        Key("moe_hidden_dim", "moe_intermediate_size"),
        _AUX_LOSS,
        Derived(_dense_layers_read, _dense_layers_write),
    ),
    fixed={**_ROUTER_FIXED, "qk_norm": True},
    hf_fixed={
        "output_router_logits": False,
        "attention_bias": False,
        "use_sliding_window": False,
        "sliding_window": None,
    },
    sliding_window=SlidingWindow(switch="use_sliding_window"),
)
_FORMATS = {fmt.model_type: fmt for fmt in (MIXTRAL_HF_FORMAT, QWEN3_MOE_HF_FORMAT)}


class MoEHF:
    """Hugging Face Mixtral / Qwen3-MoE <-> meshwright MoE. ``model_types`` lists both; the format
    of an export follows the args (``qk_norm`` -> Qwen3-MoE, else Mixtral)."""

    architecture = MIXTRAL_HF_FORMAT.architecture
    model_type = MIXTRAL_HF_FORMAT.model_type
    model_types = tuple(_FORMATS)

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
    ) -> HFConfig:
        """The ``config.json`` of ``args`` in its format (``format_of``)."""
        return write_hf_config(
            _FORMATS[self.format_of(args)], args, bos_id=bos_id, eos_id=eos_id, dtype=dtype
        )

    def args_from_hf_config(self, cfg: HFConfig) -> dict[str, Any]:
        """Our ``MoEArgs`` fields from a Mixtral / Qwen3-MoE ``config.json``; ``ConfigError`` naming the
        field when the folder's model computes something meshwright's cannot."""
        return read_hf_args(cfg, tuple(_FORMATS.values()))

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

    def folder_name(self, hf_name: str) -> str:
        """A folder's tensor name as ``hf_names_of`` spells it: the same (one architecture per folder)."""
        return hf_name

    def full_shape(self, name: str, hf_shapes: list[list[int]], args: Any) -> list[int]:
        if name.split(".")[-1] in ("w1", "w2", "w3") and ".moe.experts." in name:
            return [len(hf_shapes), *hf_shapes[0]]
        return hf_shapes[0]

    def read_slice(self, name: str, index: tuple[slice, ...], reader: HFTensorReader, args: Any) -> Tensor:
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
