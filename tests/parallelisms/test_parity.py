"""Every data-parallel layout trains the same model as one process (fp32, CPU, gloo).

Each layout runs the real Trainer for 8 optimizer steps on the same global batches; its
per-step losses and pre-clip gradient norms must match the single-process run's to relative
1e-5 and its final parameters to 1e-5 absolute (``tests/parity.py``). The arithmetic order
of gradient reductions legitimately differs (all-reduce / reduce-scatter sum in another
order than one process's batched matmul) and Adam carries those ~1e-7 differences forward.

Every strategy has a case with clipping off (``training.grad_clip=0``, compared with the
unclipped reference); with clipping on, every step of the tiny run is clipped. The probes at
the end prove the check bites: custom DDP with its 1/N removed, which trains to the same
losses, and one rank's gradients doubled must both fail it.

To keep the suite fast on 2 cores, all cases of one world size run in one spawned group.
"""

from __future__ import annotations

import pytest
import torch

from tests.configs import NO_CLIP, tiny_config
from tests.parity import (
    Case,
    GroupedRuns,
    assert_parallel_run,
    assert_params_close,
    assert_parity,
    step_metrics,
)

pytestmark = pytest.mark.slow

DDP = ["parallelism.dp_replicate=2", "parallelism.dp_shard=1"]
DDP4 = ["parallelism.dp_replicate=4", "parallelism.dp_shard=1"]
ZERO1 = "parallelism.ddp.sharded_optimizer=true"
LAYOUTS = {  # name -> (world, overrides)
    "custom_ddp_x2": (2, DDP),
    "custom_ddp_x4_noclip": (4, [*DDP4, NO_CLIP]),
    "custom_ddp_zero1_x2": (2, [*DDP, ZERO1]),
    "custom_ddp_zero1_x4_noclip": (4, [*DDP4, ZERO1, NO_CLIP]),
    "torch_ddp_x2": (2, [*DDP, "parallelism.ddp.impl=torch"]),
    "torch_ddp_x2_noclip": (2, [*DDP, "parallelism.ddp.impl=torch", NO_CLIP]),
    "fsdp_x2": (2, ["parallelism.dp_shard=2"]),
    "fsdp_x2_noclip": (2, ["parallelism.dp_shard=2", NO_CLIP]),
    "fsdp_x4": (4, ["parallelism.dp_shard=4"]),
    "fsdp_zero2_x2_noclip": (
        2,
        ["parallelism.dp_shard=2", "parallelism.fsdp.reshard_after_forward=false", NO_CLIP],
    ),
    "hsdp_2x2_noclip": (4, ["parallelism.dp_replicate=2", "parallelism.dp_shard=2", NO_CLIP]),
    "fsdp_ac_full_x2": (2, ["parallelism.dp_shard=2", "training.activation_checkpoint=full"]),
    "fsdp_ac_selective_op_x2_noclip": (
        2,
        [
            "parallelism.dp_shard=2",
            "training.activation_checkpoint=selective",
            "training.ac_selective=op",
            NO_CLIP,
        ],
    ),
    # Pipeline parallel through the Trainer (every schedule is also covered at the stage level
    # in test_pipeline_parallel.py).
    "pp2_1f1b": (2, ["parallelism.pp=2", "parallelism.dp_shard=1"]),
    "pp2_zbv_noclip": (
        2,
        [
            "parallelism.pp=2",
            "parallelism.dp_shard=1",
            "parallelism.pp_schedule=ZBVZeroBubble",
            "parallelism.pp_stages_per_rank=2",
            NO_CLIP,
        ],
    ),
    "pp2_x_fsdp2_noclip": (4, ["parallelism.pp=2", "parallelism.dp_shard=2", NO_CLIP]),
    "pp2_x_tp2": (4, ["parallelism.pp=2", "parallelism.dp_shard=1", "parallelism.tp=2"]),
}


# -- test-only probes: deliberately wrong gradient reductions (installed inside the worker) ----


def drop_ddp_mean(trainer) -> None:  # noqa: ANN001
    """Custom DDP sums instead of averaging: its gloo path pre-scales by 1/world_size only when
    world_size > 1, so claiming a world of 1 removes the 1/N (gradients become N x the mean)."""
    trainer.model.world_size = 1


def double_rank1_gradients(trainer) -> None:  # noqa: ANN001
    """Rank 1's local gradients are doubled before DDP averages them (a rank counting its loss twice)."""
    import torch.distributed as dist

    if dist.get_rank() == 1:
        for p in trainer.model.parameters():
            p.register_hook(lambda g: 2 * g)


PROBES = {  # name -> (overrides, setup)
    "probe_ddp_without_mean_x2": (DDP, drop_ddp_mean),
    "probe_rank1_grads_doubled_x2": (DDP, double_rank1_gradients),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> GroupedRuns:
    tmp = tmp_path_factory.mktemp("parity")
    cases = {name: Case(world, tiny_config(str(tmp / name), *ov)) for name, (world, ov) in LAYOUTS.items()}
    for name, (ov, setup) in PROBES.items():
        cases[name] = Case(2, tiny_config(str(tmp / name), *ov), setup=setup)
    return GroupedRuns(cases)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_matches_single_process(layout: str, runs: GroupedRuns, tiny_reference: dict) -> None:
    ref = tiny_reference["noclip" if NO_CLIP in LAYOUTS[layout][1] else "clip"]
    assert_parallel_run(ref, runs.get(layout), label=layout)


def test_single_process_is_deterministic(tiny_reference: dict) -> None:
    clip, again, noclip = (tiny_reference[k] for k in ("clip", "clip_again", "noclip"))
    assert step_metrics(again["history"]) == step_metrics(clip["history"])  # bitwise
    for name, t in clip["params"].items():
        assert torch.equal(t, again["params"][name]), name
    assert all(r["grad_norm"] > 1.0 for r in clip["history"])  # every step of the tiny run is clipped
    assert step_metrics(noclip["history"]) != step_metrics(clip["history"])


@pytest.mark.parametrize("probe", list(PROBES))
def test_mis_scaled_gradients_fail_the_parity_check(
    probe: str, runs: GroupedRuns, tiny_reference: dict
) -> None:
    ref, got = tiny_reference["clip"], runs.get(probe)
    losses_only = max(
        abs(a["loss"] - b["loss"]) / b["loss"] for a, b in zip(got["history"], ref["history"]) if "loss" in b
    )
    print(
        f"{probe}: max relative loss difference {losses_only:.2e} (a losses-only check would see only this)"
    )
    with pytest.raises(AssertionError, match=r"step 1 grad_norm: reference") as failure:
        assert_parity(ref["history"], got["history"], label=probe)
    print(f"{probe}: the parity check fails as it must:\n{failure.value}")
    if probe == "probe_rank1_grads_doubled_x2":  # the direction changed too: the weights differ
        with pytest.raises(AssertionError, match="differs from the reference"):
            assert_params_close(ref["params"], got["params"], label=probe)
