"""The rehearsal against something real, and seeded defects the rehearsal must catch.

Real: every layout of ``CASES`` trains 2 steps on gloo ranks with ``metrics.comm_ledger=true`` (one
launch per world size, ``tests/parity.py``'s ``GroupedRuns``); the same config is rehearsed as each
rank under the fake process group (``trainer.rehearse.rehearse_rank``). Per rank, the rehearsal's
collectives (op, mesh axis, bytes and calls per step) and model-state bytes (parameters, gradients,
optimizer state) must equal the real run's ledger exactly, and the owner plans Muon and ZeRO-1
compute on the rehearsal path (derived from meshes and placements; no exchange happens under the
fake group) must equal the real run's: Muon's plan derived in the real run, and the plan from the
exchange the real run can still do (``all_gather_object`` of every rank's pieces), unit for unit.

Seeded defects (``python -m trainer.rehearse``, exit 1 because a checked term leaves 5%, not by a
crash): an FSDP unit never resharded, gradients all-reduced twice, a TP plan that leaves one
projection replicated.

Pipeline parallel (``pp``: 2 stages, 1F1B) matches exactly but for torch's first-step vote of the
schedule, which the rehearsal answers on the host (``trainer/rehearse_pp.py``): step 1 of the real run
has one more send and recv of an int32 per stage boundary (``_first_step_vote``), step 2 none. Expert
parallel (``ep``: the tiny MoE, 8 experts top-2, ep=2 inside dp_shard=2) routes balanced in the real
run as in the rehearsal (``_route_balanced``), so its all_to_all bytes are fixed and match exactly.

New layouts join the checks through ``CASES``.
"""

from __future__ import annotations

from typing import Any, Optional

import pytest

from tests.configs import tiny_config
from tests.parity import Case, GroupedRuns
from trainer import rehearse

pytestmark = pytest.mark.slow

REAL = ("metrics.comm_ledger=true", "training.steps=2", "checkpoint.enable=false")
SMALL = ("model.n_layers=2",)  # two microbatches per step in every case (DDP's no_sync one included)
DDP = (*SMALL, "parallelism.dp_replicate=2", "parallelism.dp_shard=1")
ZERO1 = (*DDP, "parallelism.ddp.sharded_optimizer=true")
TP = (*SMALL, "parallelism.tp=2", "parallelism.dp_shard=1", "training.global_batch_size=4")
MUON = ("optimizer=muon",)
PP = (*SMALL, "parallelism.pp=2", "parallelism.dp_shard=1")  # 1F1B, a block per stage, 4 microbatches
MOE = ("model=moe_debug", "model.moe_hidden_dim=64")  # the tiny run's shape, 8 experts top-2
EP = (*MOE, *SMALL, "parallelism.ep=2", "parallelism.dp_shard=2")  # 4 experts per rank, dense FSDP x 2
# name -> (world size, overrides of the tiny run); each is rehearsed as every one of its ranks
CASES: dict[str, tuple[int, tuple[str, ...]]] = {
    "fsdp": (2, (*SMALL, "parallelism.dp_shard=2")),
    "tp": (2, TP),
    "ddp": (2, DDP),
    "zero1": (2, ZERO1),
    "muon_fsdp": (2, (*MUON, *SMALL, "parallelism.dp_shard=2")),
    "muon_tp": (2, (*MUON, *TP)),  # row-wise pieces: positions that are not one range
    "muon_ddp": (2, (*MUON, *DDP)),
    "muon_zero1": (2, (*MUON, *ZERO1)),
    "pp": (2, PP),
    "ep": (2, EP),
}


# -- the plans of the optimizers, as comparable values ---------------------------------------------


def _muon_of(optimizer: Any) -> Optional[Any]:
    from trainer.optim.muon import Muon

    return optimizer if isinstance(optimizer, Muon) else None


def _positions(pos: Any) -> Any:
    """A slice as it is; an index by its length (a rehearsal's are fake: their values follow from the
    piece, which its signature names exactly)."""
    return pos if isinstance(pos, slice) else ("index", pos.numel())


def _muon_summary(plan: Any) -> dict[str, Any]:
    """Everything a Muon plan decides: each unit's owner, holders (by piece), element counts and
    primaries; this rank's pieces (where they sit locally and in their units, whether it is their
    primary); and, as an owner, where each piece it receives sits in its unit."""
    return {
        "units": [(u.key, u.owner, u.holders, u.counts, u.primaries) for u in plan.units],
        "flops_per_rank": plan.flops_per_rank,
        "local": [
            (lp.name, lp.signature, lp.primary, [(u, _positions(a), _positions(b)) for u, a, b in lp.units])
            for lp in plan.local
        ],
        "positions": {key: _positions(pos) for key, pos in plan.positions.items()},
    }


def _owner_plans(optimizer: Any) -> dict[str, Any]:
    """ZeRO-1's owner of every parameter, and Muon's plan (derived; the run's own)."""
    from parallelisms.sharded_optimizer import ShardedOptimizer

    out: dict[str, Any] = {}
    if isinstance(optimizer, ShardedOptimizer):
        count = sum(len(g["params"]) for g in optimizer.param_groups)
        out["zero1_owners"] = [optimizer.owner_of(i) for i in range(count)]
    muon = _muon_of(optimizer)
    if muon is not None:
        out["muon"] = _muon_summary(muon.plan())
    return out


def _route_balanced(trainer: Any) -> None:
    """The real run's MoE layers route as the rehearsal's do (``MoE.balanced_routing``: copy j of a
    forward's token copies to expert j mod E). Routed by scores, the expert-parallel all_to_all
    bytes would follow the data; balanced, they are fixed, and equal to the rehearsal's exactly. The
    routing is a real code path (host split sizes instead of a read of the exchanged counts); the
    counts' all_to_all, the dispatch and combine, and the load balancer's all_reduce all run."""
    if trainer.spec.moe_layers is None:
        return
    for part in trainer.model_parts:
        for _, moe in trainer.spec.moe_layers(part):
            moe.balanced_routing = True


def observe_plans(trainer: Any) -> dict[str, Any]:
    """Case setup, in every real rank before training: MoE layers set to route balanced
    (``_route_balanced``), the owner plans, and Muon's plan from the exchange of every rank's pieces
    (a collective: every rank builds it here)."""
    from trainer.optim.muon_plan import _Plan

    _route_balanced(trainer)
    out = _owner_plans(trainer.optimizer)
    muon = _muon_of(trainer.optimizer)
    if muon is not None:
        named = [(muon._names[id(p)], p) for g in muon.param_groups if g["use_muon"] for p in g["params"]]
        out["muon_exchanged"] = _muon_summary(_Plan(named, muon.process_group, exchange=True))
    return out


# -- real runs and their rehearsals --------------------------------------------------------------


def _collectives(counts: dict[str, Any]) -> dict[tuple[str, str], tuple[float, float]]:
    """(op, axis) -> (calls, bytes) per step of one rank's ledger entry."""
    return {
        (op, axis): (v["calls"], v["bytes"])
        for op, axes in counts.items()
        if isinstance(axes, dict) and op != "model_state"
        for axis, v in axes.items()
    }


def _first_step_vote(name: str, tmp: str) -> dict[int, dict[tuple[str, str], tuple[float, float]]]:
    """rank -> what torch's first-step vote of a pipeline schedule adds to the real run's step 1 (the
    rehearsal answers it on the host, ``trainer.rehearse_pp.answer_schedule_vote``, and it is not in
    the plan): the static/dynamic vote travels forward along the stages and the product back, an
    int32 each way over every stage boundary, so a rank sends and receives one per neighbouring stage.
    One stage per rank (GPipe / 1F1B; ``pp`` outermost in the mesh); nothing without pipeline
    parallelism or with a torch whose schedules hold no vote."""
    from torch.distributed.pipelining.schedules import _PipelineSchedule

    world, overrides = CASES[name]
    par = tiny_config(tmp, *overrides).parallelism
    if par.pp == 1 or not hasattr(_PipelineSchedule, "_warmup_p2p"):
        return {rank: {} for rank in range(world)}
    assert par.pp_schedule in ("GPipe", "1F1B"), f"{name}: the vote of {par.pp_schedule} is not modelled here"
    votes = {}
    for rank in range(world):
        stage = rank // (world // par.pp)
        boundaries = float((stage > 0) + (stage < par.pp - 1))
        votes[rank] = {
            ("send", "pp"): (boundaries, 4 * boundaries),
            ("recv", "pp"): (boundaries, 4 * boundaries),
        }
    return votes


def _plus(
    a: dict[tuple[str, str], tuple[float, float]], b: dict[tuple[str, str], tuple[float, float]]
) -> dict[tuple[str, str], tuple[float, float]]:
    """(calls, bytes) of ``a`` and ``b`` added per (op, axis)."""
    out = dict(a)
    for key, (calls, size) in b.items():
        have = out.get(key, (0.0, 0.0))
        out[key] = (have[0] + calls, have[1] + size)
    return out


@pytest.fixture(scope="module")
def real(tmp_path_factory: pytest.TempPathFactory) -> GroupedRuns:
    tmp = tmp_path_factory.mktemp("real")
    return GroupedRuns(
        {
            name: Case(
                world, tiny_config(str(tmp / name), *REAL, *overrides), setup=observe_plans, params=False
            )
            for name, (world, overrides) in CASES.items()
        }
    )


def _rehearse(name: str, rank: int, tmp: str) -> tuple[dict[str, Any], dict[str, float], dict[str, Any]]:
    """(collectives per step, model-state bytes, owner plans) of ``rank`` rehearsed."""
    from trainer.planner.cluster import compose_cluster
    from trainer.planner.plan import build_plan

    world, overrides = CASES[name]
    cfg = tiny_config(tmp, *overrides, *rehearse.REHEARSAL_OVERRIDES)
    seen: dict[str, Any] = {}

    def inspect(trainer: Any, counts: dict[str, object]) -> None:
        seen["counts"], seen["plans"] = counts, _owner_plans(trainer.optimizer)

    plan = build_plan(cfg, compose_cluster(["cluster=cpu"]), rank=rank)  # gloo, as the real run
    report = rehearse.rehearse_rank(cfg, world, rank, 1, plan, inspect=inspect)
    state = {r["what"]: r["rehearsed"] for r in report.rows if r["what"] in ("params", "grads", "optimizer")}
    return seen["counts"], state, seen["plans"]


@pytest.mark.parametrize("name", list(CASES))
def test_rehearsal_equals_the_real_run(name: str, real: GroupedRuns, tmp_path: Any) -> None:
    result = real.get(name)
    records = [r["comm"] for r in result["history"] if "comm" in r]
    assert [r["steps"] for r in records] == [1, 1], "a ledger record for each of the 2 steps"
    world = CASES[name][0]
    votes = _first_step_vote(name, str(tmp_path))
    for rank in range(world):
        counts, state, plans = _rehearse(name, rank, str(tmp_path))
        rehearsed = _collectives(counts)
        for step, record in enumerate(records, 1):
            measured = record["ranks"][str(rank)]
            expected = _plus(rehearsed, votes[rank]) if step == 1 else rehearsed
            assert expected == _collectives(measured), f"{name} rank {rank} step {step}"
            assert state == {k: float(v) for k, v in measured["model_state"].items()}, f"{name} rank {rank}"
        observed = result["observed"][rank]
        if "muon" in observed:
            assert observed["muon_exchanged"] == observed["muon"], f"{name}: derived != exchanged"
        assert plans == {k: v for k, v in observed.items() if k != "muon_exchanged"}, f"{name} rank {rank}"
    assert any(op in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all") for op, _ in rehearsed)


def test_pieces_are_what_distribute_tensor_leaves() -> None:
    """``shard_piece`` at a rank's coordinate is ``distribute_tensor``'s local piece, for every rank of
    a fake 8-rank mesh: plain and strided shards (FSDP over TP), uneven splits, 3-D stacks."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.placement_types import _StridedShard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from parallelisms.utils import local_positions, piece_of, piece_positions, rank_coordinates

    cases = [
        ((8, 6), (Shard(0), Replicate())),
        ((8, 6), (Shard(1), Shard(0))),
        ((7, 5), (Shard(0), Shard(0))),  # uneven: torch.chunk's split, one rank empty
        ((12, 6), (_StridedShard(0, split_factor=2), Shard(0))),  # FSDP over column-wise TP
        ((6, 10), (_StridedShard(1, split_factor=2), Shard(1))),
        ((3, 4, 6), (Shard(0), Shard(2))),  # an expert stack
    ]
    for rank in range(8):
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=8)
        try:
            root = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("a", "b", "c"))
            for mesh in (root["a", "c"], root["b", "c"]):
                assert rank_coordinates(mesh)[rank] == mesh.get_coordinate()
                for shape, placements in cases:
                    full = torch.arange(torch.Size(shape).numel(), dtype=torch.float32).view(shape)
                    local = distribute_tensor(full, mesh, placements, src_data_rank=None)
                    want, got = local_positions(local), piece_positions(piece_of(local), shape)
                    if isinstance(want, slice):
                        assert got == want, (rank, shape, placements)
                    else:
                        assert not isinstance(got, slice) and torch.equal(got, want), (
                            rank,
                            shape,
                            placements,
                        )
        finally:
            dist.destroy_process_group()


def test_muon_plans_expert_stacks_under_fake_tensors() -> None:
    """The plan of 3-D expert stacks (a unit per expert) under FakeTensorMode and a fake 4-rank
    group: host arithmetic only (no ``.tolist()`` of a fake tensor), every rank's pieces derived."""
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from trainer.optim.muon import Muon

    dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=4)
    try:
        mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("dp",))
        with FakeTensorMode(allow_non_fake_inputs=True):
            whole = nn.Parameter(
                distribute_tensor(torch.empty(8, 6, 4), mesh, [Shard(0)], src_data_rank=None)
            )
            rows = nn.Parameter(distribute_tensor(torch.empty(3, 8, 4), mesh, [Shard(1)], src_data_rank=None))
            group = {"params": [whole, rows], "names": ["whole", "rows"], "use_muon": True}
            plan = Muon([group], dist.group.WORLD, symmetric=True).plan()
    finally:
        dist.destroy_process_group()
    units = {u.key: u for u in plan.units}
    assert len(units) == 8 + 3
    for e in range(8):  # two whole experts per rank
        assert sorted(units[("whole", e)].holders) == [e // 2] and units[("whole", e)].owner == e // 2
    for e in range(3):  # every rank holds 2 of each expert's 8 rows
        assert sorted(units[("rows", e)].holders) == [0, 1, 2, 3]
        assert sorted(units[("rows", e)].counts.values()) == [8] * 4
    assert [u for u, _, _ in next(lp for lp in plan.local if lp.name == "whole").units] == [2, 3]


# -- seeded defects: the comparison with the planner fails (exit 1) -------------------------------


def _fails_by_comparison(args: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    rc = rehearse.main([*args, "--ranks=0"])
    err = capsys.readouterr().err
    assert rc == 1 and "rehearsal and plan disagree by more than 5%" in err, err
    return err


def test_an_fsdp_unit_never_resharded_fails(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import parallelisms.fsdp as fsdp

    real = fsdp.fully_shard
    seeded = []

    def first_block_kept(module: Any, **kwargs: Any) -> Any:
        if kwargs.get("reshard_after_forward") is True and not seeded:  # the first resharded unit
            kwargs["reshard_after_forward"] = False
            seeded.append(module)
        return real(module, **kwargs)

    monkeypatch.setattr(fsdp, "fully_shard", first_block_kept)
    err = _fails_by_comparison(["+experiment=7b_hsdp", "model.n_layers=2"], capsys)
    assert seeded and "all_gather dp_shard_cp bytes" in err


def test_gradients_synced_twice_fail(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch.distributed as dist

    from parallelisms.ddp import BucketedDDP

    real = BucketedDDP._launch

    def launch_twice(self: BucketedDDP, bucket: Any) -> None:
        real(self, bucket)
        dist.all_reduce(self._pending[-1][2], group=self.process_group)  # the seeded second reduce

    monkeypatch.setattr(BucketedDDP, "_launch", launch_twice)
    err = _fails_by_comparison(["+experiment=38m_ddp", "model.n_layers=2"], capsys)
    assert "all_reduce dp_replicate bytes ratio 2.000" in err


def test_a_tp_plan_that_leaves_a_projection_replicated_fails(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The defect that runs: w2 keeps a whole weight on every tp rank (a Replicate DTensor that
    DTensor slices for the row-wise matmul), so nothing crashes; its parameters, gradients and the
    gradient's gather over tp are what the comparison sees."""
    from torch import nn
    from torch.distributed.tensor import Replicate, distribute_tensor
    from torch.distributed.tensor.parallel import RowwiseParallel

    import parallelisms.tensor_parallel as tp

    class ReplicatedRowwise(RowwiseParallel):  # type: ignore[misc]
        def _partition_linear_fn(self, name: str, module: nn.Module, device_mesh: Any) -> None:
            for key, param in list(module.named_parameters(recurse=False)):
                whole = distribute_tensor(param, device_mesh, [Replicate()], src_data_rank=None)
                module.register_parameter(key, nn.Parameter(whole, requires_grad=param.requires_grad))

    real = tp.tp_plan

    def one_replicated(*args: Any, **kwargs: Any) -> dict[str, Any]:
        plan = real(*args, **kwargs)
        style = plan["layers.0.feed_forward.w2"]
        plan["layers.0.feed_forward.w2"] = ReplicatedRowwise(
            input_layouts=style.input_layouts[0], output_layouts=style.output_layouts[0]
        )
        return plan

    monkeypatch.setattr(tp, "tp_plan", one_replicated)
    err = _fails_by_comparison(
        ["+experiment=70b_tp_fsdp", "model.n_layers=1", "training.global_batch_size=8"], capsys
    )
    assert "rank 0 params ratio" in err and "rank 0 grads ratio" in err
