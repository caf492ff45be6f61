"""µP (``model.mup``) under parallel layouts: the AdamW groups with their per-group LRs come from the
model's parameter names (``ModelSpec.lr_scale``), so FSDP x2 and ZeRO-1 x2 must train the same model as
one process -- per-step losses and pre-clip grad norms within ``PARITY_RTOL``, final weights within
``PARAM_ATOL`` (``tests/parity.py``), over 4 steps of the tiny run with µP on (base width 32, so the
blocks' matrices take lr / 2), clipping off."""

from __future__ import annotations

import pytest

from tests.configs import NO_CLIP, PARITY_STEPS, tiny_config
from tests.parity import Case, assert_parallel_run, gather_cases

pytestmark = pytest.mark.slow

MUP = ("model.mup.enable=true", "model.mup.base_dim=32", "model.mup.output_mult=2.0", PARITY_STEPS, NO_CLIP)
LAYOUTS = {
    "fsdp_x2": ("parallelism.dp_shard=2",),
    "zero1_x2": (
        "parallelism.dp_replicate=2",
        "parallelism.dp_shard=1",
        "parallelism.ddp.sharded_optimizer=true",
    ),
}


def group_lrs(trainer) -> dict:  # noqa: ANN001 -- a Case setup (pickled: module level)
    """The peak LR of each of the Trainer's optimizer groups, as built."""
    return {"lrs": sorted({g["initial_lr"] for g in trainer.optimizer.param_groups})}


def test_mup_fsdp_and_zero1_match_one_process(tmp_path) -> None:
    ref = gather_cases({"one": Case(1, tiny_config(str(tmp_path / "one"), *MUP), setup=group_lrs)}, world=1)
    ref = ref["one"]
    runs = gather_cases(
        {
            name: Case(2, tiny_config(str(tmp_path / name), *MUP, *extra), setup=group_lrs)
            for name, extra in LAYOUTS.items()
        },
        world=2,
    )
    # optimizer.lr=3e-3 (the tiny run's): the blocks' matrices at 3e-3 * 32/64, the rest at 3e-3.
    for run in (ref, *runs.values()):
        assert all(o == {"lrs": [1.5e-3, 3e-3]} for o in run["observed"]), run["observed"]
    for name in LAYOUTS:
        assert_parallel_run(ref, runs[name], label=f"µP {name}")
