"""Hugging Face adapter of the DeepSeek-V3 family (``DeepseekV3ForCausalLM``, transformers' own format:
per-expert tensors, ``e_score_correction_bias``, YaRN in ``rope_parameters``, ``rope_interleave``).

Tensor names (layer prefix ``model.layers.{i}.``)::

    attention.wq / wq_a / q_norm / wq_b     self_attn.q_proj / q_a_proj / q_a_layernorm / q_b_proj
    attention.wkv_a / kv_norm / wkv_b / wo  self_attn.kv_a_proj_with_mqa / kv_a_layernorm / kv_b_proj / o_proj
    attention_norm / ffn_norm               input_layernorm / post_attention_layernorm
    feed_forward.w1 / w3 / w2               mlp.gate_proj / up_proj / down_proj        (dense layers)
    moe.router.gate.weight                  mlp.gate.weight
    moe.expert_bias                         mlp.gate.e_score_correction_bias
    moe.experts.w1[j] / w3[j] / w2[j]       mlp.experts.{j}.gate_proj / up_proj / down_proj .weight
    moe.shared_experts.w1 / w3 / w2         mlp.shared_experts.gate_proj / up_proj / down_proj

RoPE layout: with ``rope_interleave=true`` (transformers' default, DeepSeek's checkpoints) the R rope
rows of each query head (in ``q_proj`` / ``q_b_proj``) and of the shared key (the last R rows of
``kv_a_proj_with_mqa``) rotate interleaved pairs (x0, x1), (x2, x3), ...; meshwright rotates halves
(x_i, x_{i+R/2}). Reading permutes those rows evens-then-odds, writing undoes it: the attention
scores are the same dot products (``hf_rope_interleave`` records the folder's layout for export).
MTP modules (``mtp.*``) have no transformers equivalent (it skips DeepSeek's layer 61): export
refuses a model with ``mtp_depth > 0``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Optional

import torch
from torch import Tensor

from models.deepseek_v3.model import DeepSeekV3Args, DeepSeekV3Transformer
from models.errors import ConfigError
from models.hf_config import (
    DECODER_ROWS,
    FFN_ROW,
    Derived,
    HFConfig,
    HFFormat,
    Key,
    read_hf_args,
    write_hf_config,
)
from models.hf_tensors import LLAMA_HF_TOP_NAMES, finish_state_from_hf
from models.moe.hf import routing_rows
from models.spec import HFTensorReader

__all__ = ["DEEPSEEK_V3_HF_FORMAT", "DeepSeekV3HF"]

_LAYER_NAMES = {
    "attention.wq": "self_attn.q_proj",
    "attention.wq_a": "self_attn.q_a_proj",
    "attention.q_norm": "self_attn.q_a_layernorm",
    "attention.wq_b": "self_attn.q_b_proj",
    "attention.wkv_a": "self_attn.kv_a_proj_with_mqa",
    "attention.kv_norm": "self_attn.kv_a_layernorm",
    "attention.wkv_b": "self_attn.kv_b_proj",
    "attention.wo": "self_attn.o_proj",
    "attention_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "feed_forward.w1": "mlp.gate_proj",
    "feed_forward.w3": "mlp.up_proj",
    "feed_forward.w2": "mlp.down_proj",
    "moe.router.gate": "mlp.gate",
    "moe.shared_experts.w1": "mlp.shared_experts.gate_proj",
    "moe.shared_experts.w3": "mlp.shared_experts.up_proj",
    "moe.shared_experts.w2": "mlp.shared_experts.down_proj",
}
_EXPERT_NAMES = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}
_ROPE_ROWS = ("attention.wq.weight", "attention.wq_b.weight", "attention.wkv_a.weight")


def _rope_row_order(name: str, args: DeepSeekV3Args, *, to_hf: bool) -> Optional[Tensor]:
    """Row permutation between the interleaved (HF) and rotate-half (ours) layouts of ``name``, or None."""
    local = name.split(".", 2)[-1] if name.startswith("layers.") else ""
    if not args.hf_rope_interleave or local not in _ROPE_ROWS:
        return None
    R = args.qk_rope_head_dim
    half = torch.cat([torch.arange(0, R, 2), torch.arange(1, R, 2)])  # ours[j] = hf[half[j]]
    rope = half if not to_hf else torch.argsort(half)
    if local == "attention.wkv_a.weight":
        C = args.kv_lora_rank
        return torch.cat([torch.arange(C), C + rope])
    qk, nope = args.qk_head_dim, args.qk_nope_head_dim
    head = torch.cat([torch.arange(nope), nope + rope])  # (Dqk,)
    return (torch.arange(args.n_heads)[:, None] * qk + head[None]).reshape(-1)


def _mla_write(args: DeepSeekV3Args) -> dict[str, object]:
    """What transformers' attention config says of MLA: every head its own key (no GQA), and
    ``head_dim`` the RoPE size (the size of its rotary cache)."""
    return {"num_key_value_heads": args.n_heads, "head_dim": args.qk_rope_head_dim}


DEEPSEEK_V3_HF_FORMAT: HFFormat[DeepSeekV3Args] = HFFormat(
    family="deepseek_v3",
    model_type="deepseek_v3",
    architecture="DeepseekV3ForCausalLM",
    rows=(
        *DECODER_ROWS,
        Derived(write=_mla_write),
        FFN_ROW,
        Key("moe_hidden_dim", "moe_intermediate_size"),
        Key("num_experts", "n_routed_experts"),
        Key("num_shared_experts", "n_shared_experts", 1),
        *routing_rows(True),
        Key("route_scale", "routed_scaling_factor", 1.0, read=float),
        Key("n_group", "n_group", 1),
        Key("topk_group", "topk_group", 1),
        Key("first_k_dense", "first_k_dense_replace", 0),
        Key("q_lora_rank", "q_lora_rank", None),
        Key("kv_lora_rank", "kv_lora_rank"),
        Key("qk_nope_head_dim", "qk_nope_head_dim"),
        Key("qk_rope_head_dim", "qk_rope_head_dim"),
        Key("v_head_dim", "v_head_dim"),
        Key(
            "hf_rope_interleave",
            "rope_interleave",
            True,
            read=bool,
            write=lambda a: bool(a.hf_rope_interleave),
        ),
    ),
    # sigmoid routing, every layer after the dense ones MoE, no MTP modules in transformers' format
    fixed={"score_func": "sigmoid", "moe_layer_freq": 1, "mtp_depth": 0},
    hf_fixed={"attention_bias": False, "num_nextn_predict_layers": 0},
)


class DeepSeekV3HF:
    """Hugging Face ``DeepseekV3ForCausalLM`` <-> meshwright DeepSeek-V3."""

    architecture = DEEPSEEK_V3_HF_FORMAT.architecture
    model_type = DEEPSEEK_V3_HF_FORMAT.model_type
    model_types = (model_type,)

    @staticmethod
    def check_exportable(args: DeepSeekV3Args) -> None:
        """``ConfigError`` naming what ``DeepseekV3ForCausalLM`` cannot represent."""
        problems = []
        if args.score_func != "sigmoid":
            problems.append(f"score_func={args.score_func} (DeepSeek-V3 routes with sigmoid scores)")
        if args.moe_layer_freq != 1:
            problems.append(f"moe_layer_freq={args.moe_layer_freq} (every layer after the dense ones is MoE)")
        if args.num_shared_experts < 1:
            problems.append("num_shared_experts=0 (DeepSeek-V3 always has shared experts)")
        if args.top_k == 1 and args.route_norm:
            problems.append("top_k=1 with route_norm (transformers renormalises the one weight to 1)")
        if args.capacity_factor > 0:
            problems.append(f"capacity_factor={args.capacity_factor} (token dropping)")
        if args.mtp_depth:
            problems.append(f"mtp_depth={args.mtp_depth} (transformers has no MTP modules)")
        if problems:
            raise ConfigError(
                f"the model cannot be written as Hugging Face deepseek_v3: {'; '.join(problems)}."
            )

    def to_hf_config(
        self, args: DeepSeekV3Args, *, bos_id: Optional[int], eos_id: Optional[int], dtype: str
    ) -> HFConfig:
        """The ``config.json`` of ``args`` (``ConfigError`` when the format cannot hold the model)."""
        self.check_exportable(args)
        return write_hf_config(DEEPSEEK_V3_HF_FORMAT, args, bos_id=bos_id, eos_id=eos_id, dtype=dtype)

    def args_from_hf_config(self, cfg: HFConfig) -> dict[str, Any]:
        """Our ``DeepSeekV3Args`` fields from a ``deepseek_v3`` ``config.json``."""
        return read_hf_args(cfg, (DEEPSEEK_V3_HF_FORMAT,))

    # -- names ------------------------------------------------------------------------
    def hf_names_of(self, name: str, args: DeepSeekV3Args) -> list[str]:
        """HF tensor(s) of our ``name``: one, or one per expert for the stacked expert weights."""
        if name in LLAMA_HF_TOP_NAMES:
            return [LLAMA_HF_TOP_NAMES[name]]
        parts = name.split(".")
        if len(parts) >= 3 and parts[0] == "layers":
            prefix, local = f"model.layers.{parts[1]}", ".".join(parts[2:])
            if local == "moe.expert_bias":
                return [f"{prefix}.mlp.gate.e_score_correction_bias"]
            if local.startswith("moe.experts.") and parts[-1] in _EXPERT_NAMES:
                proj = _EXPERT_NAMES[parts[-1]]
                return [f"{prefix}.mlp.experts.{j}.{proj}.weight" for j in range(args.num_experts)]
            module, _, leaf = local.rpartition(".")
            if module in _LAYER_NAMES and leaf == "weight":
                return [f"{prefix}.{_LAYER_NAMES[module]}.weight"]
        raise ConfigError(f"parameter {name!r} has no Hugging Face deepseek_v3 equivalent.")

    def folder_name(self, hf_name: str) -> str:
        """A folder's tensor name as ``hf_names_of`` spells it: the same (one architecture per folder)."""
        return hf_name

    def full_shape(self, name: str, hf_shapes: list[list[int]], args: Any) -> list[int]:
        if ".moe.experts." in name:
            return [len(hf_shapes), *hf_shapes[0]]
        return hf_shapes[0]

    def read_slice(
        self, name: str, index: tuple[slice, ...], reader: HFTensorReader, args: DeepSeekV3Args
    ) -> Tensor:
        hf_names = self.hf_names_of(name, args)
        if ".moe.experts." in name:
            experts = range(args.num_experts)[index[0]]
            return torch.stack([reader.read(hf_names[j], index[1:]) for j in experts])
        order = _rope_row_order(name, args, to_hf=False)
        if order is None:
            return reader.read(hf_names[0], index)
        # The permutation stays inside each head's rope rows: read the slice's bounding rows, then pick.
        rows = order[index[0]] if index else order
        lo, hi = int(rows.min()), int(rows.max()) + 1
        return reader.read(hf_names[0], (slice(lo, hi), *index[1:]))[rows - lo]

    def to_hf_state(self, state: dict[str, Tensor], args: DeepSeekV3Args) -> Iterator[tuple[str, Tensor]]:
        if args.mtp_depth:
            self.check_exportable(args)
        for name, tensor in state.items():
            if args.tie_embeddings and name == "output.weight":
                continue
            hf_names = self.hf_names_of(name, args)
            if ".moe.experts." in name:
                yield from zip(hf_names, tensor.unbind(0))
                continue
            order = _rope_row_order(name, args, to_hf=True)
            yield hf_names[0], (tensor if order is None or tensor.is_meta else tensor[order])

    def from_hf_state(self, hf_state: dict[str, Tensor], args: DeepSeekV3Args) -> dict[str, Tensor]:
        """HF tensors -> our full state dict; ``ConfigError`` naming a missing or a leftover tensor."""
        with torch.device("meta"):
            names = list(DeepSeekV3Transformer(args).state_dict())
        state, used = {}, set()
        for name in names:
            hf_names = self.hf_names_of(name, args)
            missing = [n for n in hf_names if n not in hf_state]
            if missing:
                if name == "output.weight" and args.tie_embeddings:
                    continue
                raise ConfigError(f"Hugging Face state has no tensor {missing[0]!r} (for {name!r}).")
            used.update(hf_names)
            if ".moe.experts." in name:
                state[name] = torch.stack([hf_state[n] for n in hf_names])
                continue
            order = _rope_row_order(name, args, to_hf=False)
            state[name] = hf_state[hf_names[0]] if order is None else hf_state[hf_names[0]][order]
        return finish_state_from_hf(state, hf_state, used, args, "deepseek_v3")
