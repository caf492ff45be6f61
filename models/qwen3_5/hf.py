"""Hugging Face adapter of the Qwen3.5 families: ``Qwen3_5ForCausalLM`` (model_type ``qwen3_5_text``)
and ``Qwen3_5MoeForCausalLM`` (``qwen3_5_moe_text``), written and read; the text decoder of the
published vision-language folders (``Qwen3_5ForConditionalGeneration`` / ``Qwen3_5MoeForConditional
Generation``, model_type ``qwen3_5`` / ``qwen3_5_moe``: the text config under ``text_config``, the
decoder's tensors under ``model.language_model.``) read, their vision tower (``model.visual.*``) and
multi-token-prediction weights (``mtp.*``) named and skipped; and Qwen3-Next (``Qwen3NextForCausalLM``,
model_type ``qwen3_next``: Qwen3.5-MoE's layers with the DeltaNet's projections fused differently, below).

Tensor names (``model.layers.{i}.`` omitted on the HF side)::

    attention_norm / ffn_norm                input_layernorm / post_attention_layernorm (zero-centred)
    attention.{wq,wk,wv,wo}                  self_attn.{q_proj,k_proj,v_proj,o_proj} (q_proj: query|gate)
    attention.{q_norm,k_norm}                self_attn.{q_norm,k_norm}
    delta_net.{wq,wk,wv}                     linear_attn.in_proj_qkv rows [0, kd), [kd, 2kd), [2kd, 2kd + vd)
    delta_net.{q_conv,k_conv,v_conv}.weight  linear_attn.conv1d.weight, the same row ranges
    delta_net.{wz,wb,wa,wo}                  linear_attn.{in_proj_z,in_proj_b,in_proj_a,out_proj}
    delta_net.decay.{A_log,dt_bias}          linear_attn.{A_log,dt_bias}
    delta_net.norm.weight                    linear_attn.norm.weight
    feed_forward.{w1,w3,w2}                  mlp.{gate_proj,up_proj,down_proj}
    moe.router.gate                          mlp.gate
    moe.experts.{w1,w3,w2}[j]                mlp.experts.{j}.{gate_proj,up_proj,down_proj}
    moe.shared_experts.{w1,w3,w2}            mlp.shared_expert.{gate_proj,up_proj,down_proj}
    moe.shared_experts.gate                  mlp.shared_expert_gate
    moe.expert_bias                          none (HF routes without a bias: zero on import, export refuses
                                             a non-zero one)

Qwen3-Next fuses all six DeltaNet projections into two tensors, grouped by key head: per key head g
(of nk; r = nv / nk value heads per key head) ``linear_attn.in_proj_qkvz`` holds q (dk rows), k (dk),
v (r dv), z (r dv) of its heads and ``linear_attn.in_proj_ba`` holds b (r), a (r); ``conv1d`` is
Qwen3.5's (q | k | v). The decoder's MoE keys are Qwen3.5-MoE's plus ``norm_topk_prob`` (true),
``decoder_sparse_step`` (1) and ``mlp_only_layers`` ([]): every layer MoE, as ours (other values are
refused by name).

Our projections and convolutions are separate tensors (a tensor-parallel column shard of each keeps
whole heads); HF fuses them, so an export interleaves them back (``to_hf_state`` needs every part of
a fused tensor together) and an import reads each part's runs of rows (``_part_runs``: one range for
Qwen3.5, one per key-head group for Qwen3-Next's fused projections).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Optional, Union

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
    read_hf_args,
    write_hf_config,
)
from models.hf_tensors import finish_state_from_hf
from models.qwen3_5.args import Qwen3NextArgs
from models.qwen3_5.model import Qwen3_5Args, Qwen3_5MoeArgs, Qwen3_5Transformer
from models.spec import HFTensorReader

__all__ = ["QWEN3_5_HF_FORMAT", "QWEN3_5_MOE_HF_FORMAT", "QWEN3_NEXT_HF_FORMAT", "Qwen3_5HF"]

# -- config.json ---------------------------------------------------------------------------------


def _rope_read(cfg: HFConfig, model_type: str) -> dict[str, object]:
    rope = dict(cfg.get("rope_parameters") or {})
    factor = rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor"))
    return {"partial_rotary_factor": float(factor) if factor is not None else 0.25}


def _rope_write(args: Qwen3_5Args) -> dict[str, object]:
    return {
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": args.rope_theta,
            "partial_rotary_factor": args.partial_rotary_factor,
        },
        "partial_rotary_factor": args.partial_rotary_factor,
    }


def _layers_read(cfg: HFConfig, model_type: str) -> dict[str, object]:
    """``layer_types`` (or ``full_attention_interval``) -> our interval; a pattern that is not every
    interval-th layer full is refused by name."""
    n = cfg["num_hidden_layers"]
    kinds = cfg.get("layer_types")
    if not kinds:
        return {"full_attention_interval": int(cfg.get("full_attention_interval", 4))}
    full = [i for i, kind in enumerate(kinds) if kind == "full_attention"]
    unknown = sorted({k for k in kinds if k not in ("full_attention", "linear_attention")})
    interval = full[0] + 1 if full else n + 1
    want = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n)]
    if unknown or len(kinds) != n or kinds != want:
        raise ConfigError(
            f"config.json has layer_types={kinds}; meshwright's Qwen3.5 has full attention on every "
            "full_attention_interval-th layer (layers i with (i + 1) % interval == 0) and Gated DeltaNet on "
            "the others."
        )
    return {"full_attention_interval": interval}


def _layers_write(args: Qwen3_5Args) -> dict[str, object]:
    return {"layer_types": args.layer_types, "full_attention_interval": args.full_attention_interval}


_LINEAR_ROWS: tuple[Row[Qwen3_5Args], ...] = (
    Key("linear_num_key_heads", "linear_num_key_heads"),
    Key("linear_num_value_heads", "linear_num_value_heads"),
    Key("linear_key_head_dim", "linear_key_head_dim"),
    Key("linear_value_head_dim", "linear_value_head_dim"),
    Key("linear_conv_kernel", "linear_conv_kernel_dim", 4),
    Derived(_layers_read, _layers_write),
    Derived(_rope_read, _rope_write),
)

QWEN3_5_HF_FORMAT: HFFormat[Qwen3_5Args] = HFFormat(
    family="qwen3_5",
    model_type="qwen3_5_text",
    architecture="Qwen3_5ForCausalLM",
    rows=(*DECODER_ROWS, *GQA_ROWS, FFN_ROW, *_LINEAR_ROWS),
    fixed={"qk_norm": True},
    hf_fixed={"attention_bias": False},
)

_MOE_FIXED = {
    "qk_norm": True,
    "score_func": "softmax",
    "route_norm": True,
    "route_scale": 1.0,
    "num_shared_experts": 0,
    "moe_layer_freq": 1,
    "first_k_dense": 0,
    "n_group": 1,
    "topk_group": 1,
}
QWEN3_5_MOE_HF_FORMAT: HFFormat[Qwen3_5MoeArgs] = HFFormat(
    family="qwen3_5_moe",
    model_type="qwen3_5_moe_text",
    architecture="Qwen3_5MoeForCausalLM",
    rows=(
        *DECODER_ROWS,
        *GQA_ROWS,
        *_LINEAR_ROWS,
        Key("num_experts", "num_experts"),
        Key("top_k", "num_experts_per_tok"),
        Key("moe_hidden_dim", "moe_intermediate_size"),
        Key("shared_expert_hidden_dim", "shared_expert_intermediate_size"),
        Key("aux_loss_coeff", "router_aux_loss_coef", way="write"),
    ),
    fixed=_MOE_FIXED,
    hf_fixed={"attention_bias": False, "output_router_logits": False},
)


def _next_moe_read(cfg: HFConfig, model_type: str) -> dict[str, object]:
    """Qwen3-Next's MoE layout keys: every layer MoE with renormalised top-k weights, or refused."""
    sparse, dense_layers = cfg.get("decoder_sparse_step", 1), cfg.get("mlp_only_layers") or []
    if sparse != 1 or dense_layers or cfg.get("norm_topk_prob", True) is not True:
        raise ConfigError(
            f"config.json has decoder_sparse_step={sparse}, mlp_only_layers={dense_layers}, "
            f"norm_topk_prob={cfg.get('norm_topk_prob')}: meshwright's Qwen3-Next has experts in every "
            "layer (decoder_sparse_step=1, mlp_only_layers=[]) and renormalised top-k weights "
            "(norm_topk_prob=true)."
        )
    return {}


def _next_moe_write(args: Qwen3NextArgs) -> dict[str, object]:
    return {"decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": True}


QWEN3_NEXT_HF_FORMAT: HFFormat[Qwen3NextArgs] = HFFormat(
    family="qwen3_next",
    model_type="qwen3_next",
    architecture="Qwen3NextForCausalLM",
    rows=(
        *DECODER_ROWS,
        *GQA_ROWS,
        *_LINEAR_ROWS,
        Key("num_experts", "num_experts"),
        Key("top_k", "num_experts_per_tok"),
        Key("moe_hidden_dim", "moe_intermediate_size"),
        Key("shared_expert_hidden_dim", "shared_expert_intermediate_size"),
        Key("aux_loss_coeff", "router_aux_loss_coef", way="write"),
        Derived(_next_moe_read, _next_moe_write),
    ),
    fixed=_MOE_FIXED,
    hf_fixed={"attention_bias": False, "output_router_logits": False},
)
# The vision-language folders' model_type (config.json's top level) -> their text format
_VL_MODEL_TYPES = {"qwen3_5": QWEN3_5_HF_FORMAT, "qwen3_5_moe": QWEN3_5_MOE_HF_FORMAT}
VL_PREFIX = "model.language_model."  # the text decoder's tensors in a vision-language folder
VL_SKIPPED = {"model.visual.": "the vision tower", "mtp.": "the multi-token-prediction module"}

# -- tensor names ----------------------------------------------------------------------------------

_LAYER_NAMES = {  # our name in a block -> HF's (full names)
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "attention.q_norm.weight": "self_attn.q_norm.weight",
    "attention.k_norm.weight": "self_attn.k_norm.weight",
    "delta_net.wz.weight": "linear_attn.in_proj_z.weight",
    "delta_net.wb.weight": "linear_attn.in_proj_b.weight",
    "delta_net.wa.weight": "linear_attn.in_proj_a.weight",
    "delta_net.wo.weight": "linear_attn.out_proj.weight",
    "delta_net.decay.A_log": "linear_attn.A_log",
    "delta_net.decay.dt_bias": "linear_attn.dt_bias",
    "delta_net.norm.weight": "linear_attn.norm.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "moe.router.gate.weight": "mlp.gate.weight",
    "moe.shared_experts.w1.weight": "mlp.shared_expert.gate_proj.weight",
    "moe.shared_experts.w3.weight": "mlp.shared_expert.up_proj.weight",
    "moe.shared_experts.w2.weight": "mlp.shared_expert.down_proj.weight",
    "moe.shared_experts.gate.weight": "mlp.shared_expert_gate.weight",
}
_TOP_NAMES = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_EXPERT_NAMES = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
# Our separate tensors that are rows of one fused HF tensor: local name -> (HF local name, part)
_CONV = {
    "delta_net.q_conv.weight": ("linear_attn.conv1d.weight", 0),
    "delta_net.k_conv.weight": ("linear_attn.conv1d.weight", 1),
    "delta_net.v_conv.weight": ("linear_attn.conv1d.weight", 2),
}
_FUSED = {
    "delta_net.wq.weight": ("linear_attn.in_proj_qkv.weight", 0),
    "delta_net.wk.weight": ("linear_attn.in_proj_qkv.weight", 1),
    "delta_net.wv.weight": ("linear_attn.in_proj_qkv.weight", 2),
    **_CONV,
}
_QKVZ, _BA = "linear_attn.in_proj_qkvz.weight", "linear_attn.in_proj_ba.weight"
_NEXT_FUSED = {  # Qwen3-Next
    "delta_net.wq.weight": (_QKVZ, 0),
    "delta_net.wk.weight": (_QKVZ, 1),
    "delta_net.wv.weight": (_QKVZ, 2),
    "delta_net.wz.weight": (_QKVZ, 3),
    "delta_net.wb.weight": (_BA, 0),
    "delta_net.wa.weight": (_BA, 1),
    **_CONV,
}


def _part_runs(args: Qwen3_5Args, hf_local: str, part: int) -> list[tuple[int, int]]:
    """The (first HF row, rows) runs holding our part ``part`` of the fused ``hf_local``, in our row
    order: one run for q | k | v (Qwen3.5's ``in_proj_qkv``, every ``conv1d``), one per key-head group
    for Qwen3-Next's ``in_proj_qkvz`` (q dk, k dk, v r dv, z r dv per group) and ``in_proj_ba`` (b r,
    a r)."""
    nk, nv = args.linear_num_key_heads, args.linear_num_value_heads
    dk, dv, r = args.linear_key_head_dim, args.linear_value_head_dim, nv // nk
    sizes: tuple[int, ...]
    if hf_local in (_QKVZ, _BA):
        sizes = (dk, dk, r * dv, r * dv) if hf_local == _QKVZ else (r, r)
        width, offset = sum(sizes), sum(sizes[:part])
        return [(g * width + offset, sizes[part]) for g in range(nk)]
    sizes = (nk * dk, nk * dk, nv * dv)
    return [(sum(sizes[:part]), sizes[part])]


def _runs_in(runs: list[tuple[int, int]], rows: slice) -> list[tuple[int, int]]:
    """The HF row ranges (start, stop) of our rows ``rows`` (a range of the part), run by run."""
    out, offset = [], 0
    first, stop = rows.start or 0, rows.stop
    for start, n in runs:
        lo, hi = max(first, offset), min(stop, offset + n)
        if lo < hi:
            out.append((start + lo - offset, start + hi - offset))
        offset += n
    return out


def _split(name: str) -> tuple[str, str]:
    """(layer, local name) of ``layers.{i}.<local>``."""
    parts = name.split(".", 2)
    if len(parts) < 3 or parts[0] != "layers":
        raise ConfigError(f"parameter {name!r} has no Hugging Face Qwen3.5 equivalent.")
    return parts[1], parts[2]


class Qwen3_5HF:
    """Hugging Face Qwen3.5 (dense or MoE, by ``family``) <-> meshwright (config and tensor names)."""

    def __init__(self, family: str) -> None:
        self.family = family
        self.hf_format: Union[HFFormat[Qwen3_5Args], HFFormat[Qwen3_5MoeArgs], HFFormat[Qwen3NextArgs]]
        if family == "qwen3_next":
            self.hf_format = QWEN3_NEXT_HF_FORMAT
        elif family == "qwen3_5_moe":
            self.hf_format = QWEN3_5_MOE_HF_FORMAT
        else:
            self.hf_format = QWEN3_5_HF_FORMAT
        # the vision-language folders' model_type (Qwen3-Next has none)
        self.vl_model_type: Optional[str] = {"qwen3_5_moe": "qwen3_5_moe", "qwen3_5": "qwen3_5"}.get(family)
        self.fused = _NEXT_FUSED if family == "qwen3_next" else _FUSED

    @property
    def architecture(self) -> str:
        return self.hf_format.architecture

    @property
    def model_type(self) -> str:
        return self.hf_format.model_type

    @property
    def model_types(self) -> tuple[str, ...]:
        """The text model's type and the vision-language folder's (whose text decoder is read)."""
        vl = (self.vl_model_type,) if self.vl_model_type is not None else ()
        return (self.hf_format.model_type, *vl)

    # -- config ----------------------------------------------------------------------------
    def to_hf_config(
        self, args: Qwen3_5Args, *, bos_id: Optional[int], eos_id: Optional[int], dtype: str
    ) -> HFConfig:
        """The ``config.json`` of ``args`` (the text model, ``...ForCausalLM``)."""
        if isinstance(args, Qwen3_5MoeArgs):
            problems = [
                f"{key}={getattr(args, key)!r}"
                for key, want in _MOE_FIXED.items()
                if key != "qk_norm" and getattr(args, key) != want
            ]
            if problems:
                raise ConfigError(
                    f"the Qwen3.5-MoE model cannot be written as Hugging Face {self.architecture}: "
                    f"{', '.join(problems)} have no equivalent there (it routes by softmax with renormalised "
                    "top-k weights, every layer MoE)."
                )
            if isinstance(args, Qwen3NextArgs):
                return write_hf_config(QWEN3_NEXT_HF_FORMAT, args, bos_id=bos_id, eos_id=eos_id, dtype=dtype)
            return write_hf_config(QWEN3_5_MOE_HF_FORMAT, args, bos_id=bos_id, eos_id=eos_id, dtype=dtype)
        return write_hf_config(QWEN3_5_HF_FORMAT, args, bos_id=bos_id, eos_id=eos_id, dtype=dtype)

    def args_from_hf_config(self, cfg: HFConfig) -> HFConfig:
        """Our args fields from a text ``config.json``, or from the ``text_config`` of a vision-language
        one (its top-level ``tie_word_embeddings`` wins, as transformers ties by it)."""
        if self.vl_model_type is not None and cfg.get("model_type") == self.vl_model_type:
            text = dict(cfg.get("text_config") or {})
            if not text:
                raise ConfigError(f"config.json of model_type={self.vl_model_type!r} has no text_config.")
            if "tie_word_embeddings" in cfg:
                text["tie_word_embeddings"] = cfg["tie_word_embeddings"]
            text["model_type"] = self.hf_format.model_type
            cfg = text
        if self.family == "qwen3_next":
            return read_hf_args(cfg, (QWEN3_NEXT_HF_FORMAT,))
        if self.family == "qwen3_5_moe":
            return read_hf_args(cfg, (QWEN3_5_MOE_HF_FORMAT,))
        return read_hf_args(cfg, (QWEN3_5_HF_FORMAT,))

    # -- names -------------------------------------------------------------------------------
    def hf_names_of(self, name: str, args: Qwen3_5Args) -> list[str]:
        """HF tensor(s) of our ``name``: one (a fused tensor for the DeltaNet's q/k/v projections and
        convolutions), one per expert for stacked expert weights, none for the routing bias."""
        if name in _TOP_NAMES:
            return [_TOP_NAMES[name]]
        layer, local = _split(name)
        prefix = f"model.layers.{layer}."
        if local == "moe.expert_bias":
            return []
        if (
            local.startswith("moe.experts.")
            and local.split(".")[-1] in _EXPERT_NAMES
            and isinstance(args, Qwen3_5MoeArgs)
        ):
            proj = _EXPERT_NAMES[local.split(".")[-1]]
            return [f"{prefix}mlp.experts.{j}.{proj}.weight" for j in range(args.num_experts)]
        if local in self.fused:
            return [prefix + self.fused[local][0]]
        if local in _LAYER_NAMES:
            return [prefix + _LAYER_NAMES[local]]
        raise ConfigError(f"parameter {name!r} has no Hugging Face {self.architecture} equivalent.")

    def folder_name(self, hf_name: str) -> Optional[str]:
        """A vision-language folder's decoder tensor as the text model names it
        (``model.language_model.X`` -> ``model.X``); None for its vision tower and MTP weights
        (skipped); any other name unchanged."""
        if hf_name.startswith(VL_PREFIX):
            return "model." + hf_name[len(VL_PREFIX) :]
        if hf_name.startswith(tuple(VL_SKIPPED)):
            return None
        return hf_name

    def _fused_runs(self, name: str, args: Qwen3_5Args) -> Optional[list[tuple[int, int]]]:
        """The HF row runs of ``name`` when it is a part of a fused HF tensor (``_part_runs``), else None."""
        if not name.startswith("layers."):
            return None
        _, local = _split(name)
        if local not in self.fused:
            return None
        hf_local, part = self.fused[local]
        return _part_runs(args, hf_local, part)

    def full_shape(self, name: str, hf_shapes: list[list[int]], args: Qwen3_5Args) -> list[int]:
        """Our full shape of ``name`` from its HF tensors' shapes."""
        runs = self._fused_runs(name, args)
        if runs is not None:
            return [sum(n for _, n in runs), *hf_shapes[0][1:]]
        if ".moe.experts." in name:
            return [len(hf_shapes), *hf_shapes[0]]
        return hf_shapes[0]

    def read_slice(
        self, name: str, index: tuple[slice, ...], reader: HFTensorReader, args: Qwen3_5Args
    ) -> Tensor:
        """The ``index`` slice of our ``name``: a row range of a fused tensor, a range of experts."""
        hf_names = self.hf_names_of(name, args)
        runs = self._fused_runs(name, args)
        if runs is not None:
            pieces = [
                reader.read(hf_names[0], (slice(a, b), *index[1:])) for a, b in _runs_in(runs, index[0])
            ]
            return torch.cat(pieces, dim=0)
        if ".moe.experts." in name:
            experts = range(len(hf_names))[index[0]]
            return torch.stack([reader.read(hf_names[j], index[1:]) for j in experts])
        return reader.read(hf_names[0], index)

    # -- whole states ------------------------------------------------------------------------
    def to_hf_state(self, state: dict[str, Tensor], args: Qwen3_5Args) -> Iterator[tuple[str, Tensor]]:
        """Our full tensors -> (HF name, tensor); the DeltaNet's q/k/v pieces are concatenated into
        HF's fused tensors, so ``state`` must hold the three of each (``ConfigError`` otherwise)."""
        fused: dict[str, dict[str, Tensor]] = {}
        for name, tensor in state.items():
            if name.endswith("moe.expert_bias"):  # a meta tensor (a dry run) has no value to check
                if not tensor.is_meta and torch.count_nonzero(tensor):
                    raise ConfigError(
                        f"{name} is non-zero (aux-loss-free balancing moved it); Hugging Face "
                        f"{self.architecture} has no expert bias, so routing would change. Export a model "
                        "trained with model.bias_update_coeff=0."
                    )
                continue
            if args.tie_embeddings and name == "output.weight":
                continue
            hf_names = self.hf_names_of(name, args)
            if self._fused_runs(name, args) is not None:
                fused.setdefault(hf_names[0], {})[name] = tensor
            elif ".moe.experts." in name:
                yield from zip(hf_names, tensor.unbind(0))
            else:
                yield hf_names[0], tensor
        for hf_name, parts in fused.items():
            hf_local = hf_name.split(".", 3)[3]
            layer = hf_name.split(".")[2]
            want = [f"layers.{layer}.{local}" for local, (h, _) in self.fused.items() if h == hf_local]
            if sorted(parts) != sorted(want):
                raise ConfigError(
                    f"Hugging Face {hf_name} fuses the Gated DeltaNet's {', '.join(want)}; export them "
                    "together (this state holds only some of them)."
                )
            pieces: list[tuple[int, Tensor]] = []  # (first HF row, rows): the runs tile the HF tensor
            for name, tensor in parts.items():
                runs = self._fused_runs(name, args)
                assert runs is not None  # a fused part
                offset = 0
                for start, n in runs:
                    pieces.append((start, tensor[offset : offset + n]))
                    offset += n
            pieces.sort(key=lambda piece: piece[0])
            yield hf_name, torch.cat([t for _, t in pieces], dim=0)

    def from_hf_state(self, hf_state: dict[str, Tensor], args: Qwen3_5Args) -> dict[str, Tensor]:
        """HF tensors (by ``folder_name``'s names: a vision-language folder's decoder renamed, its vision
        tower and MTP weights left out by the reader) -> our full state dict (the routing bias starts at
        zero). ``ConfigError`` naming a tensor the folder lacks, or one it has that the model does not."""
        with torch.device("meta"):
            shapes = {n: t.shape for n, t in Qwen3_5Transformer(args).state_dict().items()}
        state: dict[str, Tensor] = {}
        used: set[str] = set()
        for name, shape in shapes.items():
            hf_names = self.hf_names_of(name, args)
            if not hf_names:
                state[name] = torch.zeros(shape)
                continue
            missing = [n for n in hf_names if n not in hf_state]
            if missing:
                if name == "output.weight" and args.tie_embeddings:
                    continue
                raise ConfigError(f"Hugging Face state has no tensor {missing[0]!r} (for {name!r}).")
            used.update(hf_names)
            runs = self._fused_runs(name, args)
            if runs is not None:
                fused = hf_state[hf_names[0]]
                state[name] = torch.cat([fused[start : start + n] for start, n in runs], dim=0)
            elif ".moe.experts." in name:
                state[name] = torch.stack([hf_state[n] for n in hf_names])
            else:
                state[name] = hf_state[hf_names[0]]
        return finish_state_from_hf(state, hf_state, used, args, self.architecture)
