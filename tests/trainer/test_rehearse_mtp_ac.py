"""DeepSeek-V3's multi-token-prediction modules under full activation checkpointing
(``python -m trainer.rehearse``): checkpointing wraps the blocks only, so the MTP modules and their head
passes run once; the planner's executed FLOPs (``ModelSpec.mtp_flops_per_token``) agree with the
rehearsal's FLOP counter on one rank of ``deepseek_v3_debug`` (2 blocks: one dense, one MoE; 1 MTP module)."""

from __future__ import annotations

import json

import pytest

from trainer import rehearse


def test_mtp_modules_are_not_recomputed_under_full_ac(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["+experiment=deepseek_v3_debug", "model.n_layers=2", "training.global_batch_size=8"]
    assert rehearse.main([*args, "training.activation_checkpoint=full", "--ranks=0", "--json"]) == 0
    (rank,) = json.loads(capsys.readouterr().out)["ranks"]
    flops = {r["what"]: r for r in rank["rows"]}["FLOPs executed"]
    assert abs(flops["ratio"] - 1) <= 0.01, flops  # 0.897 when the plan recomputed the MTP module
