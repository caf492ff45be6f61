"""The MoE family on one process: published parameter counts, routing, grouped vs batched experts,
aux-loss injection, capacity dropping, expert bias, and the config checks."""

from __future__ import annotations

import pytest
import torch

from models import get_spec
from models.errors import ConfigError
from models.moe import MOE_SPEC, MoE, MoEArgs, param_counts
from parallelisms.parallel_dims import ParallelDims
from parallelisms.validate import validated_dims
from tests.configs import make_config

# Published totals and active parameters (model cards / papers).
PUBLISHED_MOE = {
    "mixtral_8x7b": (46.7e9, 12.9e9),
    "qwen3_30b_a3b": (30.5e9, 3.3e9),
    "deepseek_moe_16b": (16.4e9, 2.8e9),
}


@pytest.mark.parametrize("name", list(PUBLISHED_MOE))
def test_presets_match_published_counts(name: str) -> None:
    cfg = make_config(f"model={name}")
    total, active = PUBLISHED_MOE[name]
    counts = MOE_SPEC.param_counts(cfg.model)
    print(
        f"{name}: total {counts.total / 1e9:.2f}B (published {total / 1e9}B), active "
        f"{counts.active / 1e9:.2f}B "
        f"(published {active / 1e9}B)"
    )
    assert abs(counts.total - total) / total < 0.02
    assert abs(counts.active - active) / active < 0.02
    with torch.device("meta"):
        model = MOE_SPEC.build(cfg.model)
    assert sum(p.numel() for p in model.parameters()) == counts.total
    # MFU counts active parameters: 6 x active matmul parameters + attention.
    assert MOE_SPEC.flops_per_token(cfg.model, 128) < 6 * counts.total / 2


def _args(**kw) -> MoEArgs:
    base = dict(dim=32, n_layers=2, n_heads=4, vocab_size=64, num_experts=8, top_k=2, moe_hidden_dim=16)
    return MoEArgs(**{**base, **kw})


def _layer(seed: int = 0, **kw) -> MoE:
    torch.manual_seed(seed)
    layer = MoE(_args(**kw))
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.3)
    return layer


def test_grouped_mm_and_batched_fallback_agree() -> None:
    layer = _layer(num_shared_experts=1)
    x = torch.randn(3, 11, 32)
    results = []
    for mode in ("off", "on"):
        layer.experts.grouped_mm = mode
        layer.zero_grad()
        xi = x.clone().requires_grad_()
        out = layer(xi)
        out.pow(2).sum().backward()
        results.append((out.detach(), xi.grad, layer.experts.w1.grad.clone(), layer.experts.w2.grad.clone()))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_matches_a_per_token_loop() -> None:
    layer = _layer(route_norm=False, route_scale=2.5, score_func="sigmoid")
    x = torch.randn(2, 5, 32)
    out = layer(x)
    tokens = x.reshape(-1, 32)
    scores = (tokens @ layer.router.gate.weight.T).sigmoid()
    want = torch.zeros_like(tokens)
    e = layer.experts
    for t in range(tokens.shape[0]):
        for j in scores[t].topk(2).indices.tolist():
            h = torch.nn.functional.silu(e.w1[j] @ tokens[t]) * (e.w3[j] @ tokens[t])
            want[t] += 2.5 * scores[t, j] * (e.w2[j] @ h)
    torch.testing.assert_close(out.reshape(-1, 32), want, rtol=1e-5, atol=1e-5)


def test_bf16_autocast_matches_fp32_within_bf16_tolerance() -> None:
    """Under bf16 autocast the experts return bf16 rows for fp32 tokens (``training.mixed_precision=bf16``):
    the combine must accept them (it crashed in ``index_add``) and stay close to the fp32 layer."""
    layer = _layer(num_shared_experts=1)
    x = torch.randn(2, 7, 32)
    want = layer(x)
    xi = x.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = layer(xi)
    out.float().pow(2).sum().backward()
    assert out.dtype == torch.float32 and xi.grad is not None and torch.isfinite(xi.grad).all()
    err = ((out - want).abs().max() / want.abs().max()).item()
    print(f"MoE layer bf16 autocast vs fp32: max error {err:.2e} of the output's range")
    assert err < 3e-2, err


@pytest.mark.parametrize("kind", ["global", "sequence"])
def test_aux_loss_changes_gradients_not_outputs(kind: str) -> None:
    x = torch.randn(2, 8, 32)
    plain, aux = _layer(), _layer(aux_loss_coeff=0.1, aux_loss_type=kind)
    aux.aux_grad_scale = 1.0 / 16  # weight per token: tokens x scale = 1
    out_plain, out_aux = plain(x), aux(x)
    torch.testing.assert_close(out_plain, out_aux, rtol=0, atol=0)
    out_aux.sum().backward()
    # The same gradient as adding coeff * aux to the loss by hand.
    ref = _layer(aux_loss_type=kind)  # aux_loss_coeff 0: no injected gradient
    w, idx, scores = ref.router(x.reshape(-1, 32), ref.expert_bias)
    (ref(x).sum() + 0.1 * ref._aux_loss(scores, idx, 2, 8)).backward()
    torch.testing.assert_close(aux.router.gate.weight.grad, ref.router.gate.weight.grad, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(aux.router.gate.weight.grad, _grad_without_aux(x))
    stats = aux.step_stats()
    assert stats[-1] == 16 and stats[:8].sum() == 32 and stats[8] > 0


def _grad_without_aux(x: torch.Tensor) -> torch.Tensor:
    layer = _layer()
    layer(x).sum().backward()
    return layer.router.gate.weight.grad


def test_expert_bias_steers_choice_only_and_moves_by_sign() -> None:
    layer = _layer(bias_update_coeff=0.5)
    x = torch.randn(1, 6, 32)
    with torch.no_grad():
        layer.expert_bias[3] = 10.0
        w, idx, scores = layer.router(x.reshape(-1, 32), layer.expert_bias)
    assert (idx == 3).any(dim=1).all()  # every token picks expert 3
    torch.testing.assert_close(w.sum(-1), torch.ones(6))  # weights from unbiased scores, renormalised
    layer.update_bias(torch.tensor([4.0, 0, 0, 0, 0, 0, 0, 4]))  # mean 1: 0 and 7 overloaded
    assert layer.expert_bias.tolist() == [-0.5, 0.5, 0.5, 10.5, 0.5, 0.5, 0.5, -0.5]


def test_capacity_factor_drops_overflowing_tokens() -> None:
    layer = _layer(capacity_factor=0.25)  # capacity ceil(0.25 * 16 * 2 / 8) = 1 copy per expert
    x = torch.randn(1, 16, 32)
    w, idx, _ = layer.router(x.reshape(-1, 32), layer.expert_bias)
    out = layer(x).reshape(-1, 32)
    # At most E = 8 copies survive: with 16 tokens at least 8 tokens get no expert output at all.
    assert (out.abs().sum(-1) == 0).sum() >= 8
    layer.capacity_factor = 0.0
    assert (layer(x).reshape(-1, 32).abs().sum(-1) == 0).sum() == 0


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        (["model.top_k=9"], "exceeds model.num_experts=8"),
        (["model.score_func=relu"], "model.score_func"),
        (["model.grouped_mm=maybe"], "model.grouped_mm"),
        (["model.first_k_dense=4"], "no layer is an MoE layer"),
        (["model.capacity_factor=-1"], "model.capacity_factor"),
    ],
)
def test_bad_moe_config(overrides: list[str], needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        make_config("model=moe_debug", *overrides)


@pytest.mark.parametrize(
    ("model", "kw", "world", "needle"),
    [
        ("moe_debug", dict(ep=3, dp_shard=3), 3, "num_experts=8 is not divisible by parallelism.ep=3"),
        ("moe_debug", dict(ep=2, dp_shard=1, dp_replicate=2), 2, "must divide dp_shard\\*cp"),
        ("moe_debug", dict(ep=4, dp_shard=2, tp=2), 4, "must divide dp_shard\\*cp"),
        ("debug", dict(ep=2, dp_shard=2), 2, "needs a mixture-of-experts model"),
        ("moe_debug", dict(ep=2, dp_shard=2, compile=True), 2, "training.compile=true with parallelism.ep=2"),
    ],
)
def test_ep_layout_checks(model: str, kw: dict, world: int, needle: str) -> None:
    cfg = make_config(f"model={model}")
    compile = kw.pop("compile", False)
    for key, value in kw.items():
        setattr(cfg.parallelism, key, value)
    with pytest.raises(ConfigError, match=needle):
        validated_dims(
            cfg.parallelism,
            world,
            spec=get_spec(cfg.model.family),
            model_args=cfg.model,
            seq_len=256,
            global_batch_size=24,
            micro_batch_size=2,
            compile=compile,
        )


def test_ep_mesh_coordinates() -> None:
    dims = ParallelDims(dp_replicate=2, dp_shard=4, ep=2, tp=2, world_size=16)
    assert dims.mesh_dim_names == ("pp", "dp_replicate", "dp_shard_mod_ep", "dp_shard_in_ep", "cp", "tp")
    c = dims.coordinates(0b1011)  # rep 1, mod 0, in 1, tp 1
    assert (c["dp_replicate"], c["dp_shard_mod_ep"], c["dp_shard_in_ep"], c["tp"]) == (1, 0, 1, 1)
    assert (c["ep"], c["dp_shard"], c["dp"], c["dp_cp"]) == (1, 1, 5, 5)


def test_counts_active_vs_total() -> None:
    args = _args(num_shared_experts=2, first_k_dense=1, qk_norm=True, ffn_hidden_dim=40)
    counts = param_counts(args)
    expert = 3 * 32 * 16
    assert counts.total - counts.active == 1 * (8 - 2) * expert  # one MoE layer, 6 idle experts
