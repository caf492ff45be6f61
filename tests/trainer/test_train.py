"""The Trainer loop: accumulation, loss normalisation, the non-finite stop, evaluation, run folder."""

from __future__ import annotations

import json

import pytest
from omegaconf import OmegaConf

from tests.configs import tiny_config
from tests.dist import run_distributed
from trainer.config import TrainConfig, to_train_config

pytestmark = pytest.mark.slow


def _train(rank: int, world_size: int, cfg: TrainConfig) -> list[dict]:
    from trainer.train import Trainer

    trainer = Trainer(cfg)
    try:
        return trainer.train()
    finally:
        trainer.close()


def _train_expect_error(rank: int, world_size: int, cfg: TrainConfig) -> str:
    from trainer.train import Trainer, TrainingError

    trainer = Trainer(cfg)
    try:
        trainer.train()
    except TrainingError as e:
        return f"step={trainer.state.step} {e}"
    finally:
        trainer.close()
    return "no error"


def test_accumulation_matches_one_big_microbatch(tmp_path) -> None:
    """global 8 as 4 microbatches of 2 == one microbatch of 8 (loss normalised by global tokens)."""
    (acc,) = run_distributed(_train, 1, tiny_config(str(tmp_path / "a"), "training.micro_batch_size=2"))
    (big,) = run_distributed(_train, 1, tiny_config(str(tmp_path / "b"), "training.micro_batch_size=8"))
    la = [r["loss"] for r in acc if "loss" in r]
    lb = [r["loss"] for r in big if "loss" in r]
    assert len(la) == 8
    assert max(abs(a - b) / b for a, b in zip(la, lb)) < 1e-5


def test_non_finite_loss_stops_every_rank_before_the_step(tmp_path) -> None:
    cfg = tiny_config(str(tmp_path), "optimizer.lr=1e30", "lr_scheduler.warmup_steps=0", "training.grad_clip=0",
                      "parallelism.dp_shard=2")  # fmt: skip
    messages = run_distributed(_train_expect_error, 2, cfg)
    for msg in messages:
        assert "non-finite gradient" in msg and "at step 2" in msg and "nothing was applied" in msg, msg
    assert messages[0] == messages[1]  # both ranks stopped at the same step


def test_run_folder_config_and_eval(tmp_path) -> None:
    cfg = tiny_config(str(tmp_path), "training.eval_freq=4", "training.eval_steps=2", "metrics.log_freq=4",
                      "data.val_fraction=0.05")  # fmt: skip
    (history,) = run_distributed(_train, 1, cfg)
    evals = [r for r in history if "eval_loss" in r]
    assert [r["step"] for r in evals] == [4, 8]
    assert all(r["eval_loss"] > 0 and r["eval_tokens"] == 2 * 2 * 32 for r in evals)
    # config.yaml is the resolved config and reproduces the run's config.
    saved = OmegaConf.load(tmp_path / "config.yaml")
    assert to_train_config(saved) == cfg
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in lines] == [r["step"] for r in history]


def test_bf16_training_tracks_fp32(tmp_path) -> None:
    """bf16 autocast (single process) and FSDP bf16 parameters follow the fp32 loss curve."""
    (fp32,) = run_distributed(_train, 1, tiny_config(str(tmp_path / "fp32")))
    (amp,) = run_distributed(_train, 1, tiny_config(str(tmp_path / "amp"), "training.mixed_precision=bf16"))
    fsdp = run_distributed(
        _train,
        2,
        tiny_config(
            str(tmp_path / "fsdp"), "parallelism.dp_shard=2", "parallelism.fsdp.param_dtype=bfloat16"
        ),
    )[0]
    ref = [r["loss"] for r in fp32 if "loss" in r]
    for run in (amp, fsdp):
        losses = [r["loss"] for r in run if "loss" in r]
        assert len(losses) == len(ref) and losses[-1] < losses[0]
        assert max(abs(a - b) / b for a, b in zip(losses, ref)) < 0.02, (losses, ref)
