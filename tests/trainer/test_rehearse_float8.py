"""``training.float8`` under ``python -m trainer.rehearse``: FSDP's float8 all-gather is rehearsed (the
host read of torchao's precomputed scale answered, ``REPLACED``) and its payload agrees with the plan
byte for byte, below the same run's bf16 all-gather (``7b_fsdp`` cut to 2 blocks, one rank), also
with linears the TP plan replicates (deepseek_v3_debug at TP x2 x FSDP x2, whose peak agrees too). MoE
experts in MXFP8 (``training.float8.experts``) rehearse in agreement with the plan's precision term
(``trainer/planner/low_precision.py``: padded token groups, bf16 grouped-GEMM outputs), with fp32 and
bf16 FSDP parameters, the latter also under bf16 autocast. Float8 linears under bf16 autocast over fp32
weights save their input and weight as given, and the saved activations agree; emulated MXFP8 there is
refused (a real run fails). 1-6 s a test on one CPU core (10-30 s the file, by the load)."""

from __future__ import annotations

import json

import pytest
import torch

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


def test_float8_all_gather_of_tp_replicated_linears_agrees_with_the_plan(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """At tp=2 x dp_shard=2 some converted linears are replicated over tp (deepseek_v3_debug: MLA's
    ``wq_a`` / ``wkv_a`` in both blocks, the MoE block's shared experts): FSDP all-gathers them whole in
    float8, and the plan's float8 elements (``converted_weights``) count them whole, as the parameter
    table does. Rehearsed / planned all-gather bytes over dp_shard: 0.934 when every converted linear
    was divided by tp, now byte for byte (qwen3_5_moe_debug, 1 layer: 0.931 -> 1.000). Every checked
    term agrees, the peak included: 0.911 of the plan while the backward's instants held the gathered
    blocks at ``param_dtype``'s bytes (their float8 weights at one byte now, ``memory._gathered_blocks``)
    and the shared experts' casts beside the experts' gradients, made after them
    (``converted_backward_transient``'s ``experts_grad``); 0.982 now."""
    from parallelisms.float8 import float8_weight_names
    from trainer.config import compose_config
    from trainer.planner.cluster import compose_cluster
    from trainer.planner.context import build_context
    from trainer.planner.low_precision import converted_weights

    run = (
        "+experiment=debug",
        "model=deepseek_v3_debug",
        "model.n_layers=2",
        "parallelism.tp=2",
        "parallelism.dp_shard=2",
        "training.float8.enable=true",
        "training.float8.fsdp_float8_all_gather=true",
    )
    assert rehearse.main([*run, "--world=4", "--ranks=0", "--json"]) == 0  # every checked term within 5%
    (rank,) = json.loads(capsys.readouterr().out)["ranks"]
    rows = {r["what"]: r for r in rank["rows"]}
    gathered, peak = rows["all_gather dp_shard_cp bytes"], rows["peak: total"]
    assert gathered["checked"] and gathered["rehearsed"] == gathered["planned"], gathered
    assert peak["checked"] and abs(peak["ratio"] - 1) <= rehearse.TOLERANCE, peak
    # the case holds tp-replicated converted linears, each counted whole on a tp rank
    cfg = compose_config(*run, *rehearse.REHEARSAL_OVERRIDES)
    c = build_context(cfg, compose_cluster([]), rehearse._dims_at(cfg, 4))
    assert c.table.model is not None
    names = float8_weight_names(c.table.model, cfg.training.float8, c.spec)
    local = dict(zip(names, (elements for _, elements in converted_weights(c)), strict=True))
    params = dict(c.table.model.named_parameters())
    replicated = [n for n in names if any(k in n for k in (".wq_a.", ".wkv_a.", ".shared_experts."))]
    assert len(replicated) == 2 * 2 + 3, replicated
    assert all(local[n] == params[n].numel() for n in replicated), local


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


@pytest.mark.parametrize(
    ("param_dtype", "mixed_precision"), [("float32", "fp32"), ("bfloat16", "fp32"), ("bfloat16", "bf16")]
)
def test_mxfp8_experts_rehearse_and_agree_with_the_plan(
    param_dtype: str, mixed_precision: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """The padding rows' FLOPs and the padded, bf16 saved activations are in the plan: the rehearsal
    agrees on every checked term (measured before the term: FLOPs 1.055, activations 0.853), also
    under bf16 autocast over FSDP's bf16 parameters (emulated MXFP8 under autocast needs bf16 weights:
    :func:`test_mxfp8_under_autocast_needs_bf16_weights`)."""
    from models.spec import ExpertGroups
    from trainer.config import compose_config
    from trainer.planner.activations import block_layout, dtype_policy
    from trainer.planner.cluster import compose_cluster
    from trainer.planner.context import build_context
    from trainer.planner.low_precision import expert_padding_flops

    run = (
        *MX_EXPERTS,
        f"parallelism.fsdp.param_dtype={param_dtype}",
        f"training.mixed_precision={mixed_precision}",
    )
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
        f"MXFP8 experts ({param_dtype} params, {mixed_precision}): FLOPs {flops['ratio']:.3f}, of which "
        f"padding planned {padding:,.0f}; saved activations {saved['ratio']:.3f} of the plan"
    )
    # without the padding term the FLOPs would disagree (the padded rows are executed)
    assert flops["rehearsed"] - (flops["planned"] - padding) > rehearse.TOLERANCE / 2 * flops["planned"]


def test_mxfp8_under_autocast_needs_bf16_weights(capsys: pytest.CaptureFixture[str]) -> None:
    """Emulated MXFP8 (the CPU's, and any GPU below SM100) under bf16 autocast over fp32 weights fails in
    a real run (torchao's emulated matmul: SDPA's bf16 output x the fp32 ``wo`` weight), dense or with
    experts; the fake-tensor rehearsal did not notice (fake tensors' mm does not check dtypes) and
    measured a fiction (activations 1.192 / 0.835 of the plan). It is refused before any process group,
    and the rehearsal's matmuls check dtypes as the kernels do (``rehearse_trace.check_matmul_dtypes``)."""
    dense = (
        "+experiment=debug",
        "model.n_layers=1",
        "training.float8.enable=true",
        "training.float8.recipe=mxfp8",
    )
    for run in (dense, MX_EXPERTS):
        assert rehearse.main([*run, "training.mixed_precision=bf16", "--ranks=0"]) == 2
        err = capsys.readouterr().err
        assert "parallelism.fsdp.param_dtype=bfloat16" in err and "mixed_precision=bf16" in err, err
    # and the rehearsal's own matmuls now refuse unlike dtypes as the real kernels do
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker

    from trainer.rehearse_trace import mem_tracker

    with FakeTensorMode(), mem_tracker(MemTracker):
        x, weight = torch.empty(4, 32, dtype=torch.bfloat16), torch.empty(8, 32)
        assert torch.mm(x, weight.bfloat16().t()).dtype == torch.bfloat16
        with pytest.raises(RuntimeError, match="same dtype"):
            torch.mm(x, weight.t())


@pytest.mark.parametrize(
    ("recipe", "mixed_precision", "param_dtype"),
    [
        ("tensorwise", "bf16", "float32"),
        ("rowwise_with_gw_hp", "bf16", "float32"),
        ("rowwise", "fp32", "float32"),
        ("mxfp8", "fp32", "bfloat16"),
    ],
)
def test_float8_linears_peak_and_saved_agree_with_the_plan(
    recipe: str, mixed_precision: str, param_dtype: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Every checked term agrees, the peak included (debug cut to 1 layer, FSDP x2). The peak is in the
    last block's first linear backward, where torchao's casts of the output gradient, weight and input
    (fp32 scaled copies, float8 / MX bytes, emulated: dequantized fp32 operands) are live: the plan's
    ``converted_backward_transient`` (``trainer/planner/low_precision.py``), read off the trainer's own
    conversion on fake tensors. Without it the peak was 1.088 (tensorwise, bf16 autocast), 1.041
    (rowwise_with_gw_hp, bf16 autocast), 1.082 (rowwise, fp32) and 1.197 (MXFP8 over bf16 FSDP
    parameters) of the plan. Under bf16 autocast over fp32 weights a ``Float8Linear`` saves its fp32
    input as given (one tensor for the linears reading it) and its fp32 weight, no bf16 cast of either:
    the saved activations agree (0.904 of the plan before that term)."""
    from trainer.config import compose_config
    from trainer.planner.activations import dtype_policy, weight_copy_bytes
    from trainer.planner.cluster import compose_cluster
    from trainer.planner.context import build_context
    from trainer.planner.memory import _casts_transient

    run = (
        "+experiment=debug",
        "model.n_layers=1",
        "training.float8.enable=true",
        f"training.float8.recipe={recipe}",
        f"training.mixed_precision={mixed_precision}",
        f"parallelism.fsdp.param_dtype={param_dtype}",
    )
    assert rehearse.main([*run, "--ranks=0", "--json"]) == 0  # every checked term within 5% of the plan
    (rank,) = json.loads(capsys.readouterr().out)["ranks"]
    rows = {r["what"]: r for r in rank["rows"]}
    cfg = compose_config(*run, *rehearse.REHEARSAL_OVERRIDES)
    c = build_context(cfg, compose_cluster([]), rehearse._dims_at(cfg, rehearse.intended_world_size("debug")))
    casts = _casts_transient(c, 0)
    saved, peak = rows["activations saved (end of forward)"], rows["peak: total"]
    print(
        f"{recipe} ({mixed_precision}, {param_dtype} parameters): saved activations {saved['ratio']:.3f}, "
        f"peak {peak['ratio']:.3f} of the plan, of which the casts' temporaries {casts:,.0f} B"
    )
    assert peak["checked"] and abs(peak["ratio"] - 1) <= rehearse.TOLERANCE, peak
    # the term is needed: without it the rehearsed peak is well above the plan
    assert peak["rehearsed"] - (peak["planned"] - casts) > rehearse.TOLERANCE / 2 * peak["planned"]
    if mixed_precision == "bf16":  # autocast over fp32 weights: the converted linears cast nothing
        pol = dtype_policy(c)
        assert pol.cast_each and pol.as_given and weight_copy_bytes(c, 0) == 0.0


def test_moe_blocks_converted_attention_saves_its_input_as_given(capsys: pytest.CaptureFixture[str]) -> None:
    """moe_debug with float8 linears under bf16 autocast over fp32 weights: the router is never
    converted, so autocast's per-matmul casts stay in the plan, but each block's attention linears are
    all converted and save the attention norm's fp32 output once (``attention_inputs_as_given``): saved
    activations 0.976 of the plan before, 0.999 after. The peak (0.940) is FSDP's CUDA prefetch of the
    next block, planned for the default h100 cluster and not traced on the CPU (README)."""
    run = (
        "+experiment=debug",
        "model=moe_debug",
        "training.float8.enable=true",
        "training.mixed_precision=bf16",
    )
    rehearse.main([*run, "--ranks=0", "--json", "--report-only"])
    (rank,) = json.loads(capsys.readouterr().out)["ranks"]
    rows = {r["what"]: r for r in rank["rows"]}
    saved = rows["activations saved (end of forward)"]
    assert saved["checked"] and abs(saved["ratio"] - 1) <= 0.01, saved
    assert abs(rows["FLOPs executed"]["ratio"] - 1) <= rehearse.TOLERANCE, rows["FLOPs executed"]
