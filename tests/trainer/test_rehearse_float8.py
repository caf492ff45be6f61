"""``training.float8`` under ``python -m trainer.rehearse``: FSDP's float8 all-gather is rehearsed (the
host read of torchao's precomputed scale answered, ``REPLACED``) and its payload agrees with the plan
byte for byte, below the same run's bf16 all-gather (``7b_fsdp`` cut to 2 blocks, one rank)."""

from __future__ import annotations

import json

import pytest

from trainer import rehearse

pytest.importorskip("torchao")

RUN = ("+experiment=7b_fsdp", "model.n_layers=2", "training.float8.enable=true")


def test_float8_all_gather_rehearses_and_agrees_with_the_plan(capsys: pytest.CaptureFixture[str]) -> None:
    from trainer.config import compose_config
    from trainer.planner.cluster import compose_cluster
    from trainer.planner.plan import build_plan

    args = [*RUN, "training.float8.fsdp_float8_all_gather=true", "--ranks=0", "--json"]
    assert rehearse.main(args) == 0  # every checked term within 5% of the plan
    (rank,) = json.loads(capsys.readouterr().out)["ranks"]
    rows = {r["what"]: r for r in rank["rows"]}
    gathered = rows["all_gather dp_shard_cp bytes"]
    cfg = compose_config(*RUN, *rehearse.REHEARSAL_OVERRIDES)
    world = rehearse.intended_world_size("7b_fsdp")
    plan = build_plan(cfg, compose_cluster([]), "7b_fsdp", dims=rehearse._dims_at(cfg, world), rank=0)
    bf16 = sum(x.logical_bytes for x in plan.pp_rank_collectives[0] if x.op == "all_gather")
    print(
        f"float8 all-gather: rehearsed {gathered['rehearsed']:,.0f} B, planned {gathered['planned']:,.0f} B; "
        f"without float8 all-gather planned {bf16:,.0f} B"
    )
    assert gathered["rehearsed"] == gathered["planned"], gathered
    assert gathered["planned"] < 0.75 * bf16, (gathered, bf16)  # the blocks' weights at 1 byte, not 2
