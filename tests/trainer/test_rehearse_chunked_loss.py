"""``training.loss_chunk_size`` under ``python -m trainer.rehearse``: the planner's head and loss terms
with chunking (no saved logits; the head's input kept by torch's checkpoint) agree with the memory
tracker, TP x2 with loss parallel and sequence parallel (``debug_tp``, one rank)."""

from __future__ import annotations

import json

import pytest

from trainer import rehearse


def test_chunked_loss_rehearses_and_agrees_with_the_plan(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["+experiment=debug_tp", "training.loss_chunk_size=64", "--ranks=0", "--json"]
    assert rehearse.main(args) == 0
    (rank,) = json.loads(capsys.readouterr().out)["ranks"]
    rows = {r["what"]: r for r in rank["rows"]}
    saved = rows["activations saved (end of forward)"]
    assert abs(saved["ratio"] - 1) <= 0.01, saved
    # the whole (tokens x vocab / 2) fp32 log-softmax is no longer saved: below the unchunked plan
    assert saved["planned"] < 53_594_112 - 1_000_000
