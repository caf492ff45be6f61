"""``python -m trainer.rehearse``: presets rehearsed at their intended world size under the fake
process group and FakeTensorMode, term by term against the planner.

To keep each test within ~20 s on two shared cores, the presets are rehearsed with fewer blocks
(``model.n_layers``) and, for 70b_tp_fsdp, one microbatch per step (``training.global_batch_size=8``);
the planner plans the same overrides, so every term is still compared like for like, at the real
world size, mesh, shapes per block and degrees.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from trainer import rehearse

SMALL_7B = ["+experiment=7b_hsdp", "model.n_layers=2"]
SMALL_70B = ["+experiment=70b_tp_fsdp", "model.n_layers=1", "training.global_batch_size=8"]


def _run(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, dict[str, Any]]:
    rc = rehearse.main([*args, "--json"])
    out = capsys.readouterr().out
    return rc, json.loads(out) if out.strip().startswith("{") else {}


def _failing(report: dict[str, Any]) -> dict[str, float]:
    return {
        r["what"]: r["ratio"]
        for rank in report["ranks"]
        for r in rank["rows"]
        if r["checked"] and abs(r["ratio"] - 1) > rehearse.TOLERANCE
    }


def test_7b_hsdp_agrees_with_the_plan_on_its_default_ranks(capsys: pytest.CaptureFixture[str]) -> None:
    rc, report = _run(SMALL_7B, capsys)
    assert rc == 0, _failing(report)
    assert [r["rank"] for r in report["ranks"]] == [0, 31]
    assert all(r["world_size"] == 32 for r in report["ranks"])
    rows = {r["what"]: r for r in report["ranks"][0]["rows"]}
    # model states and the FSDP / HSDP traffic are exact
    for what in ("params", "grads", "all_gather dp_shard_cp bytes", "reduce_scatter dp_shard_cp bytes"):
        assert rows[what]["ratio"] == pytest.approx(1.0, abs=1e-6), what
    assert rows["all_reduce dp_replicate bytes"]["ratio"] == pytest.approx(1.0, abs=1e-6)
    assert rows["optimizer"]["ratio"] == pytest.approx(1.0, abs=1e-6)  # + AdamW's step counters
    assert rows["activations saved (end of forward)"]["ratio"] == pytest.approx(1.0, abs=1e-3)
    assert not rows["peak: total"]["checked"]  # shown with its categories, not settled (README)


def test_70b_tp_fsdp_agrees_with_the_plan(capsys: pytest.CaptureFixture[str]) -> None:
    """TP x SP x FSDP with full AC, term by term: the planner's TP counts follow torch's checkpoint
    early stop (the feed-forward's row-wise output is not recomputed) and the SP norms' partial
    gradients are reduced in FSDP's param dtype; both were found by this rehearsal."""
    rc, report = _run([*SMALL_70B, "--ranks=0", "--steps=2"], capsys)
    assert rc == 0, _failing(report)
    rows = {r["what"]: r for r in report["ranks"][0]["rows"]}
    for what in ("params", "grads", "all_gather tp bytes", "reduce_scatter dp_shard_cp bytes"):
        assert rows[what]["ratio"] == pytest.approx(1.0, abs=1e-6), what
    assert rows["reduce_scatter tp calls"]["ratio"] == 1.0
    assert rows["all_reduce tp bytes"]["ratio"] == pytest.approx(1.0, abs=0.01)  # + the grad norm's scalars
    assert rows["activations saved (end of forward)"]["ratio"] == pytest.approx(1.0, abs=0.01)


def test_a_tp_plan_that_leaves_a_projection_unsharded_fails(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import parallelisms.tensor_parallel as tp

    real = tp.tp_plan

    def one_unsharded(*args: Any, **kwargs: Any) -> dict[str, Any]:
        plan = real(*args, **kwargs)
        plan.pop("layers.0.feed_forward.w2")  # the seeded defect: w2 stays replicated over tp
        return plan

    monkeypatch.setattr(tp, "tp_plan", one_unsharded)
    rc = rehearse.main([*SMALL_70B, "--ranks=0"])
    err = capsys.readouterr().err
    assert rc == 1
    # the replicated w2 meets a tensor-parallel input: the step fails at trace time, named by rank
    assert "rehearsal failed at rank 0: RuntimeError" in err and "DTensor" in err


@pytest.mark.parametrize(
    ("arg", "named"),
    [("--ranks=0,32", "--ranks: rank 32"), ("--steps=zero", "--steps=zero"), ("--bogus", "--bogus")],
)
def test_a_bad_argument_exits_2_naming_it(arg: str, named: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert rehearse.main(["+experiment=7b_hsdp", arg]) == 2
    assert named in capsys.readouterr().err


def test_an_unknown_preset_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert rehearse.main(["+experiment=no_such_preset"]) == 2
    assert "no_such_preset" in capsys.readouterr().err
