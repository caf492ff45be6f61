"""The arguments of the mixture-of-experts family: ``MoEArgs`` (a Llama decoder plus the routing, expert
and balancing hyper-parameters) with its checks (``ConfigError`` naming the fix) and the choices they
allow. Imported by the decoder (``model.py``, which re-exports ``MoEArgs``), the HF adapter and the
families built on it (``models/deepseek_v3/``, ``models/qwen3_5/``)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from models.errors import ConfigError, check_choice
from models.llama.model import LlamaArgs, _positive_int

__all__ = ["AUX_LOSS_TYPES", "GROUPED_MM", "SCORE_FUNCS", "MoEArgs"]

SCORE_FUNCS = ("softmax", "sigmoid")
AUX_LOSS_TYPES = ("global", "sequence")
GROUPED_MM = ("auto", "on", "off")


@dataclass
class MoEArgs(LlamaArgs):
    """A Llama decoder plus the mixture-of-experts hyper-parameters."""

    family: str = "moe"
    num_experts: int = 8  # routed experts E per MoE layer
    top_k: int = 2  # experts per token
    moe_hidden_dim: int = 256  # SwiGLU hidden size F of one routed expert
    moe_layer_freq: int = 1  # layer i >= first_k_dense is MoE when i % moe_layer_freq == 0
    first_k_dense: int = 0  # the first k layers keep the dense FFN (hidden ffn_hidden_dim)
    num_shared_experts: int = 0  # always-on experts, fused into one SwiGLU of hidden num_shared * F
    score_func: str = "softmax"  # softmax | sigmoid (router scores, in fp32)
    route_norm: bool = True  # renormalise the top-k scores to sum 1
    route_scale: float = 1.0  # multiply the routing weights (DeepSeek-V3's routed_scaling_factor)
    n_group: int = 1  # experts form n_group equal groups; a token picks experts only inside ...
    topk_group: int = 1  # ... its topk_group best groups (group score: sum of its top-2 biased scores)
    bias_update_coeff: float = 0.0  # aux-loss-free balancing step (DeepSeek-V3: 1e-3); 0 = off
    aux_loss_coeff: float = 0.0  # auxiliary load-balancing loss weight; 0 = off
    aux_loss_type: str = "global"  # global (over a forward's tokens) | sequence (per sequence, averaged)
    capacity_factor: float = (
        0.0  # > 0: each expert takes at most ceil(cf * T * k / E) tokens, the rest are dropped
    )
    grouped_mm: str = "auto"  # auto (torch._grouped_mm on CUDA sm90+ in bf16) | on | off (padded bmm)

    def validate(self) -> None:
        """Raise ``ConfigError`` naming the bad value and the fix; return None when consistent."""
        if self.mup.enable:
            raise ConfigError(
                f"model.mup.enable=true with model.family={self.family}: µP (models/mup.py) is "
                "implemented for the dense Llama-style families (llama, qwen3) only; the experts, router and "
                "(DeepSeek-V3) latent attention have no µP rules here. Set model.mup.enable=false."
            )
        super().validate()
        for name in ("num_experts", "top_k", "moe_hidden_dim", "moe_layer_freq"):
            _positive_int(getattr(self, name), f"model.{name}")
        for name in ("first_k_dense", "num_shared_experts"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ConfigError(f"model.{name}={value!r} must be an integer >= 0.")
        for name in ("n_group", "topk_group"):
            _positive_int(getattr(self, name), f"model.{name}")
        if self.num_experts % self.n_group != 0 or self.topk_group > self.n_group:
            raise ConfigError(
                f"model.n_group={self.n_group} must divide model.num_experts={self.num_experts} and be >= "
                f"model.topk_group={self.topk_group}; n_group=1 turns group-limited routing off."
            )
        if self.n_group > 1 and self.top_k > self.topk_group * (self.num_experts // self.n_group):
            raise ConfigError(
                f"model.top_k={self.top_k} exceeds the "
                f"{self.topk_group * (self.num_experts // self.n_group)} experts "
                f"of the topk_group={self.topk_group} groups a token may use; raise topk_group or lower "
                "top_k."
            )
        if self.top_k > self.num_experts:
            raise ConfigError(
                f"model.top_k={self.top_k} exceeds model.num_experts={self.num_experts}: a token cannot pick "
                "more "
                f"experts than exist; use top_k <= {self.num_experts}."
            )
        for value, allowed, key in (
            (self.score_func, SCORE_FUNCS, "model.score_func"),
            (self.aux_loss_type, AUX_LOSS_TYPES, "model.aux_loss_type"),
            (self.grouped_mm, GROUPED_MM, "model.grouped_mm"),
        ):
            check_choice(value, allowed, key)
        for name in ("bias_update_coeff", "aux_loss_coeff", "capacity_factor"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise ConfigError(f"model.{name}={value!r} must be a finite number >= 0 (0 turns it off).")
        if not (isinstance(self.route_scale, (int, float)) and self.route_scale > 0):
            raise ConfigError(f"model.route_scale={self.route_scale!r} must be a positive number.")
        if not self.moe_layer_ids:
            raise ConfigError(
                f"no layer is an MoE layer (model.n_layers={self.n_layers}, "
                f"first_k_dense={self.first_k_dense}, "
                f"moe_layer_freq={self.moe_layer_freq}); lower first_k_dense or use the llama family."
            )

    def is_moe_layer(self, layer_id: int) -> bool:
        """Whether block ``layer_id`` has an MoE feed-forward (else Llama's dense one)."""
        return layer_id >= self.first_k_dense and layer_id % self.moe_layer_freq == 0

    @property
    def moe_layer_ids(self) -> list[int]:
        return [i for i in range(self.n_layers) if self.is_moe_layer(i)]
