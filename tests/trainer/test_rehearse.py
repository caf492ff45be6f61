"""``python -m trainer.rehearse``: its command line and its failures (every preset against the plan:
``test_rehearse_presets.py``)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from trainer import rehearse

SMALL_70B = ["+experiment=70b_tp_fsdp", "model.n_layers=1", "training.global_batch_size=8"]


def _run(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, dict[str, Any]]:
    rc = rehearse.main([*args, "--json"])
    out = capsys.readouterr().out
    return rc, json.loads(out) if out.strip().startswith("{") else {}


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
