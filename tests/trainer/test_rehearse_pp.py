"""``python -m trainer.rehearse`` on pipeline-parallel presets: the stages' static boundary shapes
(``parallelisms.pipeline_parallel.StageShapes``) let torch's schedules run under the fake process
group, and every rehearsed rank is compared with the plan of its own pipeline rank, send/recv
included.

Sizes: ``debug_pp`` at its intended 4 ranks as is; ``405b_4d`` at 1024 ranks with 32 blocks (one per
virtual stage) and 16 microbatches (the fewest its 16 pipeline ranks allow), the planner planning the
same overrides; ``deepseek_v3_ep_pp``'s pipeline side at 2048 ranks without expert parallelism
(``parallelism.ep=1``: EP is rehearsed elsewhere), on its first stage (dense blocks: a stage with MoE
blocks needs the EP rehearsal's routing answer).
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from trainer import rehearse
from trainer.rehearse_pp import default_ranks

SMALL_405B = ["+experiment=405b_4d", "model.n_layers=32", "training.global_batch_size=128"]
DEEPSEEK_PP = [
    "+experiment=deepseek_v3_ep_pp",
    "parallelism.ep=1",
    "model.n_layers=16",
    "training.global_batch_size=2048",
]
# what a rehearsed rank must match exactly: model states and every sizeable collective's bytes
EXACT = ("params", "grads", "send pp bytes", "recv pp bytes")


def _run(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, dict[str, Any], str]:
    rc = rehearse.main([*args, "--json"])
    out = capsys.readouterr()
    return rc, json.loads(out.out) if out.out.strip().startswith("{") else {}, out.err


def _rows(report: dict[str, Any], rank: int) -> dict[str, dict[str, Any]]:
    (rep,) = [r for r in report["ranks"] if r["rank"] == rank]
    return {r["what"]: r for r in rep["rows"]}


def _failing(report: dict[str, Any]) -> dict[tuple[int, str], float]:
    return {
        (rank["rank"], r["what"]): r["ratio"]
        for rank in report["ranks"]
        for r in rank["rows"]
        if r["checked"] and abs(r["ratio"] - 1) > rehearse.TOLERANCE
    }


def test_default_ranks_are_the_ends_of_the_first_and_last_stage() -> None:
    assert default_ranks(4, 2) == [0, 1, 2, 3]
    assert default_ranks(1024, 16) == [0, 63, 960, 1023]
    assert default_ranks(2048, 16) == [0, 127, 1920, 2047]
    assert default_ranks(32, 1) == [0, 31]  # without pipeline parallelism: the first and the last rank
    assert default_ranks(2, 2) == [0, 1]


def test_debug_pp_at_its_world_size_agrees_with_the_plan(capsys: pytest.CaptureFixture[str]) -> None:
    rc, report, err = _run(["+experiment=debug_pp"], capsys)
    assert rc == 0, (_failing(report), err)
    assert [r["rank"] for r in report["ranks"]] == [0, 1, 2, 3]  # 2 stages x FSDP 2
    assert all(r["world_size"] == 4 for r in report["ranks"])
    for rank in (0, 1, 2, 3):
        rows = _rows(report, rank)
        for what in (*EXACT, "all_gather dp_shard_cp bytes", "reduce_scatter dp_shard_cp bytes"):
            assert rows[what]["ratio"] == pytest.approx(1.0, abs=1e-9), (rank, what)
        # 4 microbatches of (2, 256, 256) fp32 activations forward, their gradients backward
        assert rows["send pp calls"]["rehearsed"] == rows["send pp calls"]["planned"] == 4
        assert rows["send pp bytes"]["rehearsed"] == 4 * 2 * 256 * 256 * 4


def test_405b_4d_rehearses_its_default_ranks(capsys: pytest.CaptureFixture[str]) -> None:
    from trainer.rehearse import _parse, _plan_inputs

    _, world, ranks, _ = _plan_inputs(_parse(SMALL_405B))
    assert (world, ranks) == (1024, [0, 63, 960, 1023])


# Ranks 63 and 960 run the same stages as 0 and 1023 (other tp / dp coordinates): slow-marked.
@pytest.mark.parametrize(
    "rank", [0, pytest.param(63, marks=pytest.mark.slow), pytest.param(960, marks=pytest.mark.slow), 1023]
)
def test_405b_4d_agrees_with_the_plan_term_by_term(rank: int, capsys: pytest.CaptureFixture[str]) -> None:
    rc, report, err = _run([*SMALL_405B, f"--ranks={rank}"], capsys)
    assert rc == 0, (_failing(report), err)
    rows = _rows(report, rank)
    checked = [w for w, r in rows.items() if r["checked"]]
    # TP (+ SP, full AC), FSDP and the pipeline's boundaries are all sizeable: all are checked
    for what in (
        *EXACT,
        "all_gather tp bytes",
        "reduce_scatter tp bytes",
        "all_gather dp_shard_cp bytes",
        "reduce_scatter dp_shard_cp bytes",
    ):
        assert what in checked and rows[what]["ratio"] == pytest.approx(1.0, abs=1e-9), what
    # Interleaved 1F1B, 2 virtual stages per rank: every microbatch crosses 3 boundaries of this
    # rank's (the first and last pipeline ranks hold the ends of the pipeline), one way forward and
    # one way backward: 3 sends of a (1, 8192 / 8, 16384) bf16 slice per microbatch.
    assert rows["send pp calls"]["rehearsed"] == 16 * 3
    assert rows["send pp bytes"]["rehearsed"] == 16 * 3 * 1024 * 16384 * 2


def test_deepseek_v3_pipeline_side_agrees_on_its_first_stage(capsys: pytest.CaptureFixture[str]) -> None:
    rc, report, err = _run([*DEEPSEEK_PP, "--ranks=0"], capsys)
    assert rc == 0, (_failing(report), err)
    rows = _rows(report, 0)
    for what in ("send pp bytes", "recv pp bytes"):
        assert rows[what]["ratio"] == pytest.approx(1.0, abs=1e-9), what
    # FSDP over 128 ranks: rank 0's shards are rounded up (dim 0 not a multiple of 128), the plan's
    # are the mean: 3e-4 apart
    for what in (
        "params",
        "grads",
        "optimizer",
        "all_gather dp_shard_cp bytes",
        "reduce_scatter dp_shard_cp bytes",
    ):
        assert rows[what]["ratio"] == pytest.approx(1.0, abs=1e-3), what


def test_a_wrong_static_boundary_is_caught_at_the_sending_stage(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import dataclasses

    import torch

    import parallelisms.pipeline_parallel as pipeline_parallel

    real = pipeline_parallel.stage_shapes

    def bf16_stream(*args: Any, **kwargs: Any) -> pipeline_parallel.StageShapes:
        # the seeded defect: receivers would allocate bf16 buffers for the fp32 residual stream
        return dataclasses.replace(real(*args, **kwargs), stream_dtype=torch.bfloat16)

    monkeypatch.setattr(pipeline_parallel, "stage_shapes", bf16_stream)
    rc, _, err = _run(["+experiment=debug_pp", "--ranks=0"], capsys)
    assert rc == 1
    assert "rehearsal failed at rank 0" in err and "pipeline stage 0 produced" in err
