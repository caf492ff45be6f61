"""The real Trainer on prepared shards: HF tokenizer end to end, exact resume across FSDP x2 -> DDP x2.

The reshard case is also the exact-resume case: the DDP x2 run starts from the FSDP x2 run's
step-4 checkpoint and must give the uninterrupted FSDP x2 run's step 5-8 losses bitwise (fp32,
deterministic; with 2 ranks every reduction is one commutative addition, so the layouts agree
to the bit).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from models.errors import ConfigError
from tests.configs import tiny_config
from tests.dist import run_distributed
from trainer.config import DataConfig
from trainer.data import builtin_root, load_documents
from trainer.data.prepared import prepare

pytestmark = pytest.mark.slow

DETERMINISTIC = ("training.deterministic=true",)


def _losses(history: list[dict]) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in history if "loss" in r}


def _train(tmp: str, *overrides: str, until: int | None = None) -> list[dict]:
    from trainer.train import Trainer

    trainer = Trainer(tiny_config(tmp, *overrides))
    try:
        return trainer.train(until_step=until)
    finally:
        trainer.close()


def test_hf_tokenizer_trained_on_the_stdlib_prepares_and_trains(tmp_path: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    docs = load_documents(DataConfig(max_documents=80, val_fraction=0.0), "train")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=500, special_tokens=["<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(docs, trainer=trainer)
    tok_path = str(tmp_path / "tokenizer.json")
    tok.save(tok_path)
    out = str(tmp_path / "prep")
    index = prepare(DataConfig(max_documents=120, tokenizer=tok_path), out)
    assert index["tokenizer"]["vocab_size"] == 500 and index["source"]["path"] is None
    data = ("data=tokens", f"data.path={out}", f"data.tokenizer={tok_path}", "training.steps=3")
    history = _train(str(tmp_path / "run"), *data)
    losses = _losses(history)
    assert sorted(losses) == [1, 2, 3] and all(0 < v < 10 for v in losses.values())
    assert all(r["data_wait_s"] >= 0 for r in history if "loss" in r)
    with pytest.raises(ConfigError, match="vocab_size=300"):  # before any data is read
        _train(str(tmp_path / "small"), *data, "model.vocab_size=300")
    assert not os.path.exists(tmp_path / "small")


def _resume_worker(rank: int, world_size: int, tmp: str, prep: str) -> dict:
    data = ("data=tokens", f"data.path={prep}", *DETERMINISTIC)
    fsdp = ("parallelism.dp_shard=2",)
    ddp = ("parallelism.dp_replicate=2", "parallelism.dp_shard=1")
    ck = ("checkpoint.enable=true", "checkpoint.interval=4")
    straight = _losses(_train(os.path.join(tmp, "straight"), *data, *fsdp))
    _train(os.path.join(tmp, "first"), *data, *fsdp, *ck, until=4)
    step4 = os.path.join(tmp, "first", "checkpoints", "step-4")
    load = (f"checkpoint.initial_load_path={step4}", "checkpoint.initial_load_model_only=false")
    resharded = _losses(_train(os.path.join(tmp, "ddp"), *data, *ddp, *load))
    return {"straight": straight, "resharded": resharded}


def test_prepared_shards_resume_exactly_and_reshard_fsdp_to_ddp(tmp_path: Path) -> None:
    prep = str(tmp_path / "prep")
    prepare(DataConfig(max_documents=120), prep)
    assert os.path.isdir(builtin_root())
    out = run_distributed(_resume_worker, 2, str(tmp_path), prep)[0]
    want = {s: v for s, v in out["straight"].items() if s > 4}
    assert len(want) == 4
    # Resumed from FSDP x2's step-4 checkpoint under DDP x2: bitwise the uninterrupted losses.
    assert {s: v for s, v in out["resharded"].items() if s > 4} == want
