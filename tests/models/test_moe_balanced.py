"""Balanced routing of the MoE layer (``MoE.balanced_routing``, what a rehearsal sets): copy j of a
forward's token copies goes to expert j mod E, the counts are known on the host, and the layer runs
under FakeTensorMode (no value is read); with it off, the layer is what it was."""

from __future__ import annotations

import pytest
import torch

from models.moe import MoE, MoEArgs
from models.moe.model import balanced_counts


def _layer(**overrides: object) -> MoE:
    args = MoEArgs(dim=16, n_layers=1, n_heads=2, num_experts=8, top_k=2, moe_hidden_dim=12, grouped_mm="off")
    for key, value in overrides.items():
        setattr(args, key, value)
    torch.manual_seed(0)
    layer = MoE(args)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.3)
    layer.balanced_routing = True
    return layer


def test_balanced_counts_spread_the_copies_evenly() -> None:
    assert balanced_counts(32, 8) == [4] * 8
    assert balanced_counts(21, 8) == [3, 3, 3, 3, 3, 2, 2, 2]
    assert sum(balanced_counts(8192 * 8, 128)) == 8192 * 8


def test_every_expert_gets_its_balanced_share() -> None:
    layer = _layer()
    layer(torch.randn(3, 7, 16))  # 21 tokens x top-2 = 42 copies
    counts = layer.step_stats()[:8]
    assert counts.tolist() == balanced_counts(42, 8)


@pytest.mark.parametrize("capacity_factor", [0.5, 0.9, 1.5])
def test_capacity_drop_from_host_counts_equals_the_general_drop(capacity_factor: float) -> None:
    layer = _layer(capacity_factor=capacity_factor)
    T, k = 21, 2
    flat = torch.arange(T * k) % 8
    order = torch.argsort(flat, stable=True)
    host = balanced_counts(T * k, 8)
    want_order, want_counts = layer._drop_over_capacity(flat, order, torch.tensor(host), T)
    got_order, got_counts, got_host = layer._drop_over_capacity_known(order, host, T)
    assert torch.equal(got_order, want_order)
    assert torch.equal(got_counts, want_counts)
    assert got_host == want_counts.tolist()


@pytest.mark.parametrize("capacity_factor", [0.0, 0.5])
def test_the_layer_runs_under_fake_tensors(capacity_factor: float) -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    layer = _layer(capacity_factor=capacity_factor, aux_loss_coeff=0.01)
    with FakeTensorMode(allow_non_fake_inputs=True):
        x = torch.randn(2, 8, 16, requires_grad=True)
        out = layer(x)
        out.sum().backward()
        assert out.shape == (2, 8, 16) and x.grad is not None and x.grad.shape == x.shape


def test_routing_off_chooses_by_score() -> None:
    layer = _layer()
    layer.balanced_routing = False
    layer(torch.randn(3, 7, 16))
    assert layer.step_stats()[:8].tolist() != balanced_counts(42, 8)  # this seed's top-2 is uneven
