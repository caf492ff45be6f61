"""ShardedOptimizer (ZeRO-1) on gloo ranks: ownership, sharded state, parity, resharding checkpoints.

As in test_ddp.py, each world size is spawned once by a module-scoped fixture; the 4-rank run
also produces the checkpoint that the 2-rank and the plain single-process runs resume from.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh

from models.errors import ConfigError
from parallelisms.ddp import BucketedDDP, apply_ddp, finish_gradient_sync
from parallelisms.sharded_optimizer import ShardedOptimizer, assign_owners
from tests.dist import run_distributed
from tests.parallelisms.test_ddp import (
    TINY_BUCKET_MB,
    as_bytes,
    from_bytes,
    local_slice,
    make_batch,
    make_model,
    params_of,
)

NUM_STEPS = 8  # steps before the checkpoint; one more step follows it
ADAMW = {"lr": 1e-2, "betas": (0.9, 0.95), "weight_decay": 0.1}


def train_step(
    model: nn.Module, opt: torch.optim.Optimizer, step: int, rank: int = 0, world_size: int = 1
) -> None:
    x, y = make_batch(step)
    F.mse_loss(model(local_slice(x, rank, world_size)), local_slice(y, rank, world_size)).backward()
    finish_gradient_sync(model)
    opt.step()
    opt.zero_grad()


def sharded_run(rank: int, world_size: int, assignment: str) -> dict[str, Any]:
    """DDP + ShardedOptimizer(AdamW) for NUM_STEPS steps, checkpoint, then one more step."""
    ddp = BucketedDDP(make_model(seed=0), dist.group.WORLD, bucket_mb=TINY_BUCKET_MB)
    opt = ShardedOptimizer(
        ddp.parameters(), torch.optim.AdamW, dist.group.WORLD, assignment=assignment, **ADAMW
    )
    for step in range(NUM_STEPS):
        train_step(ddp, opt, step, rank, world_size)
    index = {p: i for i, p in enumerate(ddp.parameters())}
    out = {
        "owners": [opt.owner_of(i) for i in range(len(index))],
        "owned": [index[p] for p in opt.owned_params()],
        "state_indices": sorted(index[p] for p in opt.state),
        "inner_state_is_state": opt.state is opt.inner_optimizer.state,
        "state_dict": copy.deepcopy(opt.state_dict()),  # state_dict() references the live state
        "consolidated": opt.consolidated_state_dict(),
        "consolidated_to_0": opt.consolidated_state_dict(dst=0),
        "params": params_of(ddp),
    }
    train_step(ddp, opt, NUM_STEPS, rank, world_size)
    out["params_next"] = params_of(ddp)
    return out


def _suite_4(rank: int, world_size: int) -> bytes:
    return as_bytes(sharded_run(rank, world_size, "balanced"))


def _suite_2(rank: int, world_size: int, checkpoint_bytes: bytes) -> bytes:
    out: dict[str, Any] = {"run": sharded_run(rank, world_size, "round_robin")}
    checkpoint = from_bytes(checkpoint_bytes)
    world = dist.group.WORLD

    # Resume the 4-rank run from the merge of its per-rank state dicts, under 2 ranks.
    model = make_model(seed=1)
    model.load_state_dict(checkpoint["params"])
    ddp = BucketedDDP(model, world, bucket_mb=TINY_BUCKET_MB)
    opt = ShardedOptimizer(ddp.parameters(), torch.optim.AdamW, world, **ADAMW)
    opt.load_state_dict(checkpoint["merged"])
    index = {p: i for i, p in enumerate(ddp.parameters())}
    out["resumed_state_indices"] = sorted(index[p] for p in opt.state)
    out["resumed_owned"] = [index[p] for p in opt.owned_params()]
    train_step(ddp, opt, NUM_STEPS, rank, world_size)
    out["resumed_params"] = params_of(ddp)

    # torch.distributed.checkpoint sees a normal optimizer whose state keys live on one rank each.
    # Loading needs strict=False: DCP would otherwise demand state for the non-owned parameters.
    dcp_state = get_optimizer_state_dict(ddp, opt)
    fresh = ShardedOptimizer(ddp.parameters(), torch.optim.AdamW, world, **ADAMW)
    set_optimizer_state_dict(ddp, fresh, dcp_state, options=StateDictOptions(strict=False))
    out["dcp"] = {
        "keys": sorted(dcp_state["state"]),
        "owned_names": sorted(n for n, p in ddp.named_parameters() if p in opt.state),
        "roundtrip": all(
            torch.equal(opt.state[p]["exp_avg_sq"], fresh.state[p]["exp_avg_sq"]) for p in opt.state
        )
        and fresh.state.keys() == opt.state.keys(),
    }

    # A checkpoint holding only rank 0's shard of the 4-rank run lacks state for our params ...
    try:
        opt.load_state_dict(checkpoint["rank0_only"])
        out["missing_error"] = None
    except ConfigError as e:
        out["missing_error"] = str(e)
    # ... while a fresh optimizer's (no state at all) is fine.
    opt.load_state_dict(ShardedOptimizer(ddp.parameters(), torch.optim.AdamW, world, **ADAMW).state_dict())
    out["fresh_loaded_state"] = len(opt.state)

    # LR scheduler on the wrapper reaches the inner optimizer (and the update size shows it).
    model = make_model(seed=0)
    opt = ShardedOptimizer(model.parameters(), torch.optim.SGD, world, lr=1.0)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.1)
    inner_lrs, deltas = [], []
    for _ in range(3):
        before = model[0].weight.detach().clone()
        for p in model.parameters():
            p.grad = torch.ones_like(p)
        opt.step()
        scheduler.step()
        inner_lrs.append(opt.inner_optimizer.param_groups[0]["lr"])
        deltas.append((before - model[0].weight).mean().item())
    out["lr"] = {"inner": inner_lrs, "delta": deltas, "outer": opt.param_groups[0]["lr"]}

    # average_gradients=True without DDP: the optimizer averages the local gradients itself.
    model = make_model(seed=0)
    opt = ShardedOptimizer(model.parameters(), torch.optim.AdamW, world, average_gradients=True, **ADAMW)
    for step in range(3):
        train_step(model, opt, step, rank, world_size)
    out["self_averaged"] = params_of(model)

    # The all-gather exchange (used on NCCL) also works on gloo: cover it here.
    ddp = BucketedDDP(make_model(seed=0), world, bucket_mb=TINY_BUCKET_MB)
    opt = ShardedOptimizer(ddp.parameters(), torch.optim.AdamW, world, **ADAMW)
    opt.sync_with_all_gather = True
    for step in range(3):
        train_step(ddp, opt, step, rank, world_size)
    out["all_gather_path"] = params_of(ddp)

    # ZeRO-1 on top of torch's DDP (parallelism.ddp.impl=torch, sharded_optimizer=true).
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp_replicate",))
    model = apply_ddp(make_model(seed=0), mesh, impl="torch", bucket_mb=TINY_BUCKET_MB)
    opt = ShardedOptimizer(model.parameters(), torch.optim.AdamW, mesh.get_group(), **ADAMW)
    for step in range(3):
        train_step(model, opt, step, rank, world_size)
    out["torch_ddp"] = {n.removeprefix("module."): p.detach().clone() for n, p in model.named_parameters()}
    return as_bytes(out)


@pytest.fixture(scope="module")
def suite_4() -> list[dict[str, Any]]:
    return [from_bytes(r) for r in run_distributed(_suite_4, 4)]


@pytest.fixture(scope="module")
def suite_2(suite_4: list[dict[str, Any]]) -> list[dict[str, Any]]:
    merged = {"state": {}, "param_groups": suite_4[0]["state_dict"]["param_groups"]}
    for result in suite_4:
        merged["state"].update(result["state_dict"]["state"])
    checkpoint = {
        "params": suite_4[0]["params"],
        "merged": merged,
        "rank0_only": suite_4[0]["state_dict"],
    }
    return [from_bytes(r) for r in run_distributed(_suite_2, 2, as_bytes(checkpoint))]


def reference_adamw(num_steps: int) -> dict[str, torch.Tensor]:
    model = make_model(seed=0)
    opt = torch.optim.AdamW(model.parameters(), **ADAMW)
    for step in range(num_steps):
        train_step(model, opt, step)
    return params_of(model)


def assert_params_close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], exact: bool = False) -> None:
    assert list(a) == list(b)
    for name in a:
        if exact:
            assert torch.equal(a[name], b[name]), name
        else:
            torch.testing.assert_close(
                a[name], b[name], rtol=1e-6, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}"
            )


# ---------------------------------------------------------------- tests


def test_assign_owners_partition_and_balance() -> None:
    sizes = [4 * n for n in (1000, 7, 7, 300, 5000, 64, 64, 1000, 2, 900, 4096, 4096)]
    for world_size in (1, 2, 3, 4):
        assert assign_owners(sizes, world_size, "round_robin") == [i % world_size for i in range(len(sizes))]
        owners = assign_owners(sizes, world_size, "balanced")
        assert owners == assign_owners(sizes, world_size)  # default, and deterministic
        assert set(owners) == set(range(world_size))
        loads = [sum(s for s, o in zip(sizes, owners) if o == r) for r in range(world_size)]
        assert max(loads) - min(loads) <= max(sizes)  # greedy largest-first bound
    with pytest.raises(ConfigError, match="assignment"):
        assign_owners(sizes, 2, "random")


@pytest.mark.parametrize("world", [2, 4])
def test_every_parameter_has_exactly_one_owner(world: int, suite_2: list[dict], suite_4: list[dict]) -> None:
    runs = [r["run"] for r in suite_2] if world == 2 else suite_4
    owners = runs[0]["owners"]
    assert all(run["owners"] == owners for run in runs)  # every rank agrees
    owned = [i for run in runs for i in run["owned"]]
    assert sorted(owned) == list(range(len(owners)))  # disjoint and complete
    for rank, run in enumerate(runs):
        assert run["owned"] == [i for i, o in enumerate(owners) if o == rank]
    sizes = [p.numel() * 4 for p in make_model(seed=0).parameters()]
    expected = "round_robin" if world == 2 else "balanced"
    assert owners == assign_owners(sizes, world, expected)
    if world == 4:  # balanced: one weight and one bias per rank here
        loads = [sum(s for s, o in zip(sizes, owners) if o == r) for r in range(world)]
        assert max(loads) == min(loads)


@pytest.mark.parametrize("world", [2, 4])
def test_state_only_for_owned_parameters(world: int, suite_2: list[dict], suite_4: list[dict]) -> None:
    runs = [r["run"] for r in suite_2] if world == 2 else suite_4
    for run in runs:
        assert run["inner_state_is_state"]
        assert run["state_indices"] == run["owned"]
        assert sorted(run["state_dict"]["state"]) == run["owned"]
        groups = run["state_dict"]["param_groups"]
        assert [i for g in groups for i in g["params"]] == list(range(len(run["owners"])))


@pytest.mark.parametrize("world", [2, 4])
def test_parity_with_single_process_adamw(world: int, suite_2: list[dict], suite_4: list[dict]) -> None:
    runs = [r["run"] for r in suite_2] if world == 2 else suite_4
    assert_params_close(runs[0]["params"], reference_adamw(NUM_STEPS))
    assert_params_close(runs[0]["params_next"], reference_adamw(NUM_STEPS + 1))
    for run in runs[1:]:  # replicas bitwise equal
        assert_params_close(run["params"], runs[0]["params"], exact=True)
        assert_params_close(run["params_next"], runs[0]["params_next"], exact=True)


def test_consolidated_state_dict_is_a_plain_adamw_checkpoint(suite_4: list[dict[str, Any]]) -> None:
    full = suite_4[0]["consolidated"]
    assert sorted(full["state"]) == list(range(len(suite_4[0]["owners"])))
    assert suite_4[0]["consolidated_to_0"]["state"].keys() == full["state"].keys()
    assert all(r["consolidated_to_0"] == {} for r in suite_4[1:])
    # Resume a plain single-process AdamW from it: the next step equals the 4-rank run's.
    model = make_model(seed=1)
    model.load_state_dict(suite_4[0]["params"])
    opt = torch.optim.AdamW(model.parameters(), **ADAMW)
    opt.load_state_dict(full)
    train_step(model, opt, NUM_STEPS)
    assert_params_close(params_of(model), suite_4[0]["params_next"])


def test_resume_four_rank_checkpoint_on_two_ranks(suite_2: list[dict], suite_4: list[dict]) -> None:
    for result in suite_2:
        assert result["resumed_state_indices"] == result["resumed_owned"]
        assert_params_close(result["resumed_params"], suite_4[0]["params_next"])
    assert_params_close(suite_2[0]["resumed_params"], suite_2[1]["resumed_params"], exact=True)


def test_missing_state_raises_clear_error(suite_2: list[dict[str, Any]]) -> None:
    for result in suite_2:
        message = result["missing_error"]
        assert message is not None and "lacks state for parameter" in message
        assert result["fresh_loaded_state"] == 0


def test_lr_scheduler_reaches_inner_optimizer(suite_2: list[dict[str, Any]]) -> None:
    for result in suite_2:
        lr = result["lr"]
        assert lr["inner"] == pytest.approx([1.0, 0.1, 0.01])  # after step k the inner saw lr_k
        assert lr["delta"] == pytest.approx([1.0, 0.1, 0.01])  # and used it (owned or not)
        assert lr["outer"] == pytest.approx(1e-3)


def test_average_gradients_without_ddp(suite_2: list[dict[str, Any]]) -> None:
    reference = reference_adamw(3)
    for result in suite_2:
        assert_params_close(result["self_averaged"], reference)


def test_all_gather_exchange(suite_2: list[dict[str, Any]]) -> None:
    assert_params_close(suite_2[0]["all_gather_path"], reference_adamw(3))
    assert_params_close(suite_2[0]["all_gather_path"], suite_2[1]["all_gather_path"], exact=True)


def test_distributed_checkpoint_sees_sharded_state(suite_2: list[dict[str, Any]]) -> None:
    keys = []
    for result in suite_2:
        dcp = result["dcp"]
        assert dcp["keys"] == dcp["owned_names"] and dcp["roundtrip"]
        keys += dcp["keys"]
    assert sorted(keys) == sorted(n for n, _ in make_model(seed=0).named_parameters())  # each on one rank


def test_on_top_of_torch_ddp(suite_2: list[dict[str, Any]]) -> None:
    assert_params_close(suite_2[0]["torch_ddp"], reference_adamw(3))
    assert_params_close(suite_2[0]["torch_ddp"], suite_2[1]["torch_ddp"], exact=True)
