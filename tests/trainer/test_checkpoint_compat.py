"""Checkpoints written before the family-door redesign load after it, with the same keys.

``tests/fixtures/pre_door_checkpoints/<case>/step-2/`` are DCP checkpoints written at step 2 by the
code before the redesign (commit bc5a009: step hooks, optimizer registry, shared HF reader and
planner terms did not exist yet) for a tiny Llama trained with AdamW and a tiny MoE trained with
Muon; ``expected.json`` holds that code's losses and pre-clip gradient norms of the uninterrupted
4-step run. Today's code must resume each checkpoint (step 2, every key read), train steps 3-4 to the
same numbers (the same layout resumed: 1e-5 relative, since the fixture was written on another CPU
than the one running the test), and write a step-4 checkpoint with exactly the keys it read.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from torch.distributed.checkpoint import FileSystemReader

from tests.configs import make_config
from tests.parity import assert_parity, history_from

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "pre_door_checkpoints"
EXPECTED = json.loads((FIXTURES / "expected.json").read_text(encoding="utf-8"))


def _keys(step_folder: Path) -> set[str]:
    return set(FileSystemReader(str(step_folder)).read_metadata().state_dict_metadata)


@pytest.mark.parametrize("case", sorted(EXPECTED["cases"]))
def test_pre_redesign_checkpoint_resumes_with_same_keys(case: str, tmp_path: Path) -> None:
    from trainer.train import Trainer

    spec = EXPECTED["cases"][case]
    shutil.copytree(FIXTURES / case / "step-2", tmp_path / "checkpoints" / "step-2")
    cfg = make_config(*EXPECTED["small"], *spec["overrides"], f"job.dump_folder={tmp_path}")
    trainer = Trainer(cfg)
    try:
        assert trainer.state.step == 2, "the pre-redesign checkpoint was not resumed"
        history = trainer.train()
    finally:
        trainer.close()
    steps = [3, 4]
    want = history_from(
        [spec["losses"][str(s)] for s in steps], [spec["grad_norms"][str(s)] for s in steps], 3
    )
    got = [r for r in history if r.get("step") in steps and "loss" in r]
    worst = assert_parity(want, got, label=f"{case} resumed from the pre-redesign checkpoint")
    print(f"{case}: steps 3-4 after resuming vs the pre-redesign run: {worst}")
    assert _keys(tmp_path / "checkpoints" / "step-4") == _keys(FIXTURES / case / "step-2")
