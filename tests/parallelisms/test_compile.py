"""training.compile=true: per-block torch.compile before FSDP wrapping trains like eager.

One small case only: each first compile costs ~30 s on a CPU. Inductor fuses and
reorders float ops, so the tolerance is looser than the eager parity tests.
"""

from __future__ import annotations

import pytest

from tests.configs import tiny_config
from tests.dist import run_distributed
from trainer.config import TrainConfig

pytestmark = pytest.mark.slow


def _losses(rank: int, world_size: int, cfg: TrainConfig) -> dict:
    from torch._dynamo.eval_frame import OptimizedModule

    from trainer.train import Trainer

    trainer = Trainer(cfg)
    compiled = [isinstance(b, OptimizedModule) for b in trainer.model.layers.values()]
    history = trainer.train()
    trainer.close()
    return {"losses": [r["loss"] for r in history if "loss" in r], "compiled": compiled}


def test_compiled_fsdp_matches_eager(tmp_path) -> None:
    common = ("parallelism.dp_shard=2", "training.steps=4", "model.n_layers=2")
    eager = run_distributed(_losses, 2, tiny_config(str(tmp_path / "eager"), *common))[0]
    compiled = run_distributed(_losses, 2, tiny_config(str(tmp_path / "compiled"), *common, "training.compile=true"))[0]
    assert compiled["compiled"] == [True, True] and eager["compiled"] == [False, False]
    rel = max(abs(a - b) / b for a, b in zip(compiled["losses"], eager["losses"]))
    print(f"compile vs eager: max relative loss difference {rel:.2e}")
    assert rel < 1e-4, (compiled["losses"], eager["losses"])
