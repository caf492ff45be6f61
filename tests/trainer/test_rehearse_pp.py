"""``python -m trainer.rehearse`` on pipeline-parallel presets: the stages' static boundary shapes
(``parallelisms.pipeline_parallel.StageShapes``) let torch's schedules run under the fake process
group, and every rehearsed rank is compared with the plan of its own pipeline rank, send/recv
included. (Every preset on its default ranks, the PP ones too: ``test_rehearse_presets.py``.)

Sizes: ``debug_pp`` at its intended 4 ranks as is, and on 2 ranks (pure PP, interleaved, bf16
autocast: the stream stays fp32 without FSDP); ``405b_4d`` at 1024 ranks with 32 blocks (one per
virtual stage) and 16 microbatches (the fewest its 16 pipeline ranks allow), the planner planning the
same overrides.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from trainer import rehearse
from trainer.rehearse_pp import default_ranks

SMALL_405B = ["+experiment=405b_4d", "model.n_layers=32", "training.global_batch_size=128"]
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
    # ranks 1 and 2: the last of the first stage and the first of the second (all four: the suite)
    rc, report, err = _run(["+experiment=debug_pp", "--ranks=1,2"], capsys)
    assert rc == 0, (_failing(report), err)
    assert all(r["world_size"] == 4 for r in report["ranks"])
    for rank in (1, 2):
        rows = _rows(report, rank)
        for what in (*EXACT, "all_gather dp_shard_cp bytes", "reduce_scatter dp_shard_cp bytes"):
            assert rows[what]["ratio"] == pytest.approx(1.0, abs=1e-9), (rank, what)
        # 4 microbatches of (2, 256, 256) fp32 activations forward, their gradients backward
        assert rows["send pp calls"]["rehearsed"] == rows["send pp calls"]["planned"] == 4
        assert rows["send pp bytes"]["rehearsed"] == 4 * 2 * 256 * 256 * 4
        # saved activations with the stages' receive buffers and kept outputs (1F1B: exact; the last
        # stage's, read when the loss returns, with the loss's few scalars: 4 KB of 28 MB)
        assert rows["activations saved (end of forward)"]["ratio"] == pytest.approx(1.0, abs=3e-4)


def test_pure_pp_under_bf16_autocast_sends_the_fp32_stream(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["+experiment=debug_pp", "--world=2", "training.mixed_precision=bf16"]
    # every checked term within 5%: bf16 autocast's weight copies are cached for the whole step, held
    # once whatever the microbatches in flight (0.92 of the plan on rank 0 when counted per microbatch)
    rc, report, err = _run([*args, "parallelism.pp_schedule=Interleaved1F1B", "--ranks=1"], capsys)
    assert rc == 0, (_failing(report), err)
    rows = _rows(report, 1)
    assert rows["recv pp bytes"]["ratio"] == pytest.approx(1.0, abs=1e-9)
    # 8 microbatches over 4 virtual stages (rank 1: stages 1 and 3): 3 boundaries each, fp32
    assert rows["send pp calls"]["rehearsed"] == 8 * 3
    assert rows["send pp bytes"]["rehearsed"] == 8 * 3 * 2 * 256 * 256 * 4
    assert rows["send pp bytes"]["ratio"] == pytest.approx(1.0, abs=1e-9)


@pytest.mark.parametrize("float8", [False, True])
def test_pure_pp_peak_is_the_blocks_backward(float8: bool, capsys: pytest.CaptureFixture[str]) -> None:
    """Without FSDP a pipeline stage's peak is in its last block's feed-forward backward (rank 0: the
    gate product's backward, beside every in-flight microbatch's saved bytes and the stage's held
    gradients; float8: the output projection's, with its casts), where the plan held no activation
    gradient. Peak, rehearsed / planned (debug, 2 blocks, pp=2, 4 microbatches, 1F1B), ranks 0 / 1:
    1.109 / 1.029 -> 1.004 / 1.029 (rank 1's is the loss's backward); with float8 1.059 / 1.086 ->
    1.000 / 1.022 (rank 1: the logits, which torch's stage holds through the backward, and the blocks'
    output gradient, made by the head's backward, were missing)."""
    f8 = ["training.float8.enable=true"] if float8 else []
    args = ["+experiment=debug", "model.n_layers=2", "parallelism.pp=2", "parallelism.dp_shard=1", *f8]
    rc, report, err = _run([*args, "--ranks=0,1"], capsys)
    assert rc == 0, (_failing(report), err)  # every checked term within 5%, the peak included
    for rank in (0, 1):
        assert _rows(report, rank)["peak: total"]["checked"]


def test_405b_4d_rehearses_its_default_ranks(capsys: pytest.CaptureFixture[str]) -> None:
    from trainer.rehearse import _parse, _plan_inputs

    _, world, ranks, _ = _plan_inputs(_parse(SMALL_405B))
    assert (world, ranks) == (1024, [0, 63, 960, 1023])


# The suite rehearses ranks 0 and 1023; 63 and 960 (the other ends of those stages) here, 960 slow-marked.
@pytest.mark.parametrize("rank", [63, pytest.param(960, marks=pytest.mark.slow)])
def test_405b_4d_agrees_with_the_plan_term_by_term(rank: int, capsys: pytest.CaptureFixture[str]) -> None:
    rc, report, err = _run([*SMALL_405B, f"--ranks={rank}"], capsys)
    assert rc == 0, (_failing(report), err)  # every checked term within 5%, the peak included
    rows = _rows(report, rank)
    # the peak is an instant of torch's interleaved schedule (the planner walks it): checked
    assert rows["peak: total"]["checked"]
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
    # Interleaved 1F1B, 2 virtual stages per rank (pipeline rank 0: stages 0 and 16, rank 15: 15 and
    # 31): 3 sends per microbatch -- forward from both stages but the last, backward from both but the
    # first -- of a (1, 8192 / tp 8, 16384) bf16 slice of the stream.
    assert rows["send pp calls"]["rehearsed"] == 16 * 3
    assert rows["send pp bytes"]["rehearsed"] == 16 * 3 * 1024 * 16384 * 2


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
