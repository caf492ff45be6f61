"""Hugging Face Llama interop: parameter names, ``config.json``, safetensors read/write.

Our attention already uses HF's ``rotate_half`` RoPE layout (see ``models/llama.py``), so
q/k projections need no row permutation: the weights map one to one.

=================================  ==================================================
ours                               Hugging Face ``LlamaForCausalLM``
=================================  ==================================================
tok_embeddings.weight              model.embed_tokens.weight
layers.{i}.attention.wq/wk/wv/wo   model.layers.{i}.self_attn.q_proj/k_proj/v_proj/o_proj
layers.{i}.feed_forward.w1/w3/w2   model.layers.{i}.mlp.gate_proj/up_proj/down_proj
layers.{i}.attention_norm          model.layers.{i}.input_layernorm
layers.{i}.ffn_norm                model.layers.{i}.post_attention_layernorm
norm.weight                        model.norm.weight
output.weight                      lm_head.weight (absent when tie_word_embeddings)
=================================  ==================================================
"""

from __future__ import annotations

import json
import os
import re
from typing import Any, Optional

import torch
from torch import nn

from models.errors import ConfigError

CONFIG_FILE = "config.json"
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
MESHWRIGHT_FILE = "meshwright.json"  # our tokenizer choice and model args, for generation

_LAYER_MAP = {
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
_TOP_MAP = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
            "output.weight": "lm_head.weight"}  # fmt: skip
_LAYER_RE = re.compile(r"^layers\.(\d+)\.(.+)\.weight$")
_HF_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)\.weight$")


def to_hf_name(name: str) -> str:
    """Our parameter name -> the HF Llama name."""
    if name in _TOP_MAP:
        return _TOP_MAP[name]
    m = _LAYER_RE.match(name)
    if m and m.group(2) in _LAYER_MAP:
        return f"model.layers.{m.group(1)}.{_LAYER_MAP[m.group(2)]}.weight"
    raise ConfigError(f"parameter {name!r} has no Hugging Face Llama equivalent.")


def from_hf_name(name: str) -> str:
    """The HF Llama name -> ours."""
    for ours, hf in _TOP_MAP.items():
        if name == hf:
            return ours
    m = _HF_LAYER_RE.match(name)
    if m:
        for ours, hf in _LAYER_MAP.items():
            if m.group(2) == hf:
                return f"layers.{m.group(1)}.{ours}.weight"
    raise ConfigError(
        f"Hugging Face tensor {name!r} is not part of a Llama model meshwright supports "
        "(biases, rope scaling tensors and other architectures are not)."
    )


def hf_config(args: dict[str, Any], *, bos_id: Optional[int] = None, eos_id: Optional[int] = None,
              dtype: str = "float32") -> dict[str, Any]:  # fmt: skip
    """A ``LlamaConfig`` dict for our model args (``asdict(LlamaArgs)``)."""
    n_heads = args["n_heads"]
    head_dim = args["dim"] // n_heads
    hidden = args.get("ffn_hidden_dim")
    if hidden is None:  # the Llama rule, as in LlamaArgs.hidden_dim
        from models.llama import LlamaArgs

        fields = {k: v for k, v in args.items() if k in LlamaArgs.__dataclass_fields__}
        hidden = LlamaArgs(**fields).hidden_dim
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": args["dim"],
        "intermediate_size": hidden,
        "num_hidden_layers": args["n_layers"],
        "num_attention_heads": n_heads,
        "num_key_value_heads": args.get("n_kv_heads") or n_heads,
        "head_dim": head_dim,
        "vocab_size": args["vocab_size"],
        "max_position_embeddings": args["max_seq_len"],
        "rms_norm_eps": args["norm_eps"],
        "rope_theta": args["rope_theta"],  # transformers < 5
        "rope_parameters": {"rope_type": "default", "rope_theta": args["rope_theta"]},  # >= 5
        "rope_scaling": None,
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "tie_word_embeddings": bool(args.get("tie_embeddings", False)),
        "initializer_range": args.get("init_std", 0.02),
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "torch_dtype": dtype,
        "use_cache": True,
    }


def args_from_hf_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """Our model args from a HF Llama ``config.json`` (refuses what we cannot represent)."""
    if cfg.get("model_type") not in ("llama", None):
        raise ConfigError(f"config.json has model_type={cfg.get('model_type')!r}; only 'llama' is supported.")
    for key in ("attention_bias", "mlp_bias"):
        if cfg.get(key):
            raise ConfigError(f"config.json has {key}=true; meshwright's Llama has no biases.")
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type", "default")) not in ("default", None):
        raise ConfigError(
            f"config.json uses rope_type={rope.get('rope_type')!r}; only the default RoPE is supported."
        )
    dim, n_heads = cfg["hidden_size"], cfg["num_attention_heads"]
    if cfg.get("head_dim") not in (None, dim // n_heads):
        raise ConfigError(f"config.json head_dim={cfg['head_dim']} != hidden_size / num_attention_heads.")
    return {
        "dim": dim,
        "n_layers": cfg["num_hidden_layers"],
        "n_heads": n_heads,
        "n_kv_heads": cfg.get("num_key_value_heads", n_heads),
        "vocab_size": cfg["vocab_size"],
        "ffn_hidden_dim": cfg["intermediate_size"],
        "norm_eps": cfg.get("rms_norm_eps", 1e-6),
        "rope_theta": rope.get("rope_theta", cfg.get("rope_theta", 10000.0)),
        "max_seq_len": cfg.get("max_position_embeddings", 2048),
        "tie_embeddings": bool(cfg.get("tie_word_embeddings", False)),
    }


def save_hf(state: dict[str, torch.Tensor], args: dict[str, Any], out_dir: str, *,
            max_shard_bytes: int = 5 * 2**30, dtype: torch.dtype = torch.float32,
            extra: Optional[dict[str, Any]] = None, bos_id: Optional[int] = None,
            eos_id: Optional[int] = None) -> list[str]:  # fmt: skip
    """Write ``state`` (our names, full tensors) as HF safetensors + ``config.json``; return the files.

    One ``model.safetensors`` when it fits ``max_shard_bytes``, else ``model-0000i-of-0000n``
    shards plus ``model.safetensors.index.json``.
    """
    from safetensors.torch import save_file

    tied = bool(args.get("tie_embeddings", False))
    hf = {
        to_hf_name(k): v.detach().to("cpu", dtype).contiguous()
        for k, v in state.items()
        if not (tied and k == "output.weight")
    }
    os.makedirs(out_dir, mode=0o750, exist_ok=True)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name in sorted(hf):
        nbytes = hf[name].numel() * hf[name].element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = hf[name]
        size += nbytes
    files = []
    if len(shards) == 1:
        save_file(shards[0], os.path.join(out_dir, SINGLE_FILE), metadata={"format": "pt"})
        files.append(SINGLE_FILE)
    else:
        weight_map = {}
        for i, shard in enumerate(shards):
            fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, os.path.join(out_dir, fname), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(shard, fname))
            files.append(fname)
        total = sum(t.numel() * t.element_size() for t in hf.values())
        with open(os.path.join(out_dir, INDEX_FILE), "w", encoding="utf-8") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
        files.append(INDEX_FILE)
    dtype_name = str(dtype).removeprefix("torch.")
    with open(os.path.join(out_dir, CONFIG_FILE), "w", encoding="utf-8") as f:
        json.dump(hf_config(args, bos_id=bos_id, eos_id=eos_id, dtype=dtype_name), f, indent=2)
    files.append(CONFIG_FILE)
    if extra is not None:
        with open(os.path.join(out_dir, MESHWRIGHT_FILE), "w", encoding="utf-8") as f:
            json.dump(extra, f, indent=2)
        files.append(MESHWRIGHT_FILE)
    return files


def read_hf(hf_dir: str) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(config.json, tensors renamed to ours) of a HF Llama folder; ConfigError when unusable."""
    from safetensors.torch import load_file

    cfg_path = os.path.join(hf_dir, CONFIG_FILE)
    if not os.path.isfile(cfg_path):
        raise ConfigError(f"{hf_dir} has no {CONFIG_FILE}; point at a Hugging Face model folder.")
    with open(cfg_path, encoding="utf-8") as f:
        cfg = json.load(f)
    index = os.path.join(hf_dir, INDEX_FILE)
    if os.path.isfile(index):
        with open(index, encoding="utf-8") as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    elif os.path.isfile(os.path.join(hf_dir, SINGLE_FILE)):
        files = [SINGLE_FILE]
    else:
        raise ConfigError(f"{hf_dir} has neither {SINGLE_FILE} nor {INDEX_FILE}; export safetensors weights.")
    state: dict[str, torch.Tensor] = {}
    for fname in files:
        try:
            tensors = load_file(os.path.join(hf_dir, fname))
        except Exception as e:
            raise ConfigError(f"{os.path.join(hf_dir, fname)} cannot be read ({e}).") from e
        for name, tensor in tensors.items():
            if name.endswith("rotary_emb.inv_freq"):
                continue  # a derived buffer some old exports carry
            state[from_hf_name(name)] = tensor
    if cfg.get("tie_word_embeddings") and "output.weight" not in state and "tok_embeddings.weight" in state:
        state["output.weight"] = state["tok_embeddings.weight"]
    return cfg, state


@torch.no_grad()
def load_hf_into(module: nn.Module, hf_dir: str) -> None:
    """Copy a HF Llama folder's weights into ``module`` (plain, FSDP or TP; every rank reads them)."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        set_model_state_dict,
    )

    _, state = read_hf(hf_dir)
    expected = {k: v.shape for k, v in get_model_state_dict(module).items()}
    for name, shape in expected.items():
        if name not in state:
            raise ConfigError(
                f"{hf_dir} has no tensor for {name!r} ({to_hf_name(name)}); the model config differs "
                "from the exported one."
            )
        if tuple(state[name].shape) != tuple(shape):
            raise ConfigError(
                f"{hf_dir}: {to_hf_name(name)} ({name!r}) has shape {list(state[name].shape)} but this "
                f"model's is {list(shape)}; set the model config to match config.json."
            )
    extra = [k for k in state if k not in expected]
    if extra:
        raise ConfigError(f"{hf_dir} has tensor {to_hf_name(extra[0])!r} that this model lacks.")
    full = {k: state[k].to(torch.float32) for k in expected}
    set_model_state_dict(module, full, options=StateDictOptions(full_state_dict=True))
