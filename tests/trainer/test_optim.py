"""Optimizer construction and the LR schedule."""

from __future__ import annotations

import math

import pytest
import torch

from models.llama import LlamaArgs, Transformer
from trainer.config import LRSchedulerConfig, OptimizerConfig
from trainer.optim import build_lr_scheduler, build_optimizer, lr_factor


def test_warmup_then_cosine_to_floor() -> None:
    kw = {"warmup_steps": 4, "total_steps": 20, "decay_type": "cosine", "min_lr_ratio": 0.1}
    f = [lr_factor(s, **kw) for s in range(20)]
    assert f[:4] == [0.25, 0.5, 0.75, 1.0]
    assert f[4] == pytest.approx(1.0)
    assert f[-1] == pytest.approx(0.1)
    assert all(a >= b for a, b in zip(f[4:], f[5:]))  # monotone decay
    assert lr_factor(100, **kw) == pytest.approx(0.1)  # stays at the floor
    mid = 4 + (20 - 4 - 1) / 2
    assert lr_factor(int(mid), **kw) == pytest.approx(
        0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * int(mid - 4) / 15))
    )


def test_linear_and_constant() -> None:
    lin = [
        lr_factor(s, warmup_steps=0, total_steps=11, decay_type="linear", min_lr_ratio=0.0) for s in range(11)
    ]
    assert lin[0] == 1.0 and lin[-1] == pytest.approx(0.0) and lin[5] == pytest.approx(0.5)
    assert lr_factor(7, warmup_steps=2, total_steps=10, decay_type="constant", min_lr_ratio=0.0) == 1.0


def test_scheduler_drives_optimizer_and_no_decay_on_norms() -> None:
    model = Transformer(LlamaArgs(dim=32, n_layers=1, n_heads=2, vocab_size=64, ffn_hidden_dim=64))
    opt = build_optimizer(model, OptimizerConfig(lr=1e-3, weight_decay=0.1), device_type="cpu")
    decay, no_decay = opt.param_groups
    assert all(p.ndim >= 2 for p in decay["params"]) and decay["weight_decay"] == 0.1
    assert all(p.ndim == 1 for p in no_decay["params"]) and no_decay["weight_decay"] == 0.0
    sched = build_lr_scheduler(
        opt, LRSchedulerConfig(warmup_steps=2, decay_type="cosine", min_lr_ratio=0.0), 10
    )
    assert opt.param_groups[0]["lr"] == pytest.approx(0.5e-3)
    opt.step()
    sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(1e-3)
    assert isinstance(opt, torch.optim.AdamW)
