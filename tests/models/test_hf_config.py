"""The one Hugging Face config reader (``models/hf_config.py``) over every family's formats.

* Each format's ``config.json``, built by ``transformers`` itself (configs only, offline), reads to a
  table of expected args fields: what the per-family readers it replaced read.
* Each shared refusal fires with one message in every format where it applies (families x
  refusals), and does not fire where the format's architecture has no such feature.
* Export and import are one table: reading what we write gives the args back.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Optional

import pytest

from models import get_spec
from models.common import RopeScaling
from models.errors import ConfigError

transformers = pytest.importorskip("transformers", reason="transformers (the dev extra) is not installed")

_SMALL = dict(
    vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2, max_position_embeddings=256
)
_LLAMA3 = {
    "rope_type": "llama3",
    "rope_theta": 5e5,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}
_YARN = {
    "rope_type": "yarn",
    "rope_theta": 1e4,
    "factor": 8.0,
    "original_max_position_embeddings": 32,
    "beta_fast": 32,
    "beta_slow": 1,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
}
FAMILY = {
    "llama": "llama",
    "qwen3": "qwen3",
    "mixtral": "moe",
    "qwen3_moe": "moe",
    "deepseek_v3": "deepseek_v3",
}
FORMATS = list(FAMILY)


def _hf_config(fmt: str) -> dict[str, Any]:
    """A small ``config.json`` of format ``fmt``, as transformers writes it."""
    if fmt == "llama":
        cfg = transformers.LlamaConfig(
            **_SMALL, num_attention_heads=4, num_key_value_heads=2, rope_parameters=_LLAMA3
        )
    elif fmt == "qwen3":
        cfg = transformers.Qwen3Config(
            **_SMALL,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=32,
            tie_word_embeddings=True,
            rope_parameters={"rope_type": "default", "rope_theta": 1e6},
        )
    elif fmt == "mixtral":
        cfg = transformers.MixtralConfig(
            **_SMALL, num_attention_heads=8, num_key_value_heads=4, num_local_experts=8, num_experts_per_tok=2
        )
    elif fmt == "qwen3_moe":
        cfg = transformers.Qwen3MoeConfig(
            **_SMALL,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            moe_intermediate_size=32,
            num_experts=8,
            num_experts_per_tok=2,
            mlp_only_layers=[0],
        )
    else:
        cfg = transformers.DeepseekV3Config(
            **_SMALL,
            num_attention_heads=4,
            moe_intermediate_size=32,
            n_routed_experts=8,
            n_shared_experts=1,
            num_experts_per_tok=2,
            n_group=2,
            topk_group=1,
            first_k_dense_replace=1,
            q_lora_rank=12,
            kv_lora_rank=16,
            qk_nope_head_dim=8,
            qk_rope_head_dim=4,
            v_head_dim=6,
            routed_scaling_factor=2.5,
            rope_parameters=_YARN,
        )
    return cfg.to_dict()


_DECODER = {"dim": 64, "n_layers": 2, "vocab_size": 300, "max_seq_len": 256, "norm_eps": 1e-6}
_DEFAULT_ROPE = {"type": "default"}
_MOE_SOFTMAX = {"score_func": "softmax", "route_scale": 1.0, "num_shared_experts": 0, "moe_layer_freq": 1}
EXPECTED: dict[str, dict[str, Any]] = {
    "llama": {
        **_DECODER,
        "family": "llama",
        "n_heads": 4,
        "n_kv_heads": 2,
        "attn_head_dim": None,  # 4 x 16 = 64: the head size is implied
        "ffn_hidden_dim": 96,
        "tie_embeddings": False,
        "rope_theta": 5e5,
        "rope_scaling": dataclasses.asdict(
            RopeScaling(
                type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_seq_len=64
            )
        ),
    },
    "qwen3": {
        **_DECODER,
        "family": "qwen3",
        "n_heads": 4,
        "n_kv_heads": 1,
        "attn_head_dim": 32,  # 4 x 32 != 64: explicit
        "ffn_hidden_dim": 96,
        "tie_embeddings": True,
        "rope_theta": 1e6,
        "rope_scaling": _DEFAULT_ROPE,
        "qk_norm": True,
    },
    "mixtral": {
        **_DECODER,
        **_MOE_SOFTMAX,
        "family": "moe",
        "norm_eps": 1e-5,
        "n_heads": 8,
        "n_kv_heads": 4,
        "attn_head_dim": None,  # head_dim null in config.json
        "ffn_hidden_dim": 96,
        "moe_hidden_dim": 96,
        "num_experts": 8,
        "top_k": 2,
        "route_norm": True,
        "first_k_dense": 0,
        "qk_norm": False,
        "tie_embeddings": False,
        "rope_theta": 1e6,
        "rope_scaling": _DEFAULT_ROPE,
    },
    "qwen3_moe": {
        **_DECODER,
        **_MOE_SOFTMAX,
        "family": "moe",
        "n_heads": 4,
        "n_kv_heads": 2,
        "attn_head_dim": 32,
        "ffn_hidden_dim": 96,
        "moe_hidden_dim": 32,
        "num_experts": 8,
        "top_k": 2,
        "route_norm": False,
        "first_k_dense": 1,
        "qk_norm": True,
        "tie_embeddings": False,
        "rope_theta": 1e4,
        "rope_scaling": _DEFAULT_ROPE,
    },
    "deepseek_v3": {
        **_DECODER,
        "family": "deepseek_v3",
        "n_heads": 4,
        "ffn_hidden_dim": 96,
        "moe_hidden_dim": 32,
        "num_experts": 8,
        "num_shared_experts": 1,
        "top_k": 2,
        "route_norm": True,
        "route_scale": 2.5,
        "score_func": "sigmoid",
        "n_group": 2,
        "topk_group": 1,
        "first_k_dense": 1,
        "moe_layer_freq": 1,
        "q_lora_rank": 12,
        "kv_lora_rank": 16,
        "qk_nope_head_dim": 8,
        "qk_rope_head_dim": 4,
        "v_head_dim": 6,
        "hf_rope_interleave": True,
        "mtp_depth": 0,
        "tie_embeddings": False,
        "rope_theta": 1e4,
        "rope_scaling": dataclasses.asdict(
            RopeScaling(type="yarn", factor=8.0, original_max_seq_len=32, mscale=1.0, mscale_all_dim=1.0)
        ),
    },
}


def _read(fmt: str, cfg: dict[str, Any]) -> dict[str, Any]:
    return get_spec(FAMILY[fmt]).hf.args_from_hf_config(cfg)


@pytest.mark.parametrize("fmt", FORMATS)
def test_each_format_reads_the_expected_fields(fmt: str) -> None:
    assert _read(fmt, _hf_config(fmt)) == EXPECTED[fmt]


@pytest.mark.parametrize("fmt", FORMATS)
def test_export_and_import_are_one_table(fmt: str) -> None:
    """Reading what we write gives the args back (the rows hold both directions), and transformers
    reads what we write as a config of its own class."""
    spec = get_spec(FAMILY[fmt])
    args = spec.make_args(_read(fmt, _hf_config(fmt)))
    written = spec.hf.to_hf_config(args, bos_id=1, eos_id=2, dtype="bfloat16")
    assert written["model_type"] == fmt and written["torch_dtype"] == "bfloat16"
    assert _read(fmt, written) == EXPECTED[fmt]
    config_cls = getattr(transformers, written["architectures"][0]).config_class
    assert config_cls(**written).to_dict()["hidden_size"] == 64


_SWITCH = {"qwen3": "use_sliding_window", "qwen3_moe": "use_sliding_window", "mixtral": None}
_NORM_KEY = {"mixtral": False, "qwen3_moe": True, "deepseek_v3": True}  # has norm_topk_prob


def _refusal(fmt: str, name: str) -> tuple[dict[str, Any], Optional[str]]:
    """(config.json fields, the message) of refusal ``name`` in ``fmt``; message None: it does not
    apply there (the format's architecture has no such feature), the config is read."""
    family = FAMILY[fmt]
    if name in ("attention_bias", "mlp_bias"):
        return {name: True}, f"config.json has {name}=true; meshwright's {family} model has no biases."
    if name == "hidden_act":
        return {"hidden_act": "gelu"}, "config.json has hidden_act='gelu'; meshwright's FFN is SwiGLU (silu)."
    if name == "model_type":
        reads = "'mixtral' or 'qwen3_moe'" if family == "moe" else repr(fmt)
        return {
            "model_type": "gpt2"
        }, f"config.json has model_type='gpt2'; the {family} family reads {reads}."
    if name == "rope_type":
        dynamic = {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}
        message = (
            "config.json uses rope_type='dynamic'; meshwright supports default, linear, llama3 and yarn RoPE."
        )
        return {"rope_parameters": dynamic}, message
    if name == "yarn_truncate":
        message = "config.json sets rope truncate=false; meshwright's YaRN truncates (as DeepSeek-V3)."
        return {"rope_parameters": {**_YARN, "truncate": False}}, message
    if name == "missing_key":
        cfg = {k: v for k, v in _hf_config(fmt).items() if k != "hidden_size"}
        return cfg, f"config.json has no hidden_size; a {fmt} config.json needs it (meshwright's model.dim)."
    if name == "sliding_window":
        fields = {"sliding_window": 16, "use_sliding_window": True, "layer_types": ["sliding_attention"] * 2}
        if fmt not in _SWITCH:
            return fields, None
        switch = ", use_sliding_window=true" if _SWITCH[fmt] else ""
        return fields, (
            f"config.json has sliding_window=16 (below max_position_embeddings=256{switch}); meshwright's "
            "attention is full causal, without a sliding window."
        )
    assert name == "top1_renormalised", name
    if fmt not in _NORM_KEY:
        return {"num_experts_per_tok": 1, "norm_topk_prob": True}, None
    norm = " and norm_topk_prob=true" if _NORM_KEY[fmt] else ""
    return {"num_experts_per_tok": 1, "norm_topk_prob": True}, (
        f"config.json has num_experts_per_tok=1{norm}: {fmt} renormalises the one routing weight to 1, "
        "meshwright keeps the router score; they route the same tokens but scale them differently."
    )


REFUSALS = [
    "attention_bias",
    "mlp_bias",
    "hidden_act",
    "model_type",
    "rope_type",
    "yarn_truncate",
    "missing_key",
    "sliding_window",
    "top1_renormalised",
]


@pytest.mark.parametrize("name", REFUSALS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_each_refusal_has_one_message_in_every_format(fmt: str, name: str) -> None:
    fields, message = _refusal(fmt, name)
    cfg = fields if name == "missing_key" else {**_hf_config(fmt), **fields}
    if message is None:
        assert _read(fmt, cfg)["family"] == FAMILY[fmt]
        return
    with pytest.raises(ConfigError, match=f"^{re.escape(message)}$"):
        _read(fmt, cfg)


@pytest.mark.parametrize("fmt", ["qwen3", "mixtral", "qwen3_moe"])
def test_a_window_no_shorter_than_the_context_or_switched_off_is_read(fmt: str) -> None:
    """Full causal attention in effect: a window as long as the context, one whose switch is off, or
    (Qwen3, whose layer_types name the sliding layers) one in no layer."""
    cfg = _hf_config(fmt)
    assert _read(fmt, {**cfg, "sliding_window": 256, "use_sliding_window": True}) == EXPECTED[fmt]
    if _SWITCH[fmt]:
        assert _read(fmt, {**cfg, "sliding_window": 16, "use_sliding_window": False}) == EXPECTED[fmt]
    if fmt == "qwen3":
        full = {"sliding_window": 16, "use_sliding_window": True, "layer_types": ["full_attention"] * 2}
        assert _read(fmt, {**cfg, **full}) == EXPECTED[fmt]


@pytest.mark.parametrize("fmt", FORMATS)
def test_training_time_noise_is_read_with_a_warning(fmt: str, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level("WARNING", logger="meshwright"):
        assert _read(fmt, {**_hf_config(fmt), "attention_dropout": 0.1}) == EXPECTED[fmt]
    assert "attention_dropout=0.1: training-time noise meshwright does not apply" in caplog.text


def test_a_config_without_model_type_reads_as_the_family_s_one_format() -> None:
    for fmt in ("llama", "qwen3", "deepseek_v3"):
        assert _read(fmt, {**_hf_config(fmt), "model_type": None}) == EXPECTED[fmt]
    with pytest.raises(ConfigError, match="model_type=None; the moe family reads 'mixtral' or 'qwen3_moe'"):
        _read("mixtral", {**_hf_config("mixtral"), "model_type": None})
