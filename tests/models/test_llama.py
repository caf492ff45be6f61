"""Unit tests of the dense Llama model: shapes, causality, init determinism, stage chaining, counts."""

from __future__ import annotations

import copy
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf
from torch import Tensor, nn

from models.common import apply_rotary_emb
from models.errors import ConfigError
from models.llama import LLAMA_SPEC, LlamaArgs, Transformer, num_flops_per_token, param_counts


def num_params(model: nn.Module, exclude_embedding: bool = False) -> int:
    """Unique parameters of a built model (tied weights once), optionally without embeddings."""
    params = {id(p): p for p in model.parameters()}
    if exclude_embedding:
        for p in model.tok_embeddings.parameters():
            params.pop(id(p), None)
    return sum(p.numel() for p in params.values())


def param_count(args: LlamaArgs) -> int:
    return param_counts(args).total


PRESET_DIR = Path(__file__).resolve().parents[2] / "configs" / "model"

# Published parameter counts (model cards / papers).
PUBLISHED = {
    "1b": 1.24e9,
    "llama2_7b": 6.74e9,
    "llama3_8b": 8.03e9,
    "llama3_70b": 70.6e9,
    "llama3_405b": 405.9e9,
    "38m": 38e6,
}


def tiny_args(**overrides: object) -> LlamaArgs:
    base = dict(dim=64, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=97, ffn_hidden_dim=96, max_seq_len=32)
    base.update(overrides)
    return LlamaArgs(**base)


def build(args: LlamaArgs, seed: int = 0) -> Transformer:
    model = Transformer(args)
    model.init_weights(seed)
    return model


def load_preset(path: Path) -> tuple[str, LlamaArgs]:
    cfg = OmegaConf.to_container(OmegaConf.load(path))
    assert cfg.pop("defaults") == ["base_model_llama", "_self_"]
    name = cfg.pop("name")
    return name, LLAMA_SPEC.make_args(cfg)


PRESETS = sorted(p for p in PRESET_DIR.glob("*.yaml") if "base_model_llama" in p.read_text())


@pytest.fixture(autouse=True)
def _fp32_deterministic() -> None:
    torch.manual_seed(1234)


# ----------------------------------------------------------------------------- forward


@pytest.mark.parametrize("n_kv_heads", [None, 2, 1])
def test_forward_shapes(n_kv_heads: int | None) -> None:
    args = tiny_args(n_kv_heads=n_kv_heads)
    model = build(args)
    tokens = torch.randint(0, args.vocab_size, (3, 11))
    logits = model(tokens)
    assert logits.shape == (3, 11, args.vocab_size)
    assert logits.dtype == torch.float32
    assert torch.isfinite(logits).all()
    assert model.layers["0"].attention.wk.weight.shape == (args.kv_heads * args.head_dim, args.dim)


def test_causal() -> None:
    args = tiny_args()
    model = build(args)
    tokens = torch.randint(0, args.vocab_size, (2, 16))
    changed = tokens.clone()
    changed[:, 10] = (changed[:, 10] + 1) % args.vocab_size
    a, b = model(tokens), model(changed)
    torch.testing.assert_close(a[:, :10], b[:, :10], rtol=0, atol=0)
    assert not torch.allclose(a[:, 10:], b[:, 10:])


def test_gqa_equals_mha_with_repeated_kv_weights() -> None:
    """GQA with n_kv heads == MHA whose k/v projections repeat each kv head n_rep times."""
    args = tiny_args(n_kv_heads=2)
    gqa = build(args)
    mha = Transformer(tiny_args(n_kv_heads=None))
    n_rep, D = args.n_heads // args.kv_heads, args.head_dim
    state = {}
    for name, value in gqa.state_dict().items():
        if name.endswith(("attention.wk.weight", "attention.wv.weight")):
            value = (
                value.view(args.kv_heads, D, args.dim).repeat_interleave(n_rep, dim=0).reshape(-1, args.dim)
            )
        state[name] = value
    mha.load_state_dict(state)
    tokens = torch.randint(0, args.vocab_size, (2, 12))
    torch.testing.assert_close(gqa(tokens), mha(tokens), rtol=1e-5, atol=1e-5)


def test_sequence_longer_than_max_raises() -> None:
    args = tiny_args(max_seq_len=8)
    model = build(args)
    with pytest.raises(ConfigError, match="max_seq_len=8"):
        model(torch.zeros(1, 9, dtype=torch.long))


# ----------------------------------------------------------------------------- RoPE


def reference_rope(x: Tensor, theta: float) -> Tensor:
    """HF-style rotate_half RoPE on (B, S, nh, D), written independently of the model."""
    _, S, _, D = x.shape
    inv_freq = 1.0 / (theta ** (torch.arange(0, D, 2, dtype=torch.float64) / D))
    angles = torch.arange(S, dtype=torch.float64)[:, None] * inv_freq[None, :]  # (S, D/2)
    emb = torch.cat([angles, angles], dim=-1)  # (S, D)
    cos, sin = emb.cos()[None, :, None, :], emb.sin()[None, :, None, :]
    x64 = x.double()
    rotated = torch.cat([-x64[..., D // 2 :], x64[..., : D // 2]], dim=-1)
    return (x64 * cos + rotated * sin).float()


@pytest.mark.parametrize("theta", [10000.0, 500000.0])
def test_rope_matches_reference(theta: float) -> None:
    args = tiny_args(rope_theta=theta, max_seq_len=64)
    model = Transformer(args)
    q = torch.randn(2, 40, 4, args.head_dim)
    k = torch.randn(2, 40, 2, args.head_dim)
    q_out, k_out = apply_rotary_emb(q, k, model.rope_cache[:40])
    torch.testing.assert_close(q_out, reference_rope(q, theta), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(k_out, reference_rope(k, theta), rtol=1e-5, atol=1e-5)
    # Position 0 is the identity; norms are preserved.
    torch.testing.assert_close(q_out[:, 0], q[:, 0])
    torch.testing.assert_close(q_out.norm(dim=-1), q.norm(dim=-1))


def test_rope_cache_is_a_non_persistent_buffer() -> None:
    model = Transformer(tiny_args())
    assert "rope_cache" in dict(model.named_buffers())
    assert "rope_cache" not in model.state_dict()
    assert model.rope_cache.shape == (32, 16) and model.rope_cache.dtype == torch.float32


def test_rope_cache_refilled_after_to_empty() -> None:
    args = tiny_args()
    reference = Transformer(args).rope_cache
    with torch.device("meta"):
        model = Transformer(args)
    model.to_empty(device="cpu")
    model.rope_cache.fill_(float("nan"))  # to_empty leaves garbage; make it obvious
    model.init_weights(seed=0)
    assert torch.equal(model.rope_cache, reference)


# ----------------------------------------------------------------------------- init


def test_tied_weights_survive_device_conversions() -> None:
    args = tiny_args(tie_embeddings=True)
    model = Transformer(args)
    for convert in (lambda m: m.to("meta"), lambda m: m.to_empty(device="cpu"), lambda m: m.double()):
        convert(model)
        assert model.output.weight is model.tok_embeddings.weight
    assert num_params(model) == param_count(args)


@pytest.mark.parametrize("tie", [False, True])
def test_meta_init_bit_identical_to_cpu_init(tie: bool) -> None:
    args = tiny_args(tie_embeddings=tie)
    cpu_model = build(args, seed=7)
    with torch.device("meta"):
        meta_model = Transformer(args)
    assert meta_model.rope_cache.is_meta
    meta_model.to_empty(device="cpu")
    meta_model.init_weights(seed=7)
    cpu_state, meta_state = cpu_model.state_dict(), meta_model.state_dict()
    assert cpu_state.keys() == meta_state.keys()
    for name in cpu_state:
        assert torch.equal(cpu_state[name], meta_state[name]), name
    assert torch.equal(cpu_model.rope_cache, meta_model.rope_cache)
    if tie:
        assert meta_model.output.weight is meta_model.tok_embeddings.weight
    tokens = torch.randint(0, args.vocab_size, (2, 9))
    assert torch.equal(cpu_model(tokens), meta_model(tokens))


def test_parameter_names() -> None:
    args = tiny_args(n_layers=2)
    names = {n for n, _ in Transformer(args).named_parameters()}
    expected = {"tok_embeddings.weight", "norm.weight", "output.weight"}
    for i in range(2):
        expected |= {f"layers.{i}.attention.{p}.weight" for p in ("wq", "wk", "wv", "wo")}
        expected |= {f"layers.{i}.feed_forward.{p}.weight" for p in ("w1", "w2", "w3")}
        expected |= {f"layers.{i}.attention_norm.weight", f"layers.{i}.ffn_norm.weight"}
    assert names == expected


def test_init_statistics() -> None:
    args = tiny_args(dim=128, n_heads=4, ffn_hidden_dim=256, vocab_size=300)
    model = build(args)
    emb = model.tok_embeddings.weight
    assert abs(emb.std().item() - 1.0) < 0.05
    wq = model.layers["0"].attention.wq.weight
    assert abs(wq.std().item() - 0.02) < 0.004 and wq.abs().max() <= 0.04
    for layer_id in ("0", "3"):
        w2 = model.layers[layer_id].feed_forward.w2.weight
        assert w2.abs().max() <= 2 * 0.02 / math.sqrt(2 * (int(layer_id) + 1)) + 1e-7
    assert model.output.weight.abs().max() <= 3 * args.dim**-0.5 + 1e-7
    assert torch.equal(model.norm.weight, torch.ones(args.dim))


def test_different_seeds_differ() -> None:
    a, b = build(tiny_args(), seed=0), build(tiny_args(), seed=1)
    for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters()):
        if name.endswith("norm.weight"):
            assert torch.equal(pa, pb)
        else:
            assert not torch.equal(pa, pb), name
    # and within one model, parameters of the same shape are not copies of each other
    assert not torch.equal(a.layers["0"].attention.wq.weight, a.layers["1"].attention.wq.weight)


@pytest.mark.parametrize("tie", [False, True])
def test_init_independent_of_other_parameters(tie: bool) -> None:
    """A pipeline-stage-like model (pieces removed) gets the same values as the full model."""
    args = tiny_args(tie_embeddings=tie)
    full = build(args, seed=3)
    full_params = dict(full.named_parameters())

    first = Transformer(args)  # embedding + layers 0, 1
    first.norm, first.output = None, None
    del first.layers["2"], first.layers["3"]
    last = Transformer(args)  # layers 2, 3 + norm + head
    last.tok_embeddings = None
    del last.layers["0"], last.layers["1"]
    for stage in (first, last):
        stage.init_weights(seed=3)
        for name, p in stage.named_parameters():
            if tie and name == "output.weight":
                name = "tok_embeddings.weight"  # the tied weight is drawn under its canonical name
            assert torch.equal(p, full_params[name]), name


def test_init_through_wrappers_and_copy_fn() -> None:
    """Wrappers that prefix named_parameters do not change init; copy_fn sees every parameter."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    args = tiny_args()
    reference = build(args, seed=5)
    wrapped = Transformer(args)
    for key in list(wrapped.layers.keys()):
        wrapped.layers[key] = checkpoint_wrapper(wrapped.layers[key])
    assert any("_checkpoint_wrapped_module" in n for n, _ in wrapped.named_parameters())

    seen: list[tuple[int, ...]] = []

    def copy_fn(param: nn.Parameter, full: Tensor) -> None:
        assert full.dtype == torch.float32 and full.device.type == "cpu" and full.shape == param.shape
        seen.append(tuple(full.shape))
        param.copy_(full)

    wrapped.init_weights(seed=5, copy_fn=copy_fn)
    assert len(seen) == len(list(reference.parameters()))
    ref = [p for _, p in reference.named_parameters()]
    got = [p for _, p in wrapped.named_parameters()]
    assert all(torch.equal(a, b) for a, b in zip(ref, got))
    tokens = torch.randint(0, args.vocab_size, (2, 8))
    assert torch.equal(reference(tokens), wrapped(tokens))


def test_unwrapped_name_undoes_the_real_wrappers() -> None:
    """``models.common.unwrapped_name`` (the one copy of the wrapper prefixes) against the names that
    activation checkpointing and torch.compile really add, in parallelize's order (AC, then compile)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    from models.common import unwrapped_name

    args = tiny_args()
    plain = Transformer(args)
    wrapped = Transformer(args)
    for key in list(wrapped.layers.keys()):
        wrapped.layers[key] = torch.compile(checkpoint_wrapper(wrapped.layers[key]))  # compiles on call only
    names = [n for n, _ in wrapped.named_parameters()]
    assert any("_orig_mod" in n for n in names) and any("_checkpoint_wrapped_module" in n for n in names)
    assert [unwrapped_name(n) for n in names] == [n for n, _ in plain.named_parameters()]
    assert [unwrapped_name(n) for n, _ in wrapped.named_buffers()] == [n for n, _ in plain.named_buffers()]


def test_init_respects_param_dtype() -> None:
    args = tiny_args()
    ref = build(args, seed=2)
    model = Transformer(args).to(torch.bfloat16)
    model.init_weights(seed=2)
    for (name, a), (_, b) in zip(ref.named_parameters(), model.named_parameters()):
        assert b.dtype == torch.bfloat16
        assert torch.equal(a.to(torch.bfloat16), b), name
    assert model.rope_cache.dtype == torch.float32


# ----------------------------------------------------------------------------- pipeline stages


def test_stage_chaining_equals_full_model() -> None:
    args = tiny_args()
    full = build(args, seed=11)
    stage_a = copy.deepcopy(full)
    stage_a.norm, stage_a.output = None, None
    del stage_a.layers["2"], stage_a.layers["3"]
    stage_b = copy.deepcopy(full)
    stage_b.tok_embeddings = None
    del stage_b.layers["0"], stage_b.layers["1"]
    assert list(stage_b.layers.keys()) == ["2", "3"]

    tokens = torch.randint(0, args.vocab_size, (2, 10))
    hidden = stage_a(tokens)
    assert hidden.shape == (2, 10, args.dim)
    assert torch.equal(stage_b(hidden), full(tokens))


def test_middle_stage_is_hidden_to_hidden() -> None:
    args = tiny_args()
    model = build(args)
    model.tok_embeddings, model.norm, model.output = None, None, None
    del model.layers["0"]
    h = torch.randn(2, 6, args.dim)
    assert model(h).shape == (2, 6, args.dim)


# ----------------------------------------------------------------------------- counts and presets


def test_presets_exist() -> None:
    names = {p.stem for p in PRESETS}
    assert {"debug", "38m", "1b", "llama2_7b", "llama3_8b", "llama3_70b", "llama3_405b"} <= names


@pytest.mark.parametrize("path", PRESETS, ids=lambda p: p.stem)
def test_preset_param_counts(path: Path) -> None:
    name, args = load_preset(path)
    assert name == path.stem
    args.validate()
    with torch.device("meta"):
        model = Transformer(args)
    total = param_count(args)
    assert num_params(model) == total
    assert num_params(model, exclude_embedding=True) == total - args.vocab_size * args.dim
    if name in PUBLISHED:
        assert abs(total - PUBLISHED[name]) / PUBLISHED[name] < 0.02, (name, total)
    # 6N dominates the attention term for short sequences; both grow with seq_len.
    short, long = num_flops_per_token(args, 128), num_flops_per_token(args, 4096)
    n_matmul = total - args.vocab_size * args.dim + (args.vocab_size * args.dim if args.tie_embeddings else 0)
    assert short > 0 and long > short
    assert 6 * n_matmul <= short < 1.5 * 6 * n_matmul


def test_llama_ffn_rule() -> None:
    assert LlamaArgs(dim=4096, multiple_of=256).hidden_dim == 11008
    assert LlamaArgs(dim=4096, multiple_of=1024, ffn_dim_multiplier=1.3).hidden_dim == 14336
    assert LlamaArgs(dim=8192, multiple_of=4096, ffn_dim_multiplier=1.3).hidden_dim == 28672
    assert LlamaArgs(dim=16384, multiple_of=4096, ffn_dim_multiplier=1.2).hidden_dim == 53248
    assert LlamaArgs(dim=256, ffn_hidden_dim=100).hidden_dim == 100


def test_flops_formula() -> None:
    args = tiny_args(tie_embeddings=False)
    n = param_count(args) - args.vocab_size * args.dim
    attn = 12 * args.n_layers * args.n_heads * args.head_dim * 32
    assert num_flops_per_token(args, 32) == 6 * n + attn
    tied = tiny_args(tie_embeddings=True)
    assert num_flops_per_token(tied, 32) == num_flops_per_token(args, 32)  # head counted once either way
    assert param_count(tied) == param_count(args) - args.vocab_size * args.dim


# ----------------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    "overrides, fragment",
    [
        (dict(dim=250, n_heads=8), "dim=250"),
        (dict(n_heads=8, n_kv_heads=3), "n_kv_heads=3"),
        (dict(dim=24, n_heads=8), "odd"),
        (dict(n_layers=0), "n_layers=0"),
        (dict(vocab_size=-1), "vocab_size=-1"),
        (dict(ffn_hidden_dim=0), "ffn_hidden_dim=0"),
        (dict(norm_eps=0.0), "norm_eps=0.0"),
    ],
)
def test_validate_raises(overrides: dict, fragment: str) -> None:
    args = LlamaArgs(**overrides)
    with pytest.raises(ConfigError, match=fragment):
        args.validate()
    with pytest.raises(ValueError):  # ConfigError is a ValueError
        Transformer(args)


def test_validate_accepts_defaults() -> None:
    LlamaArgs().validate()
    assert LlamaArgs().kv_heads == 8 and LlamaArgs(n_kv_heads=2).kv_heads == 2


# ----------------------------------------------------------------------------- training sanity


def test_adamw_reduces_loss() -> None:
    args = tiny_args()
    model = build(args, seed=0)
    tokens = torch.randint(0, args.vocab_size, (4, 17))
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(8):
        logits = model(inputs)
        loss = F.cross_entropy(logits.reshape(-1, args.vocab_size), targets.reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[0] == pytest.approx(math.log(args.vocab_size), rel=0.25)
    assert losses[-1] < losses[0] - 0.5
