"""Hugging Face interop of the MoE family: small random Mixtral and Qwen3-MoE models built by
``transformers`` import with equal logits, and our exports load back in ``transformers``."""

from __future__ import annotations

import pytest
import torch

from models.moe import MOE_SPEC
from trainer.hf import load_hf_into, read_hf, save_hf

transformers = pytest.importorskip("transformers", reason="transformers (the dev extra) is not installed")

ATOL = 1e-4


def _mixtral() -> torch.nn.Module:
    cfg = transformers.MixtralConfig(
        vocab_size=128, hidden_size=64, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=64,
        rope_theta=10000.0,
    )  # fmt: skip
    return transformers.MixtralForCausalLM(cfg)


def _qwen3_moe() -> torch.nn.Module:
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=8, num_experts_per_tok=3,
        norm_topk_prob=True, mlp_only_layers=[0], decoder_sparse_step=1, max_position_embeddings=64,
    )  # fmt: skip
    return transformers.Qwen3MoeForCausalLM(cfg)


def _randomise(model: torch.nn.Module) -> None:
    """Random norms and router too (HF initialises norms to ones): every tensor must be mapped right."""
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(
                torch.randn(p.shape, generator=g) * (0.3 if p.dim() > 1 else 0.2)
                + (1.0 if p.dim() == 1 else 0)
            )


@pytest.mark.parametrize("build", [_mixtral, _qwen3_moe], ids=["mixtral", "qwen3_moe"])
def test_import_and_export_match_transformers_logits(build, tmp_path) -> None:
    torch.manual_seed(0)
    hf = build().float().eval()
    _randomise(hf)
    hf.save_pretrained(tmp_path / "hf")
    tokens = torch.randint(0, 128, (2, 24))
    with torch.no_grad():
        expected = hf(tokens).logits

    spec, args, state = read_hf(str(tmp_path / "hf"))
    assert spec is MOE_SPEC
    model = spec.build(args).eval()
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {n for n in missing if n.endswith("expert_bias")}
    with torch.no_grad():
        model.reset_rope_cache("cpu")
        for _, moe in spec.extra["moe_layers"](model):
            moe.expert_bias.zero_()
        ours = model(tokens)
    diff = (ours - expected).abs().max().item()
    print(f"{type(hf).__name__}: import max |logit diff| = {diff:.2e}")
    assert diff < ATOL

    # The sliced reader (what every rank of a parallel run uses) stacks the per-expert tensors too.
    with torch.device("meta"):
        sliced = spec.build(args)
    sliced.to_empty(device="cpu")
    load_hf_into(sliced, str(tmp_path / "hf"), spec, args)
    for name, p in sliced.named_parameters():
        assert torch.equal(p, state[name]), name

    full = {k: v for k, v in model.state_dict().items()}
    save_hf(full, spec, args, str(tmp_path / "export"))
    back = type(hf).from_pretrained(tmp_path / "export").float().eval()
    with torch.no_grad():
        again = back(tokens).logits
    diff = (again - ours).abs().max().item()
    print(f"{type(hf).__name__}: export -> transformers max |logit diff| = {diff:.2e}")
    assert diff < ATOL
