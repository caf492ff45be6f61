"""``python -m trainer.rehearse`` on the expert-parallel presets: the MoE layers route balanced (the
rehearsal's answer to the split sizes fake tensors cannot give), the all_to_all of the token dispatch
and combine land in the ledger on the ``ep`` axis, and every term equals the planner's.

To keep each test within ~20 s on one core, the 30B and 671B presets are rehearsed with fewer blocks
(``model.n_layers``) and deepseek_v3_ep_pp with its pipeline folded (``parallelism.pp=1`` at 128 ranks,
one microbatch: its expert-parallel layout, ep=64 inside dp_shard=128, unchanged); the planner plans the
same overrides, so the terms stay comparable at the real shapes per block and the real degrees.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from trainer import rehearse

# The experts' terms: their parameters sharded by ep and FSDP over dp_shard / ep, and their traffic.
EXPERT_ROWS = (
    "params",
    "grads",
    "optimizer",
    "all_to_all ep bytes",
    "all_to_all ep calls",
    "all_gather dp_shard_mod_ep bytes",
    "reduce_scatter dp_shard_mod_ep bytes",
    "all_gather dp_shard_cp bytes",
    "reduce_scatter dp_shard_cp bytes",
)


def _run(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, dict[str, Any]]:
    rc = rehearse.main([*args, "--json"])
    out = capsys.readouterr().out
    return rc, json.loads(out) if out.strip().startswith("{") else {}


def _rows(report: dict[str, Any], index: int = 0) -> dict[str, dict[str, Any]]:
    return {r["what"]: r for r in report["ranks"][index]["rows"]}


def _failing(report: dict[str, Any]) -> dict[str, float]:
    return {
        r["what"]: r["ratio"]
        for rank in report["ranks"]
        for r in rank["rows"]
        if r["checked"] and abs(r["ratio"] - 1) > rehearse.TOLERANCE
    }


def test_moe_debug_ep_agrees_with_the_plan_at_its_world_size(capsys: pytest.CaptureFixture[str]) -> None:
    rc, report = _run(["+experiment=moe_debug_ep"], capsys)
    assert rc == 0, _failing(report)
    assert [r["rank"] for r in report["ranks"]] == [0, 3]
    assert all(r["world_size"] == rehearse.intended_world_size("moe_debug_ep") == 4 for r in report["ranks"])
    for index in (0, 1):
        rows = _rows(report, index)
        for what in EXPERT_ROWS:  # under balanced routing the planner's expectation is exact
            assert rows[what]["ratio"] == pytest.approx(1.0, abs=1e-4), what
        # 4 MoE layers x (dispatch + combine, forward + backward, + the count exchange)
        assert rows["all_to_all ep calls"]["rehearsed"] == 4 * 5


def test_qwen3_30b_a3b_ep_agrees_term_by_term_on_its_default_ranks(
    capsys: pytest.CaptureFixture[str],
) -> None:
    rc, report = _run(["+experiment=qwen3_30b_a3b_ep", "model.n_layers=2"], capsys)
    assert rc == 0, _failing(report)
    assert [r["rank"] for r in report["ranks"]] == [0, 31]
    assert all(r["world_size"] == 32 for r in report["ranks"])
    rows = _rows(report)
    for what in EXPERT_ROWS:
        assert rows[what]["ratio"] == pytest.approx(1.0, abs=1e-4), what
    # per MoE layer and microbatch: 8192 tokens x top-8 copies of 2048 bf16 numbers, dispatch and
    # combine, forward twice (full AC) and backward once, plus two exchanges of the 128 int64 counts
    copies = 2 * 4096 * 8 * 2048 * 2
    assert rows["all_to_all ep bytes"]["rehearsed"] == 2 * (6 * copies + 2 * 128 * 8)
    # the load balancer's all_reduce of (E + 2) fp32 statistics per MoE layer runs in the step
    assert rows["all_reduce dp_shard_cp bytes"]["rehearsed"] >= 2 * (128 + 2) * 4


def test_deepseek_v3_expert_parallel_part_agrees(capsys: pytest.CaptureFixture[str]) -> None:
    rc, report = _run(
        [
            "+experiment=deepseek_v3_ep_pp",
            "parallelism.pp=1",  # the pipeline is another slice's; the ep=64 layout is the preset's
            "--world=128",
            "model.n_layers=4",  # three dense blocks and one MoE block
            "training.global_batch_size=128",
            "--ranks=0",
        ],
        capsys,
    )
    assert rc == 0, _failing(report)
    rows = _rows(report)
    for what in (
        "all_to_all ep bytes",
        "all_gather dp_shard_mod_ep bytes",
        "reduce_scatter dp_shard_mod_ep bytes",
    ):
        assert rows[what]["ratio"] == pytest.approx(1.0, abs=1e-6), what
    # the gathered experts (an FSDP unit without submodules) are parameters, not saved activations
    assert rows["activations saved (end of forward)"]["ratio"] == pytest.approx(1.0, abs=1e-3)


@pytest.mark.parametrize(
    "model",
    [
        ["model=moe_debug", "model.n_layers=2"],
        ["model=qwen3_5_moe_debug"],  # a gated shared expert in each of its 4 blocks
        ["model=deepseek_v3_debug", "model.n_layers=2"],  # a dense MLA block, then an MoE one
    ],
    ids=["moe_debug", "qwen3_5_moe_debug", "deepseek_v3_debug"],
)
def test_moe_under_tensor_parallel_agrees(model: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    """The MoE layer runs replicated inside the tp group (``models/moe/model.py``'s ``TP_PLAN``): every
    tp rank runs the router, the shared experts and the routed experts on all the gathered tokens, and
    MLA's replicated down-projections on all its tokens, and saves their whole tensors. Rehearsed /
    planned at tp=2 (rank 0) before the planner counted them so, FLOPs executed: 1.487, 1.553, 1.225;
    saved activations 0.999, 1.085, 1.025; after: FLOPs 0.999, 0.991, 1.004, saved 0.999, 0.998, 0.999."""
    args = ["+experiment=debug", *model, "parallelism.tp=2", "parallelism.dp_shard=1", "--ranks=0"]
    rc, report = _run(args, capsys)
    assert rc == 0, _failing(report)
    rows = _rows(report)
    for what in ("FLOPs executed", "activations saved (end of forward)"):
        assert rows[what]["checked"], what
        assert rows[what]["ratio"] == pytest.approx(1.0, abs=rehearse.TOLERANCE), what
    # the predicted compute time counts the repeated work too (the MFU-convention FLOPs do not)
    from trainer.config import compose_config
    from trainer.planner.cluster import compose_cluster
    from trainer.planner.context import build_context
    from trainer.planner.plan import compute_seconds

    cfg = compose_config(*args[:-1], *rehearse.REHEARSAL_OVERRIDES)
    c = build_context(cfg, compose_cluster([]), rehearse._dims_at(cfg, rehearse.intended_world_size("debug")))
    comp = compute_seconds(c)
    timed = comp["compute_s"] * c.cluster.peak_tflops * 1e12 * c.cluster.mfu
    assert timed == pytest.approx(rows["FLOPs executed"]["rehearsed"], rel=0.1), (timed, comp)
    assert comp["flops_per_rank"] < 0.9 * timed  # the useful work: the convention's


def test_the_balanced_routing_is_reported(capsys: pytest.CaptureFixture[str]) -> None:
    rc, report = _run(["+experiment=moe_debug_ep", "model.n_layers=1", "--ranks=0"], capsys)
    assert rc == 0
    assert any("balanced" in line and "expert j mod E" in line for line in report["replaced"])
    rc = rehearse.main(["+experiment=moe_debug_ep", "model.n_layers=1", "--ranks=0"])
    assert rc == 0
    assert "MoE routing: balanced" in capsys.readouterr().out


def test_tokens_dispatched_in_fp32_fail_the_comparison(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from parallelisms.expert_parallel import AllToAllDispatcher

    real = AllToAllDispatcher.__call__

    def upcast(
        self: AllToAllDispatcher, rows: Any, counts: Any, experts: Any, host_counts: Any = None
    ) -> Any:
        # the seeded defect: the bf16 token copies travel as fp32 (the forward all_to_all doubles)
        return real(self, rows.float(), counts, experts, host_counts).to(rows.dtype)

    monkeypatch.setattr(AllToAllDispatcher, "__call__", upcast)
    rc = rehearse.main(["+experiment=qwen3_30b_a3b_ep", "model.n_layers=1", "--ranks=0"])
    err = capsys.readouterr().err
    assert rc == 1
    assert "all_to_all ep bytes ratio 1.5" in err
