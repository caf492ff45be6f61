"""The arguments of the Qwen3.5 families: ``Qwen3_5Args`` (dense) and ``Qwen3_5MoeArgs`` (MoE), with
their checks (``ConfigError`` naming the fix). Imported by the layers (``delta_net.py``) and the
decoder (``model.py``, which re-exports them)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from models.attention import validate_attention_mask
from models.errors import ConfigError
from models.llama.model import LlamaArgs, _positive_int
from models.moe.args import MoEArgs
from models.qwen3_5.kernels import LINEAR_KERNELS

__all__ = ["Qwen3NextArgs", "Qwen3_5Args", "Qwen3_5MoeArgs"]


# --------------------------------------------------------------------------------------------
# Arguments
# --------------------------------------------------------------------------------------------


@dataclass
class Qwen3_5Args(LlamaArgs):
    """A Qwen3.5 dense decoder: Llama's shape fields (full-attention heads, SwiGLU) plus the layer
    pattern, the partial RoPE and the Gated DeltaNet's heads."""

    family: str = "qwen3_5"
    attn_head_dim: Optional[int] = 256  # full attention: explicit head size
    qk_norm: bool = True  # always on (zero-centred q/k head norms)
    norm_eps: float = 1e-6
    rope_theta: float = 10000000.0
    partial_rotary_factor: float = 0.25  # RoPE on the first head_dim * factor channels of each head
    full_attention_interval: int = 4  # block i has full attention when (i + 1) % interval == 0
    linear_num_key_heads: int = 16  # Gated DeltaNet query/key heads nk
    linear_num_value_heads: int = 32  # value heads nv (a multiple of nk; each reads key head j // (nv/nk))
    linear_key_head_dim: int = 128  # dk
    linear_value_head_dim: int = 128  # dv
    linear_conv_kernel: int = 4  # K of the short causal convolutions over q, k, v
    linear_chunk_size: int = 64  # chunk of the chunked delta rule (a speed knob: the result is the same)
    linear_kernel: str = "auto"  # auto | torch | fla: who runs the DeltaNet's rule and convs (kernels.py)

    def validate(self) -> None:
        """Llama's checks, then the hybrid's (``ConfigError`` naming the fix)."""
        if self.mup.enable:
            raise ConfigError(
                f"model.mup.enable=true with model.family={self.family}: µP (models/mup.py) is "
                "implemented for the dense Llama-style families (llama, qwen3) only; the Gated DeltaNet "
                "layers (and experts) have no µP rules here. Set model.mup.enable=false."
            )
        if self.qk_norm is not True:
            raise ConfigError(
                f"model.qk_norm={self.qk_norm!r}: every Qwen3.5 full-attention layer normalises its q/k "
                "heads (Qwen3_5ForCausalLM has no switch); set model.qk_norm=true."
            )
        super().validate()
        for name in (
            "full_attention_interval",
            "linear_num_key_heads",
            "linear_num_value_heads",
            "linear_key_head_dim",
            "linear_value_head_dim",
            "linear_conv_kernel",
            "linear_chunk_size",
        ):
            _positive_int(getattr(self, name), f"model.{name}")
        if self.linear_conv_kernel < 2:
            raise ConfigError(
                f"model.linear_conv_kernel={self.linear_conv_kernel} must be >= 2 (Qwen3.5 uses 4)."
            )
        if self.linear_num_value_heads % self.linear_num_key_heads != 0:
            raise ConfigError(
                f"model.linear_num_value_heads={self.linear_num_value_heads} is not a multiple of "
                f"model.linear_num_key_heads={self.linear_num_key_heads}; each value head reads one key "
                "head: choose nv = r * nk."
            )
        if not (isinstance(self.partial_rotary_factor, (int, float)) and 0 < self.partial_rotary_factor <= 1):
            raise ConfigError(
                f"model.partial_rotary_factor={self.partial_rotary_factor!r} must be in (0, 1] (Qwen3.5: "
                "0.25)."
            )
        if self.rotary_dim % 2 != 0 or self.rotary_dim == 0:
            raise ConfigError(
                f"model.partial_rotary_factor={self.partial_rotary_factor} gives a rotary size of "
                f"{self.rotary_dim} channels of the head size {self.head_dim}; it must be even and > 0."
            )
        validate_attention_mask(self.attention_mask)
        if self.linear_kernel not in LINEAR_KERNELS:
            raise ConfigError(
                f"model.linear_kernel={self.linear_kernel!r} must be one of {', '.join(LINEAR_KERNELS)} "
                "(auto: flash-linear-attention's kernels on CUDA when installed, else the torch form)."
            )

    @property
    def rotary_dim(self) -> int:
        """Channels of each full-attention head that RoPE rotates (the first ones)."""
        return int(self.head_dim * self.partial_rotary_factor)

    def is_full_attention(self, layer_id: int) -> bool:
        """Whether block ``layer_id`` has softmax attention (else a Gated DeltaNet)."""
        return (layer_id + 1) % self.full_attention_interval == 0

    @property
    def layer_types(self) -> list[str]:
        """transformers' spelling of the pattern: ``linear_attention`` / ``full_attention`` per block."""
        return [
            "full_attention" if self.is_full_attention(i) else "linear_attention"
            for i in range(self.n_layers)
        ]


@dataclass
class Qwen3_5MoeArgs(Qwen3_5Args, MoEArgs):
    """A Qwen3.5-MoE decoder: every block's feed-forward is ``models/moe``'s routed experts (softmax
    router, top-k renormalised) plus one shared SwiGLU expert scaled by a sigmoid gate."""

    family: str = "qwen3_5_moe"
    num_experts: int = 256
    top_k: int = 8
    moe_hidden_dim: int = 512
    shared_expert_hidden_dim: int = 512  # the gated shared expert's SwiGLU hidden size (0: none)

    def validate(self) -> None:
        super().validate()  # Qwen3.5's, then the MoE family's
        if isinstance(self.shared_expert_hidden_dim, bool) or not isinstance(
            self.shared_expert_hidden_dim, int
        ):
            raise ConfigError(
                f"model.shared_expert_hidden_dim={self.shared_expert_hidden_dim!r} must be an int."
            )
        if self.shared_expert_hidden_dim < 0:
            raise ConfigError(
                f"model.shared_expert_hidden_dim={self.shared_expert_hidden_dim} must be >= 0 (0: no shared "
                "expert)."
            )
        if self.num_shared_experts:
            raise ConfigError(
                f"model.num_shared_experts={self.num_shared_experts}: Qwen3.5-MoE has one gated shared "
                "expert sized by model.shared_expert_hidden_dim; leave num_shared_experts at 0."
            )


@dataclass
class Qwen3NextArgs(Qwen3_5MoeArgs):
    """A Qwen3-Next decoder (transformers' ``Qwen3NextForCausalLM``): the same layers as Qwen3.5-MoE
    (Gated DeltaNet + gated attention, routed experts with a gated shared expert); only its Hugging
    Face tensors differ (the DeltaNet's q/k/v/z and b/a projections fused per key-head group:
    ``hf.py``)."""

    family: str = "qwen3_next"
