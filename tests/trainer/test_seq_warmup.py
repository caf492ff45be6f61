"""Sequence-length warmup (``training.seq_len_warmup``, ``trainer/data/seq_warmup.py``).

* The split against an independent derivation: the shorter rows concatenate back to the windows (each
  token once, in order), and their positions equal ``document_positions`` of the shorter rows' own
  tokens (the rule the loader applies at a window's start).
* Runs of the tiny model (2 blocks, block-causal attention, seq_len 32, 6 steps: 4 x 8 tokens per window
  on steps 1-2, 2 x 16 on steps 3-4, then 32), clipping off: DDP x2 equals one process (losses and
  pre-clip grad norms within ``PARITY_RTOL``); a resume at step 3 (inside the warmup) is bitwise; the
  loader reads the same samples as without warmup (the position after 6 steps), and the warmup changes
  the losses from step 2 on (step 1's loss is taken before any update: it differs by the split alone);
  with ``training.batch_ramp`` as well, DDP x2 equals one process.
"""

from __future__ import annotations

import re

import pytest
import torch

from models.errors import ConfigError
from tests.configs import NO_CLIP, make_config, tiny_config
from tests.dist import run_distributed
from tests.parity import assert_parity
from trainer.config import TrainConfig
from trainer.data.seq_warmup import SeqLenStage, SeqLenWarmup, split_positions, split_rows
from trainer.step import document_positions

BOS, EOS = 256, 257


@pytest.mark.parametrize("k", [2, 4, 8])
def test_split_keeps_every_token_once_and_restarts_positions(k: int) -> None:
    g = torch.Generator().manual_seed(k)
    tokens = torch.randint(0, 256, (3, 32), generator=g)
    tokens[torch.rand(3, 32, generator=g) < 0.1] = EOS  # documents end anywhere ...
    nxt = torch.roll(tokens == EOS, 1, dims=1)
    nxt[:, 0] = False
    tokens[nxt] = BOS  # ... and the next one starts right after, as packed
    positions = document_positions(tokens, BOS, EOS)
    rows = split_rows(tokens, k)
    assert rows.shape == (3 * k, 32 // k)
    assert torch.equal(rows.reshape(3, 32), tokens)  # each token once, in order
    assert torch.equal(split_positions(positions, k), document_positions(rows, BOS, EOS))


def test_stage_factors() -> None:
    warmup = SeqLenWarmup([SeqLenStage(8, until_step=3), SeqLenStage(16, until_step=5)], 32)
    assert [warmup.factor(s) for s in range(1, 8)] == [4, 4, 2, 2, 1, 1, 1]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ("training.seq_len_warmup=[{seq_len: 12, until_step: 3}]",),
            "training.seq_len_warmup[0].seq_len=12 must",
        ),
        (
            ("training.seq_len_warmup=[{seq_len: 8, until_step: 3}, {seq_len: 16, until_step: 3}]",),
            "training.seq_len_warmup[1].until_step=3 must be greater than 3",
        ),
        (
            ("training.seq_len_warmup=[{seq_len: 8, until_step: 3}]", "parallelism.pp=2"),
            "training.seq_len_warmup with parallelism.pp=2: not supported",
        ),
    ],
)
def test_seq_len_warmup_refusals(overrides: tuple[str, ...], message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        make_config("training.seq_len=32", *overrides)


COMMON = (
    "model.n_layers=2",
    "model.attention_mask=block_causal",
    "training.steps=6",
    "training.deterministic=true",
    NO_CLIP,
)
WARMUP = (*COMMON, "training.seq_len_warmup=[{seq_len: 8, until_step: 3}, {seq_len: 16, until_step: 5}]")
# with a batch ramp too: 4, 4, 8, 8, 8, 8 windows (accumulation 2, 2, 4, 4, 4, 4: micro batch 2, 1 process)
BOTH = (*WARMUP, "training.batch_ramp=[{global_batch_size: 4, until_step: 3}]")
DDP = ("parallelism.dp_replicate=2", "parallelism.dp_shard=1")


def _runs(rank: int, world: int, plan: list[tuple[str, TrainConfig, int]]) -> dict[str, dict]:
    from trainer.train import Trainer

    out = {}
    for name, cfg, until in plan:
        trainer = Trainer(cfg)
        try:
            history = trainer.train(until_step=until)
            out[name] = {"history": history, "samples_seen": trainer.train_loader.samples_seen}
        finally:
            trainer.close()
    return out


@pytest.mark.slow
def test_seq_len_warmup_ddp_and_resume(tmp_path) -> None:
    d = {n: str(tmp_path / n) for n in ("one", "plain", "part", "ddp", "both", "both_ddp")}
    ckpt = ("checkpoint.enable=true", "checkpoint.interval=3")
    one = run_distributed(
        _runs,
        1,
        [
            ("one", tiny_config(d["one"], *WARMUP), 6),
            ("plain", tiny_config(d["plain"], *COMMON), 6),
            ("part", tiny_config(d["part"], *WARMUP, *ckpt), 3),
            ("resumed", tiny_config(d["part"], *WARMUP, *ckpt), 6),
            ("both", tiny_config(d["both"], *BOTH), 6),
        ],
        timeout=600,
    )[0]
    ddp = run_distributed(
        _runs,
        2,
        [
            ("ddp", tiny_config(d["ddp"], *WARMUP, *DDP), 6),
            ("both", tiny_config(d["both_ddp"], *BOTH, *DDP), 6),
        ],
    )
    losses = lambda run: {r["step"]: r["loss"] for r in run["history"] if "loss" in r}  # noqa: E731
    assert sorted(losses(one["one"])) == [1, 2, 3, 4, 5, 6]
    assert_parity(one["one"]["history"], ddp[0]["ddp"]["history"], label="seq_len warmup DDP x2 vs 1 process")
    assert {**losses(one["part"]), **losses(one["resumed"])} == losses(one["one"])  # bitwise
    assert one["one"]["samples_seen"] == one["plain"]["samples_seen"] == 6 * 8
    assert all(losses(one["one"])[s] != losses(one["plain"])[s] for s in range(2, 7))
    # With training.batch_ramp: the split multiplies the rows, not the accumulation count.
    assert one["both"]["samples_seen"] == 4 + 4 + 8 * 4
    assert_parity(
        one["both"]["history"], ddp[0]["both"]["history"], label="seq_len warmup + batch ramp, DDP x2"
    )
