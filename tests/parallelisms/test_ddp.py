"""BucketedDDP / apply_ddp on gloo ranks: broadcast, gradient parity, overlap, no_sync, compression.

Each world size is spawned once (spawning dominates the run time): a module-scoped fixture
runs one worker that performs every check's computation and returns tensors/numbers, and the
individual tests below assert on them, comparing against references computed here.
"""

from __future__ import annotations

import io
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.nn.parallel import DistributedDataParallel

from models.errors import ConfigError
from parallelisms.ddp import BucketedDDP, apply_ddp, finish_gradient_sync
from tests.dist import run_distributed

DIM = 32
NUM_LAYERS = 4
GLOBAL_BATCH = 16
TINY_BUCKET_MB = DIM * DIM * 4 / 2**20  # one Linear weight: a bucket per layer, so several buckets


def make_model(seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for _ in range(NUM_LAYERS):
        layers += [nn.Linear(DIM, DIM), nn.Tanh()]
    return nn.Sequential(*layers[:-1])


def make_batch(step: int = 0, batch: int = GLOBAL_BATCH) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(batch, DIM, generator=g), torch.randn(batch, DIM, generator=g)


def local_slice(t: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    n = t.shape[0] // world_size
    return t[rank * n : (rank + 1) * n]


def grads_of(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def params_of(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def reference_grads(step: int = 0) -> dict[str, torch.Tensor]:
    """One process, the whole global batch, mean loss."""
    model = make_model(seed=0)
    x, y = make_batch(step)
    F.mse_loss(model(x), y).backward()
    return {n.removeprefix("module."): g for n, g in grads_of(model).items()}


def as_bytes(obj: Any) -> bytes:
    """Serialise a worker result: tensors sent through the result queue as-is travel by shared-memory
    file descriptors, which are gone once the worker process has exited."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def from_bytes(data: bytes) -> Any:
    return torch.load(io.BytesIO(data), weights_only=False)


# ---------------------------------------------------------------- workers (module level: pickled)


def _grad_parity(rank: int, world_size: int, group: dist.ProcessGroup) -> dict[str, Any]:
    x, y = make_batch()
    xl, yl = local_slice(x, rank, world_size), local_slice(y, rank, world_size)
    ours = BucketedDDP(make_model(seed=0), group, bucket_mb=TINY_BUCKET_MB)
    F.mse_loss(ours(xl), yl).backward()
    ours.finish_gradient_sync()
    theirs = DistributedDataParallel(make_model(seed=0), process_group=group, bucket_cap_mb=TINY_BUCKET_MB)
    F.mse_loss(theirs(xl), yl).backward()
    return {
        "ours": grads_of(ours),
        "torch": {n.removeprefix("module."): g for n, g in grads_of(theirs).items()},
        "num_buckets": len(ours.bucket_sizes),
    }


def _suite_2(rank: int, world_size: int) -> bytes:
    out: dict[str, Any] = {}
    world = dist.group.WORLD

    # Differently initialised replicas become equal to the first rank's.
    out["broadcast"] = params_of(BucketedDDP(make_model(seed=100 + rank), world))

    out["parity"] = _grad_parity(rank, world_size, world)

    # Overlap: a tensor hook on layer 2's input fires once the later layers' gradients are done
    # but before the first layers' backward; record how many buckets were launched by then.
    ddp = BucketedDDP(make_model(seed=0), world, bucket_mb=TINY_BUCKET_MB)
    seen: list[int] = []

    def record_in_flight(module: nn.Module, args: tuple[torch.Tensor, ...]) -> None:
        args[0].register_hook(lambda grad: seen.append(ddp.num_pending_buckets))

    ddp.module[2].register_forward_pre_hook(record_in_flight)
    x, y = make_batch()
    F.mse_loss(ddp(local_slice(x, rank, world_size)), local_slice(y, rank, world_size)).backward()
    out["overlap"] = {
        "mid_backward": seen[0],
        "after_backward": ddp.num_pending_buckets,
        "num_buckets": len(ddp.bucket_sizes),
    }
    ddp.finish_gradient_sync()
    ddp.finish_gradient_sync()  # idempotent
    out["overlap"]["after_finish"] = ddp.num_pending_buckets

    # gloo has no AVG: SUM then 1/N must still give the mean.
    lin = BucketedDDP(nn.Linear(4, 4, bias=False), world)
    ((rank + 1) * lin.module.weight.sum()).backward()
    lin.finish_gradient_sync()
    out["mean_grad"] = lin.module.weight.grad.clone()
    lin = BucketedDDP(nn.Linear(4, 4, bias=False), world, grad_dtype=torch.float32)  # a no-op "compression"
    ((rank + 1) * lin.module.weight.sum()).backward()
    lin.finish_gradient_sync()
    out["mean_grad_fp32_wire"] = lin.module.weight.grad.clone()

    # no_sync: 3 microbatches, two accumulated locally, then one synced; count all_reduce calls.
    calls: list[str] = []
    real_all_reduce = dist.all_reduce

    def counting_all_reduce(*args: Any, **kwargs: Any) -> Any:
        calls.append("inside" if not ddp.require_backward_grad_sync else "outside")
        return real_all_reduce(*args, **kwargs)

    dist.all_reduce = counting_all_reduce
    try:
        ddp = BucketedDDP(make_model(seed=0), world, bucket_mb=TINY_BUCKET_MB)
        x, y = make_batch(step=1, batch=3 * GLOBAL_BATCH)
        micro = [
            (local_slice(xm, rank, world_size), local_slice(ym, rank, world_size))
            for xm, ym in zip(x.chunk(3), y.chunk(3))
        ]
        in_slots, rounds = [], []
        for _ in range(2):  # the second step after zero_grad(set_to_none=True), as the trainer does
            ddp.zero_grad(set_to_none=True)
            with ddp.no_sync():
                for xm, ym in micro[:2]:
                    (F.mse_loss(ddp(xm), ym) / 3).backward()
            # accumulated in the buckets' slots (one copy of the gradients), not in fresh tensors
            slots = {s.data_ptr() for b in ddp._buckets for s in b.slots}
            in_slots.append(all(p.grad.data_ptr() in slots for p in ddp.parameters()))
            xm, ym = micro[2]
            (F.mse_loss(ddp(xm), ym) / 3).backward()
            ddp.finish_gradient_sync()
            rounds.append(grads_of(ddp))
    finally:
        dist.all_reduce = real_all_reduce
    out["no_sync"] = {
        "grads": rounds[0],
        "second": rounds[1],
        "in_slots": in_slots,
        "inside": calls.count("inside"),
        "outside": calls.count("outside"),
        "num_buckets": len(ddp.bucket_sizes),
    }

    # bf16 on the wire.
    ddp = BucketedDDP(make_model(seed=0), world, bucket_mb=TINY_BUCKET_MB, grad_dtype=torch.bfloat16)
    x, y = make_batch()
    F.mse_loss(ddp(local_slice(x, rank, world_size)), local_slice(y, rank, world_size)).backward()
    ddp.finish_gradient_sync()
    out["bf16"] = grads_of(ddp)

    # Training: replicas stay bitwise equal (different data per rank, AdamW and SGD).
    for name, opt_cls in (("adamw", torch.optim.AdamW), ("sgd", torch.optim.SGD)):
        ddp = BucketedDDP(make_model(seed=rank), world, bucket_mb=TINY_BUCKET_MB)
        opt = opt_cls(ddp.parameters(), lr=1e-2)
        for step in range(5):
            x, y = make_batch(step)
            F.mse_loss(ddp(local_slice(x, rank, world_size)), local_slice(y, rank, world_size)).backward()
            finish_gradient_sync(ddp)
            opt.step()
            opt.zero_grad(set_to_none=(step % 2 == 0))  # exercise both grad-reset styles
        out[f"trained_{name}"] = params_of(ddp)

    # Unused parameter: no hang, grad stays None, used grads still averaged.
    model = nn.ModuleDict({"used": nn.Linear(4, 4), "unused": nn.Linear(4, 4)})
    ddp = BucketedDDP(model, world, bucket_mb=1e-6)
    ((rank + 1) * ddp.module["used"].weight.sum()).backward()
    ddp.finish_gradient_sync()
    out["unused"] = {
        "grad_none": ddp.module["unused"].weight.grad is None,
        "used_grad": ddp.module["used"].weight.grad.clone(),
    }

    # State dict without the wrapper prefix, both directions, plus torch DDP's prefixed keys.
    ddp = BucketedDDP(make_model(seed=3), world)
    plain = make_model(seed=4)
    keys_equal = list(ddp.state_dict()) == list(plain.state_dict())
    plain.load_state_dict(ddp.state_dict())
    loaded_into_plain = all(torch.equal(a, b) for a, b in zip(plain.parameters(), ddp.parameters()))
    other = make_model(seed=5)
    ddp.load_state_dict(other.state_dict())
    loaded_into_ddp = all(torch.equal(a, b) for a, b in zip(other.parameters(), ddp.parameters()))
    ddp.load_state_dict({"module." + k: v for k, v in plain.state_dict().items()})
    loaded_prefixed = all(torch.equal(a, b) for a, b in zip(plain.parameters(), ddp.parameters()))
    out["state_dict"] = {
        "keys_equal": keys_equal,
        "named_parameters": [n for n, _ in ddp.named_parameters()]
        == [n for n, _ in plain.named_parameters()],
        "loaded_into_plain": loaded_into_plain,
        "loaded_into_ddp": loaded_into_ddp,
        "loaded_prefixed": loaded_prefixed,
        "getattr_forwarded": getattr(ddp, "0") is ddp.module[0],
        "dcp_keys": list(get_model_state_dict(ddp)) == list(plain.state_dict()),
    }

    # apply_ddp: both implementations, and config errors raised before any collective.
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp_replicate",))
    errors = []
    for kwargs in ({"impl": "nope"}, {"bucket_mb": 0.0}, {"grad_dtype": torch.int32}):
        try:
            apply_ddp(make_model(seed=0), mesh, **kwargs)
        except ConfigError as e:
            errors.append(str(e))
    out["config_errors"] = errors
    results = {}
    for impl in ("custom", "torch"):
        model = apply_ddp(make_model(seed=rank), mesh, impl=impl, bucket_mb=TINY_BUCKET_MB)
        x, y = make_batch()
        F.mse_loss(model(local_slice(x, rank, world_size)), local_slice(y, rank, world_size)).backward()
        finish_gradient_sync(model)
        results[impl] = {n.removeprefix("module."): p.grad.clone() for n, p in model.named_parameters()}
    out["apply_ddp"] = results
    return as_bytes(out)


def _suite_4(rank: int, world_size: int) -> bytes:
    out: dict[str, Any] = {"parity": _grad_parity(rank, world_size, dist.group.WORLD)}
    # Two DDP groups {0,1} and {2,3}: the broadcast source is each group's first rank.
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("outer", "dp_replicate"))
    model = apply_ddp(make_model(seed=100 + rank), mesh["dp_replicate"], bucket_mb=TINY_BUCKET_MB)
    out["subgroup_init"] = params_of(model)
    x, y = make_batch()
    F.mse_loss(model(local_slice(x, rank, world_size)), local_slice(y, rank, world_size)).backward()
    finish_gradient_sync(model)
    out["subgroup_grads"] = grads_of(model)
    return as_bytes(out)


@pytest.fixture(scope="module")
def suite_2() -> list[dict[str, Any]]:
    return [from_bytes(r) for r in run_distributed(_suite_2, 2)]


@pytest.fixture(scope="module")
def suite_4() -> list[dict[str, Any]]:
    return [from_bytes(r) for r in run_distributed(_suite_4, 4)]


def assert_equal_dicts(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], **tol: float) -> None:
    assert list(a) == list(b)
    for name in a:
        if tol:
            torch.testing.assert_close(a[name], b[name], **tol, msg=lambda m, n=name: f"{n}: {m}")
        else:
            assert torch.equal(a[name], b[name]), name


# ---------------------------------------------------------------- tests


def test_broadcast_from_first_rank(suite_2: list[dict[str, Any]]) -> None:
    first = params_of(make_model(seed=100))
    for result in suite_2:
        assert_equal_dicts(result["broadcast"], first)
    assert not torch.equal(first["0.weight"], make_model(seed=101)[0].weight)  # the check is not vacuous


@pytest.mark.parametrize("world", [2, 4])
def test_grads_match_torch_ddp_and_single_process(
    world: int, suite_2: list[dict], suite_4: list[dict]
) -> None:
    results = suite_2 if world == 2 else suite_4
    reference = reference_grads()
    for result in results:
        parity = result["parity"]
        assert parity["num_buckets"] > 2
        assert_equal_dicts(parity["ours"], parity["torch"], rtol=0.0, atol=1e-7)
        assert_equal_dicts(parity["ours"], reference, rtol=1e-5, atol=1e-7)
    for result in results[1:]:  # every rank holds the same averaged gradient
        assert_equal_dicts(result["parity"]["ours"], results[0]["parity"]["ours"])


def test_allreduce_launched_during_backward(suite_2: list[dict[str, Any]]) -> None:
    for result in suite_2:
        overlap = result["overlap"]
        # Some buckets were already in flight while backward still had layers 0-1 to go ...
        assert 0 < overlap["mid_backward"] < overlap["num_buckets"]
        # ... and by the time backward returned every bucket had been launched by its hooks.
        assert overlap["after_backward"] == overlap["num_buckets"]
        assert overlap["after_finish"] == 0


def test_gloo_sum_is_divided_by_group_size(suite_2: list[dict[str, Any]]) -> None:
    for result in suite_2:
        assert torch.equal(result["mean_grad"], torch.full((4, 4), 1.5))
        assert torch.equal(result["mean_grad_fp32_wire"], torch.full((4, 4), 1.5))


def test_no_sync_accumulation_matches_big_batch(suite_2: list[dict[str, Any]]) -> None:
    model = make_model(seed=0)
    x, y = make_batch(step=1, batch=3 * GLOBAL_BATCH)
    # The 3 microbatches x 2 ranks partition the big batch; mean over microbatch means = global mean.
    F.mse_loss(model(x), y).backward()
    reference = grads_of(model)
    for result in suite_2:
        no_sync = result["no_sync"]
        assert no_sync["inside"] == 0
        assert no_sync["outside"] == 2 * no_sync["num_buckets"]  # two steps
        assert no_sync["in_slots"] == [True, True]
        for name, g in no_sync["grads"].items():  # the second step computes the same, bit for bit
            assert torch.equal(g, no_sync["second"][name]), name
        assert_equal_dicts(no_sync["grads"], reference, rtol=1e-5, atol=1e-7)


def test_bf16_compression_close_to_fp32(suite_2: list[dict[str, Any]]) -> None:
    for result in suite_2:
        exact = result["parity"]["ours"]
        compressed = result["bf16"]
        assert any(not torch.equal(compressed[n], exact[n]) for n in exact)  # really went through bf16
        assert_equal_dicts(compressed, exact, rtol=2e-2, atol=1e-4)


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_replicas_bitwise_equal_after_training(optimizer: str, suite_2: list[dict[str, Any]]) -> None:
    a, b = (result[f"trained_{optimizer}"] for result in suite_2)
    assert_equal_dicts(a, b)
    assert not torch.equal(a["0.weight"], make_model(seed=0)[0].weight)  # training moved the weights


def test_unused_parameter_does_not_hang(suite_2: list[dict[str, Any]]) -> None:
    for result in suite_2:
        assert result["unused"]["grad_none"]
        assert torch.equal(result["unused"]["used_grad"], torch.full((4, 4), 1.5))


def test_state_dict_has_no_wrapper_prefix(suite_2: list[dict[str, Any]]) -> None:
    assert all(suite_2[0]["state_dict"].values()), suite_2[0]["state_dict"]


def test_apply_ddp(suite_2: list[dict[str, Any]]) -> None:
    errors = suite_2[0]["config_errors"]
    assert len(errors) == 3 and "impl" in errors[0] and "bucket_mb" in errors[1]
    for result in suite_2:
        custom, torch_impl = result["apply_ddp"]["custom"], result["apply_ddp"]["torch"]
        assert_equal_dicts(custom, torch_impl, rtol=0.0, atol=1e-7)
    assert_equal_dicts(suite_2[0]["apply_ddp"]["custom"], suite_2[1]["apply_ddp"]["custom"])


def test_subgroup_broadcasts_from_group_first_rank(suite_4: list[dict[str, Any]]) -> None:
    init = {r: params_of(make_model(seed=100 + r)) for r in (0, 2)}
    for rank, result in enumerate(suite_4):
        assert_equal_dicts(result["subgroup_init"], init[0 if rank < 2 else 2])
    # Each group averages only its own pair of ranks.
    assert_equal_dicts(suite_4[0]["subgroup_grads"], suite_4[1]["subgroup_grads"])
    assert_equal_dicts(suite_4[2]["subgroup_grads"], suite_4[3]["subgroup_grads"])
    assert not torch.equal(suite_4[0]["subgroup_grads"]["0.weight"], suite_4[2]["subgroup_grads"]["0.weight"])
