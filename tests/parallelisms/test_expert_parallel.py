"""Expert-parallel dispatch / combine (2 gloo ranks): the all_to_all round trip is the identity
on token order for random routings (also with experts that receive no token), and an MoE layer
under EP gives the single-process outputs, input gradients and expert-weight gradients."""

from __future__ import annotations

from typing import Optional

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests.dist import run_distributed

pytestmark = pytest.mark.slow


class _Identity(nn.Module):
    """Experts that return their rows and record which rows (and counts) they were given."""

    def forward(
        self, x: torch.Tensor, counts: torch.Tensor, host_counts: Optional[list[int]] = None
    ) -> torch.Tensor:
        self.seen = (x.detach().clone(), counts.clone())
        self.host_counts = host_counts
        return x * 1.0


def _round_trips(rank: int, world_size: int) -> list[str]:
    from parallelisms.expert_parallel import AllToAllDispatcher

    group = dist.new_group(list(range(world_size)))
    dispatcher = AllToAllDispatcher(group, world_size)
    num_experts = 8
    failures = []
    for trial in range(12):
        g = torch.Generator().manual_seed(1000 * trial + rank)
        n = int(torch.randint(0, 40, (1,), generator=g))
        # Some trials route only to a few experts (the others receive nothing from anyone).
        allowed = torch.arange(num_experts) if trial % 3 else torch.tensor([0, 5])
        expert = (
            allowed[torch.randint(0, len(allowed), (n,), generator=g)].sort().values
        )  # rows sorted by expert
        counts = torch.bincount(expert, minlength=num_experts)
        rows = torch.randn(n, 6, generator=g, dtype=torch.float64).requires_grad_()
        experts = _Identity()
        out = dispatcher(rows, counts, experts)
        if not torch.equal(out, rows):
            failures.append(f"trial {trial}: round trip changed the rows")
        # The local experts received exactly the rows routed to them, grouped by expert.
        arrived, local_counts = experts.seen
        start = num_experts // world_size * rank
        want = torch.zeros(num_experts // world_size, dtype=torch.long)
        gathered = [torch.zeros(num_experts, dtype=torch.long) for _ in range(world_size)]
        dist.all_gather(gathered, counts, group=group)
        for c in gathered:
            want += c[start : start + num_experts // world_size]
        if not torch.equal(local_counts, want) or arrived.shape[0] != int(want.sum()):
            failures.append(f"trial {trial}: local counts {local_counts.tolist()} != {want.tolist()}")
        out.backward(torch.ones_like(out))
        if not torch.equal(rows.grad, torch.ones_like(rows)):
            failures.append(f"trial {trial}: backward round trip is not the identity")
    return failures


def _fixed_splits(rank: int, world_size: int) -> list[str]:
    """A routing known on the host (balanced: every rank alike) gives the splits, local counts and
    rows the exchanged counts give, without reading a tensor."""
    from models.moe.model import balanced_counts
    from parallelisms.expert_parallel import AllToAllDispatcher

    group = dist.new_group(list(range(world_size)))
    dispatcher = AllToAllDispatcher(group, world_size)
    failures = []
    for copies, num_experts in ((24, 8), (21, 8), (5, 4)):  # uneven: the first experts get one more
        host = balanced_counts(copies, num_experts)
        counts = torch.tensor(host)
        g = torch.Generator().manual_seed(copies + rank)
        rows = torch.randn(copies, 6, generator=g, dtype=torch.float64)
        synced, fixed = _Identity(), _Identity()
        out_synced = dispatcher(rows, counts, synced)
        out_fixed = dispatcher(rows, counts, fixed, host)
        if not (torch.equal(out_synced, rows) and torch.equal(out_fixed, rows)):
            failures.append(f"{copies} copies: a round trip changed the rows")
        if not all(torch.equal(a, b) for a, b in zip(synced.seen, fixed.seen)):
            failures.append(f"{copies} copies: fixed splits delivered other rows than the exchanged counts")
        if fixed.host_counts != synced.seen[1].tolist():
            failures.append(f"{copies} copies: host counts {fixed.host_counts} != {synced.seen[1].tolist()}")
    return failures


def _balanced_layer(rank: int, world_size: int) -> float:
    """Balanced routing through the expert-parallel layer equals the single-process layer's."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    from models.moe import MoE, MoEArgs
    from parallelisms.expert_parallel import AllToAllDispatcher

    args = MoEArgs(dim=16, n_layers=1, n_heads=2, num_experts=8, top_k=2, moe_hidden_dim=12, grouped_mm="off")
    torch.manual_seed(0)
    full = MoE(args)
    with torch.no_grad():
        for p in full.parameters():
            p.normal_(0, 0.3)
    full.balanced_routing = True
    x_all = torch.randn(world_size, 3, 7, 16)  # 42 copies: uneven over 8 experts
    ref = full(x_all[rank])
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("ep",))
    ep_layer = MoE(args)
    ep_layer.load_state_dict(full.state_dict())
    for name, p in list(ep_layer.experts.named_parameters(recurse=False)):
        local = p.detach().chunk(world_size)[rank].clone()
        ep_layer.experts.register_parameter(name, nn.Parameter(DTensor.from_local(local, mesh, [Shard(0)])))
    ep_layer.dispatcher = AllToAllDispatcher(mesh.get_group(), world_size)
    ep_layer.balanced_routing = True
    return (ep_layer(x_all[rank]) - ref).abs().max().item()


def _both(rank: int, world_size: int) -> dict:
    return {
        "round_trips": _round_trips(rank, world_size),
        "layer": _layer_grads(rank, world_size),
        "fixed_splits": _fixed_splits(rank, world_size),
        "balanced_layer": _balanced_layer(rank, world_size),
    }


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_distributed(_both, 2)  # one spawn for both tests


def test_dispatch_then_combine_is_the_identity(results: list[dict]) -> None:
    for r in results:
        assert r["round_trips"] == []


def _layer_grads(rank: int, world_size: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    from models.moe import MoE, MoEArgs
    from parallelisms.expert_parallel import AllToAllDispatcher

    args = MoEArgs(
        dim=16, n_layers=1, n_heads=2, num_experts=8, top_k=2, moe_hidden_dim=12, num_shared_experts=1
    )
    torch.manual_seed(0)
    full = MoE(args)
    with torch.no_grad():
        for p in full.parameters():
            p.normal_(0, 0.3)
    x_all = torch.randn(world_size, 3, 10, 16)  # each rank its own tokens
    # Single-process reference: all ranks' tokens through one layer; per-rank loss sums.
    ref_x = x_all.clone().requires_grad_()
    ref_out = torch.cat([full(ref_x[r]) for r in range(world_size)])
    (ref_out.pow(2).sum()).backward()
    ref = {n: p.grad.clone() for n, p in full.named_parameters()}

    # Expert parallel: the same weights, experts sharded Shard(0) over the ranks.
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("ep",))
    ep_layer = MoE(args)
    ep_layer.load_state_dict(full.state_dict())
    for name, p in list(ep_layer.experts.named_parameters(recurse=False)):
        local = p.detach().chunk(world_size)[rank].clone()
        ep_layer.experts.register_parameter(name, nn.Parameter(DTensor.from_local(local, mesh, [Shard(0)])))
    ep_layer.dispatcher = AllToAllDispatcher(mesh.get_group(), world_size)
    x = x_all[rank].clone().requires_grad_()
    out = ep_layer(x)
    out.pow(2).sum().backward()
    errors = {
        "output": (out - ref_out[rank * 3 : rank * 3 + 3]).abs().max().item(),
        "input_grad": (x.grad - ref_x.grad[rank]).abs().max().item(),
    }
    for name, p in ep_layer.named_parameters():
        grad = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
        want = ref[name].chunk(world_size)[rank] if isinstance(p, DTensor) else None
        if want is not None:  # expert weights: this rank's experts get every rank's tokens' gradient
            errors[name] = ((grad - want).abs().max() / want.abs().max()).item()
    return errors


def test_a_routing_known_on_the_host_splits_as_the_exchanged_counts(results: list[dict]) -> None:
    for r in results:
        assert r["fixed_splits"] == []
        assert r["balanced_layer"] < 1e-6


def test_expert_weight_gradients_match_single_process(results: list[dict]) -> None:
    for errors in (r["layer"] for r in results):
        assert {"experts.w1", "experts.w2", "experts.w3"} <= set(errors)
        for name, err in errors.items():
            assert err < 1e-5, (name, err)
