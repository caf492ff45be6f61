"""``training.float8`` under ``python -m trainer.rehearse``: FSDP's float8 all-gather is rehearsed (the
host read of torchao's precomputed scale answered, ``REPLACED``) and its payload agrees with the plan
byte for byte, below the same run's bf16 all-gather (``7b_fsdp`` cut to 2 blocks, one rank). MoE
experts in MXFP8 (``training.float8.experts``) rehearse in agreement with the plan's precision term
(``trainer/planner/low_precision.py``: padded token groups, bf16 grouped-GEMM outputs), with fp32 and
bf16 FSDP parameters (~4 s each on one CPU core)."""

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


# MoE experts in MXFP8 (moe_debug cut to 1 layer, FSDP x2 at the debug preset's world size): every
# expert's token group padded to 32 rows up to the static bound, the grouped GEMMs' outputs in bf16.
MX_EXPERTS = (
    "+experiment=debug",
    "model=moe_debug",
    "model.n_layers=1",
    "training.float8.enable=true",
    "training.float8.recipe=mxfp8",
    "training.float8.experts=true",
)


@pytest.mark.parametrize("param_dtype", ["float32", "bfloat16"])
def test_mxfp8_experts_rehearse_and_agree_with_the_plan(
    param_dtype: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """The padding rows' FLOPs and the padded, bf16 saved activations are in the plan: the rehearsal
    agrees on every checked term (measured before the term: FLOPs 1.055, activations 0.853)."""
    from models.spec import ExpertGroups
    from trainer.config import compose_config
    from trainer.planner.cluster import compose_cluster
    from trainer.planner.context import build_context
    from trainer.planner.low_precision import expert_padding_flops
    from trainer.planner.memory import block_layout, dtype_policy

    run = (*MX_EXPERTS, f"parallelism.fsdp.param_dtype={param_dtype}")
    assert rehearse.main([*run, "--ranks=0", "--json"]) == 0  # every checked term within 5% of the plan
    (rank,) = json.loads(capsys.readouterr().out)["ranks"]
    rows = {r["what"]: r for r in rank["rows"]}
    cfg = compose_config(*run, *rehearse.REHEARSAL_OVERRIDES)
    dims = rehearse._dims_at(cfg, rehearse.intended_world_size("debug"))
    c = build_context(cfg, compose_cluster([]), dims)
    stream = 2 if param_dtype == "bfloat16" else 4  # FSDP's bf16 parameters make the stream bf16
    assert block_layout(c, dtype_policy(c)).experts == ExpertGroups(32, 2, stream, c.micro_tokens, 1)
    padding = expert_padding_flops(c)
    flops, saved = rows["FLOPs executed"], rows["activations saved (end of forward)"]
    print(
        f"MXFP8 experts ({param_dtype} params): FLOPs {flops['ratio']:.3f}, of which padding planned "
        f"{padding:,.0f}; saved activations {saved['ratio']:.3f} of the plan"
    )
    # without the padding term the FLOPs would disagree (the padded rows are executed)
    assert flops["rehearsed"] - (flops["planned"] - padding) > rehearse.TOLERANCE / 2 * flops["planned"]
