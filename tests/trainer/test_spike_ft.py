"""Loss-spike skipping under fault tolerance (``training.spike`` with ``FT_GROUPS=2 ./launch.sh``).

The decision is taken after the replica groups' loss is summed and their gradients averaged, so every
group skips the same step: a NaN forward on rank 0 of each group at step 5 (the test hook
``MESHWRIGHT_TEST_NAN_AT``, once) is skipped by both, the batch is consumed, and the run goes on
exactly as plain DDP x2 with the same injection and the same rule -- the same steps skipped, losses and
gradient norms within 1e-6, the groups' replicas bitwise equal at every step, the same final weights.
"""

from __future__ import annotations

import json
import os

import pytest

from tests.configs import TINY, tiny_config
from tests.ft_harness import FT_FAST, FTJob, compare_with_ddp, weight_error
from tests.parity import Case, gather_cases
from trainer.resilience.fault_tolerance import group_folder
from trainer.resilience.guards import NAN_ENV

pytest.importorskip("torchft")

FT = "parallelism.fault_tolerance"
OWN = ("training.steps=7", "checkpoint.enable=true", "checkpoint.interval=100", "training.spike.enable=true")
POISONED_STEP = 5


@pytest.mark.slow
def test_every_group_skips_the_step_plain_ddp_skips(tmp_path, monkeypatch) -> None:
    injection = f"0@{POISONED_STEP}"  # rank 0 of each group (FT), rank 0 of the job (DDP)
    job = FTJob(
        str(tmp_path / "ft"), (*TINY, *OWN, *FT_FAST, f"{FT}.min_replicas=2"), env={NAN_ENV: injection}
    )
    ref_dump = str(tmp_path / "ddp")
    try:
        monkeypatch.setenv(NAN_ENV, injection)
        gather_cases(
            {"ddp": Case(2, tiny_config(ref_dump, *OWN, "parallelism.dp_replicate=2"), params=False)}, world=2
        )
    except BaseException:
        job.stop()
        raise
    try:
        assert job.wait(timeout=600) == 0, job.log()
    finally:
        job.stop()

    def figures(path: str) -> tuple[list[dict], list[int]]:
        with open(path, encoding="utf-8") as f:
            records = [json.loads(line) for line in f if line.strip()]
        return [r for r in records if "loss" in r], [r["step"] for r in records if r.get("skipped")]

    expected, ddp_skipped = figures(os.path.join(ref_dump, "metrics.jsonl"))
    assert ddp_skipped == [POISONED_STEP]
    assert [r["step"] for r in expected] == list(range(1, 8))
    groups = []
    for g in range(2):
        records, skipped = figures(os.path.join(group_folder(job.dump, g), "metrics.jsonl"))
        assert skipped == [POISONED_STEP], (g, skipped)
        groups.append(records)
    worst = compare_with_ddp(groups, expected)
    weight_err = weight_error(
        os.path.join(job.dump, "checkpoints", "step-7"), os.path.join(ref_dump, "checkpoints", "step-7")
    )
    print(
        f"FT 2 groups vs DDP x2, step {POISONED_STEP} skipped by both: loss/grad-norm {worst:.2e}, "
        f"weights {weight_err:.2e}"
    )
    assert worst <= 1e-6 and weight_err <= 1e-6
