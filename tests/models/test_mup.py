"""µP (``model.mup``, ``models/mup.py``) for the Llama-style families.

* The coordinate check (Tensor Programs V, figure 5): after a few AdamW steps the change of the logits
  and of the last block's output, RMS over the coordinates, stays flat across widths 64, 128 and 256
  under µP (ratio width 256 / width 64 within [0.5, 1.5]; measured ~0.6 for the logits, ~0.9 for the
  block) and grows under the standard parametrisation (ratio > 3; measured ~5.5 and ~10).
* The pieces against plain expressions: the forward with µP's multipliers equals the standard model's
  with the multipliers folded into its weights; the initialisation is the standard one rescaled; the
  AdamW groups carry lr * base_dim / dim for the blocks' matrices and lr for the rest.
* Refusals by name: moe / deepseek_v3 / qwen3_5 / qwen3_5_moe, tied embeddings, Muon, Hugging Face export.
"""

from __future__ import annotations

import math
import re

import pytest
import torch
import torch.nn.functional as F

from models.errors import ConfigError
from models.llama import LLAMA_SPEC, LlamaArgs, Transformer
from models.mup import MupArgs
from tests.configs import make_config
from trainer.optim import build_optimizer
from trainer.optim.config import OptimizerConfig

VOCAB = 512
BASE = 64


def _args(dim: int, mup: bool, **mup_kw: float) -> LlamaArgs:
    """Width ``dim``: heads of 16 (n_heads = dim / 16) and an FFN of 3 x dim, so every hidden size
    grows with ``dim`` as µP's width multiplier assumes."""
    return LlamaArgs(
        dim=dim,
        n_layers=2,
        n_heads=dim // 16,
        vocab_size=VOCAB,
        ffn_hidden_dim=3 * dim,
        max_seq_len=64,
        mup=MupArgs(enable=mup, base_dim=BASE, **mup_kw),
    )


def _model(args: LlamaArgs) -> Transformer:
    model = Transformer(args)
    model.init_weights(seed=0)
    return model


def _coordinate_changes(dim: int, mup: bool, steps: int = 5, lr: float = 3e-3) -> tuple[float, float]:
    """RMS of (after ``steps`` AdamW steps - at init) of the logits and of the last block's output, on
    the training batch (fixed tokens, the same at every width)."""
    tokens = torch.randint(0, VOCAB, (8, 33), generator=torch.Generator().manual_seed(0))
    args = _args(dim, mup)
    model = _model(args)
    opt = build_optimizer(
        model, OptimizerConfig(lr=lr, weight_decay=0.0), device_type="cpu", lr_scale=LLAMA_SPEC.lr_scale(args)
    )
    block: list[torch.Tensor] = []
    model.layers["1"].register_forward_hook(lambda _m, _i, out: block.append(out.detach()))
    logits0 = model(tokens[:, :-1]).detach()
    block0 = block[-1]
    for _ in range(steps):
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        logits = model(tokens[:, :-1])
    rms = lambda t: t.pow(2).mean().sqrt().item()  # noqa: E731
    return rms(logits - logits0), rms(block[-1] - block0)


def test_coordinate_check_flat_under_mup_and_growing_under_sp() -> None:
    changes = {(p, d): _coordinate_changes(d, p == "mup") for p in ("sp", "mup") for d in (64, 128, 256)}
    for (p, d), (logit, blk) in changes.items():
        print(f"{p:>3} width {d:>3}: logits change RMS {logit:.3f}, block output change RMS {blk:.3f}")
    # At the base width µP is the standard model but for the attention scale (1/d for 1/sqrt(d)).
    assert changes[("mup", 64)] == pytest.approx(changes[("sp", 64)], rel=0.05)
    for i, what in enumerate(("logits", "block output")):
        mup = changes[("mup", 256)][i] / changes[("mup", 64)][i]
        sp = changes[("sp", 256)][i] / changes[("sp", 64)][i]
        assert 0.5 <= mup <= 1.5, (what, mup)
        assert sp > 3.0, (what, sp)


def test_mup_forward_is_the_standard_model_with_the_multipliers_folded_in() -> None:
    """attn_mult = sqrt(head_dim) makes µP's attn_mult/D the standard 1/sqrt(D); then the µP model at
    width 128 equals the standard model whose embedding is multiplied by input_mult and whose head by
    output_mult * base/dim (same weights otherwise), to fp32 rounding (1e-5 absolute; logits of order 1)."""
    dim, head = 128, 16
    mup_kw = {"input_mult": 2.5, "output_mult": 3.0, "attn_mult": math.sqrt(head)}
    mup = _model(_args(dim, True, **mup_kw))
    sp = Transformer(_args(dim, False))
    sp.load_state_dict(mup.state_dict())
    with torch.no_grad():
        sp.tok_embeddings.weight.mul_(2.5)
        sp.output.weight.mul_(3.0 * BASE / dim)
    tokens = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(mup(tokens), sp(tokens), rtol=1e-5, atol=1e-5)  # measured max 1.8e-6
    # attn_mult=1 (the default): the attention logits are q.k / D, not q.k / sqrt(D)
    assert mup.layers["0"].attention.q_scale == 1.0
    assert _model(_args(dim, True)).layers["0"].attention.q_scale == pytest.approx(1 / math.sqrt(head))
    assert sp.layers["0"].attention.q_scale is None


def test_mup_initialisation_and_lr_groups() -> None:
    dim = 256
    mup, sp = _model(_args(dim, True)), _model(_args(dim, False))
    m = dim / BASE
    for name, p in mup.named_parameters():
        ref = dict(sp.named_parameters())[name]
        if name.startswith("layers.") and p.ndim == 2:  # hidden: std / sqrt(m), from the same draws
            torch.testing.assert_close(p, ref / math.sqrt(m), rtol=1e-5, atol=1e-8)
        elif name == "output.weight":  # the base model's head: std base**-0.5 instead of dim**-0.5
            torch.testing.assert_close(p, ref * math.sqrt(m), rtol=1e-5, atol=1e-8)
        else:
            assert torch.equal(p, ref), name
    opt = build_optimizer(
        mup,
        OptimizerConfig(lr=1e-3, weight_decay=0.1),
        device_type="cpu",
        lr_scale=LLAMA_SPEC.lr_scale(mup.args),
    )
    assert isinstance(opt, torch.optim.AdamW)
    names = {id(p): n for n, p in mup.named_parameters()}
    for group in opt.param_groups:
        for p in group["params"]:
            hidden = names[id(p)].startswith("layers.") and p.ndim == 2
            assert group["lr"] == pytest.approx(1e-3 / m if hidden else 1e-3), names[id(p)]
            assert group["weight_decay"] == (0.1 if p.ndim == 2 else 0.0), names[id(p)]
    assert sum(len(g["params"]) for g in opt.param_groups) == len(list(mup.parameters()))
    assert LLAMA_SPEC.lr_scale(sp.args) is None  # off: the two standard groups, unchanged


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (("model=moe_debug",), "model.mup.enable=true with model.family=moe: µP"),
        (("model=deepseek_v3_debug",), "model.mup.enable=true with model.family=deepseek_v3: µP"),
        (("model=qwen3_5_debug",), "model.mup.enable=true with model.family=qwen3_5: µP"),
        (("model=qwen3_5_moe_debug",), "model.mup.enable=true with model.family=qwen3_5_moe: µP"),
        (("model=qwen3_debug",), "model.mup.enable=true with model.tie_embeddings=true"),
        (("optimizer=muon",), "model.mup.enable=true with optimizer.name=muon"),
        (("checkpoint.last_save_in_hf=true",), "model.mup.enable=true with checkpoint.last_save_in_hf=true"),
        (("model.mup.base_dim=0",), "model.mup.base_dim=0 must be a positive integer"),
    ],
)
def test_mup_refusals(overrides: tuple[str, ...], message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        make_config(*overrides, "model.mup.enable=true")


def test_qwen3_with_mup_builds_and_refuses_export() -> None:
    from models.qwen3 import QWEN3_SPEC, Qwen3HF

    cfg = make_config("model=qwen3_debug", "model.mup.enable=true", "model.tie_embeddings=false")
    assert QWEN3_SPEC.lr_scale(cfg.model) is not None
    with pytest.raises(ConfigError, match="Export is refused for µP models"):
        Qwen3HF().to_hf_config(cfg.model, bos_id=None, eos_id=None, dtype="float32")
