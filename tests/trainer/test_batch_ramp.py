"""Batch-size warmup (``training.batch_ramp``, ``trainer/data/batch_ramp.py``).

* The stage arithmetic (by steps and by tokens) and the refusals, by name.
* Runs of the tiny model, 2 blocks, 6 steps, the global batch 4 (steps 1-2), 8 (steps 3-4), then 16,
  micro batch 2 (accumulation 2, 4, 8 on one process; 1, 2, 4 on DDP x2), clipping off:
  - DDP x2 against one process: losses and pre-clip grad norms within ``PARITY_RTOL``;
  - resume mid-ramp (checkpoint at step 3, inside the second stage) on one process: bitwise;
  - reshard mid-ramp: DDP x2 to step 3, resumed on one process: within ``PARITY_RTOL``;
  - every global sample index read (each rank's rows, counted over the interrupted runs) is read
    exactly once: 0 .. 55 = 4 + 4 + 8 + 8 + 16 + 16 samples.
"""

from __future__ import annotations

import re
from collections import Counter

import pytest

from models.errors import ConfigError
from tests.configs import NO_CLIP, make_config, tiny_config
from tests.dist import run_distributed
from tests.parity import assert_parity
from trainer.config import TrainConfig
from trainer.data.batch_ramp import BatchRamp, BatchStage, check_ramp_divisible

RAMP = (
    "training.batch_ramp=[{global_batch_size: 4, until_step: 3}, {global_batch_size: 8, until_step: 5}]",
    "training.global_batch_size=16",
    "training.micro_batch_size=2",
    "training.steps=6",
    "model.n_layers=2",
    "training.deterministic=true",
    NO_CLIP,
)
DDP = ("parallelism.dp_replicate=2", "parallelism.dp_shard=1")
CKPT = ("checkpoint.enable=true", "checkpoint.interval=3")
TOTAL = 4 + 4 + 8 + 8 + 16 + 16


def test_stages_by_steps_and_by_tokens() -> None:
    steps = BatchRamp([BatchStage(4, until_step=3), BatchStage(8, until_step=5)], 16, seq_len=32)
    assert [steps.size_at(n) for n in (0, 4, 8, 16, 24, 40)] == [4, 4, 8, 8, 16, 16]
    assert [steps.samples_after(k) for k in range(7)] == [0, 4, 8, 16, 24, 40, 56]
    assert [n for n in range(60) if steps.is_step_start(n)] == [0, 4, 8, 16, 24, 40, 56]
    # 300 tokens = 10 samples of 32 (ceil 9.4): steps of 4 start at 0, 4, 8 (< 10), then 16 per step.
    tokens = BatchRamp([BatchStage(4, until_tokens=300)], 16, seq_len=32)
    assert [tokens.samples_after(k) for k in range(5)] == [0, 4, 8, 12, 28]
    assert tokens.max_size == 16


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (("training.batch_ramp=[{global_batch_size: 4}]",), "training.batch_ramp[0] must set exactly one of"),
        (
            (
                "training.batch_ramp=[{global_batch_size: 4, until_step: 5}, "
                "{global_batch_size: 8, until_step: 5}]",
            ),
            "training.batch_ramp[1].until_step=5 must be greater than the previous stage's bound (5)",
        ),
        (
            (
                "training.batch_ramp=[{global_batch_size: 4, until_step: 5}, "
                "{global_batch_size: 8, until_tokens: 9}]",
            ),
            "training.batch_ramp[1]: every stage of training.batch_ramp ends by steps, or every stage by "
            "tokens",
        ),
        (
            ("training.batch_ramp=[{global_batch_size: 4, until_step: 3}]", "parallelism.pp=2"),
            "parallelism.pp > 1",
        ),
        (
            (
                "training.batch_ramp=[{global_batch_size: 4, until_step: 3}]",
                "parallelism.fault_tolerance.enable=true",
            ),
            "training.batch_ramp with parallelism.fault_tolerance.enable=true: not supported",
        ),
        (
            ("training.batch_ramp=[{global_batch_size: 4, until_step: 3}]", "model=moe_debug"),
            "training.batch_ramp with model.family=moe (experts): not supported",
        ),
    ],
)
def test_ramp_refusals(overrides: tuple[str, ...], message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        make_config(*overrides)


def test_each_stage_divisibility_is_checked_naming_the_stage() -> None:
    check_ramp_divisible([BatchStage(4, until_step=3), BatchStage(8, until_step=5)], 2, 2)
    msg = "training.batch_ramp[1].global_batch_size=6 is not a multiple of training.micro_batch_size x"
    with pytest.raises(ConfigError, match=re.escape(msg)):
        check_ramp_divisible([BatchStage(4, until_step=3), BatchStage(6, until_step=5)], 2, 2)


def _runs(rank: int, world: int, plan: list[tuple[str, TrainConfig, int]]) -> dict[str, dict]:
    """Each (name, config, until_step) in turn: its loss/grad-norm history and the global sample
    indices this rank read (from the loader's position and its rows)."""
    from trainer.train import Trainer

    out = {}
    for name, cfg, until in plan:
        trainer = Trainer(cfg)
        loader = trainer.train_loader
        read: list[int] = []
        next_batch = loader.next_batch

        def recording(loader=loader, read=read, next_batch=next_batch):  # noqa: ANN001, ANN202
            size, local = loader.step_shape()(loader.samples_seen)
            first = loader.samples_seen + loader.dp_rank * local
            read.extend(range(first, first + local))
            return next_batch()

        loader.next_batch = recording  # type: ignore[method-assign]
        try:
            history = trainer.train(until_step=until)
        finally:
            trainer.close()
        out[name] = {"history": history, "read": read}
    return out


@pytest.mark.slow
def test_ramp_ddp_resume_and_reshard_read_each_sample_once(tmp_path) -> None:
    d = {n: str(tmp_path / n) for n in ("one", "ddp", "ddp_part", "one_part")}
    ddp = run_distributed(
        _runs,
        2,
        [
            ("ddp", tiny_config(d["ddp"], *RAMP, *DDP), 6),
            ("ddp_part", tiny_config(d["ddp_part"], *RAMP, *DDP, *CKPT), 3),
        ],
        timeout=600,
    )
    one = run_distributed(
        _runs,
        1,
        [
            ("one", tiny_config(d["one"], *RAMP), 6),
            ("one_part", tiny_config(d["one_part"], *RAMP, *CKPT), 3),
            ("one_resumed", tiny_config(d["one_part"], *RAMP, *CKPT), 6),
            ("resharded", tiny_config(d["ddp_part"], *RAMP, *CKPT), 6),  # DDP x2's step-3 checkpoint
        ],
        timeout=600,
    )[0]
    losses = lambda run: {r["step"]: r["loss"] for r in run["history"] if "loss" in r}  # noqa: E731
    assert sorted(losses(one["one"])) == [1, 2, 3, 4, 5, 6]
    assert_parity(one["one"]["history"], ddp[0]["ddp"]["history"], label="ramp DDP x2 vs 1 process")
    # Resume mid-ramp (step 3, stage 2) on one process: bitwise.
    assert {**losses(one["one_part"]), **losses(one["one_resumed"])} == losses(one["one"])
    assert sorted(losses(one["one_resumed"])) == [4, 5, 6]
    # Reshard mid-ramp: DDP x2 steps 1-3, then one process steps 4-6.
    resharded = ddp[0]["ddp_part"]["history"] + one["resharded"]["history"]
    assert_parity(one["one"]["history"], resharded, label="ramp DDP x2 -> 1 process at step 3")
    # Each global sample once: straight runs, the interrupted ones, and the reshard.
    everything = Counter(range(TOTAL))
    assert Counter(one["one"]["read"]) == everything
    assert Counter(ddp[0]["ddp"]["read"] + ddp[1]["ddp"]["read"]) == everything
    assert Counter(one["one_part"]["read"] + one["one_resumed"]["read"]) == everything
    assert (
        Counter(ddp[0]["ddp_part"]["read"] + ddp[1]["ddp_part"]["read"] + one["resharded"]["read"])
        == everything
    )
