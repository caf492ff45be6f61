"""Every preset of ``configs/experiment/`` rehearsed at its intended world size on its default ranks
(``python -m trainer.rehearse``), and every checked term within 5% of the planner's.

The large presets are rehearsed with fewer blocks (``model.n_layers``) and, where the local batch
allows, fewer microbatches: the world size, the mesh, every block's shapes and degrees stay the
preset's, and the planner plans the same overrides, so each term is compared like for like. The
full-size figures are in the README ("Rehearsing a run at its real size")."""

from __future__ import annotations

import json
import os
from typing import Any

import pytest

from trainer import rehearse
from trainer.config import CONFIG_DIR
from trainer.rehearse_pp import default_ranks

# preset -> the overrides that keep its rehearsal within a few seconds per rank
SUITE: dict[str, list[str]] = {
    "debug": ["model.n_layers=2", "training.global_batch_size=8"],
    "debug_cp": ["model.n_layers=2", "training.global_batch_size=4"],
    "debug_tp": ["model.n_layers=2", "training.global_batch_size=8"],
    "qwen3_debug": ["model.n_layers=2", "training.global_batch_size=8"],
    "38m_ddp": ["model.n_layers=2"],
    "7b_fsdp": ["model.n_layers=2"],
    "7b_hsdp": ["model.n_layers=2"],
    "70b_tp_fsdp": ["model.n_layers=1", "training.global_batch_size=8"],
    "llama3_8b_128k_cp": ["model.n_layers=1"],
    "moe_debug_ep": ["model.n_layers=1"],  # at full size in test_rehearse_ep.py
    "qwen3_30b_a3b_ep": ["model.n_layers=1"],
    "deepseek_v3_debug": ["model.n_layers=2", "training.global_batch_size=8"],
    "debug_pp": [],
    # pipeline presets: one block per virtual stage, the fewest microbatches the schedule allows (one per
    # pipeline rank); the first rank of the first stage and the last of the last (all four default
    # ranks: test_rehearse_pp.py and the README)
    "405b_4d": ["model.n_layers=32", "training.global_batch_size=128", "--ranks=0,1023"],
    "deepseek_v3_ep_pp": ["model.n_layers=16", "training.global_batch_size=2048", "--ranks=0,2047"],
}
# Measured disagreements not settled yet (README): preset -> {row (or row@rank): (low, high) ratio}
KNOWN: dict[str, dict[str, tuple[float, float]]] = {
    "debug_cp": {"activations saved (end of forward)": (0.90, 0.95)},
    # MLA blocks without activation checkpointing save ~24% more than planned, with or without ep
    "deepseek_v3_debug": {"activations saved (end of forward)": (1.2, 1.3)},
    # with the pipeline's buffers (exact on 1F1B's first stages): interleaved 1F1B under full AC (the
    # planner counts a stage's received input both as a receive buffer and as its first block's
    # checkpointed input), and the last stage's logits
    "405b_4d": {"activations saved (end of forward)": (0.85, 0.93)},
    "deepseek_v3_ep_pp": {"activations saved (end of forward)@2047": (0.7, 0.8)},
}


def _presets() -> list[str]:
    folder = os.path.join(CONFIG_DIR, "experiment")
    return sorted(f[:-5] for f in os.listdir(folder) if f.endswith(".yaml"))


def test_every_preset_is_rehearsed_in_the_suite() -> None:
    assert set(_presets()) == set(SUITE)


@pytest.mark.parametrize("preset", sorted(SUITE))
def test_preset_rehearses_and_agrees_with_the_plan(preset: str, capsys: pytest.CaptureFixture[str]) -> None:
    rc = rehearse.main([f"+experiment={preset}", *SUITE[preset], "--json", "--report-only"])
    out = capsys.readouterr().out
    assert rc == 0, out[-2000:]
    report: dict[str, Any] = json.loads(out)
    world = rehearse.intended_world_size(preset)
    asked = [a.split("=", 1)[1] for a in SUITE[preset] if a.startswith("--ranks=")]
    pp = rehearse._plan_inputs(rehearse._parse([f"+experiment={preset}", *SUITE[preset]]))[0].parallelism.pp
    ranks = [int(r) for r in asked[0].split(",")] if asked else default_ranks(world, pp)
    assert [r["rank"] for r in report["ranks"]] == ranks
    known = KNOWN.get(preset, {})
    for rank in report["ranks"]:
        assert rank["world_size"] == world
        rows = {r["what"]: r for r in rank["rows"]}
        # what every rehearsal measures: model states, saved activations, FLOPs (checked without PP,
        # whose stages differ), the collectives
        for what in ("params", "grads", "optimizer", "activations saved (end of forward)", "FLOPs executed"):
            assert rows[what]["checked"] == (what != "FLOPs executed" or pp == 1), what
            assert rows[what]["rehearsed"] > 0, what
        assert any(r["kind"] == "comm" and r["checked"] for r in rank["rows"]) or world == 1
        for r in rank["rows"]:
            if not r["checked"]:
                continue
            bounds = known.get(f"{r['what']}@{rank['rank']}", known.get(r["what"]))
            if bounds is not None:
                low, high = bounds
                assert low <= r["ratio"] <= high, (preset, rank["rank"], r)
            else:
                assert abs(r["ratio"] - 1) <= rehearse.TOLERANCE, (preset, rank["rank"], r)
