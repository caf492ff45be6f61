"""Build typed configs the way the CLI does (Hydra compose + validation), for tests."""

from __future__ import annotations

import os
from typing import Any

from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

from trainer.config import TrainConfig, register_configs, to_train_config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG_DIR = os.path.join(REPO, "configs")

# A model and run small enough for many multi-process tests on 2 CPU cores.
TINY = (
    "model.dim=64",
    "model.n_layers=4",
    "model.n_heads=4",
    "model.n_kv_heads=2",
    "model.ffn_hidden_dim=128",
    "model.vocab_size=512",
    "training.seq_len=32",
    "training.global_batch_size=8",
    "training.micro_batch_size=2",
    "training.steps=8",
    "training.eval_freq=0",
    "data.max_documents=120",
    "metrics.log_freq=1",
    "metrics.tensorboard=false",
    "lr_scheduler.warmup_steps=2",
    "optimizer.lr=3e-3",
)

# Clipping off. With it on, every step of the tiny run is clipped (pre-clip norms 1.0-2.7),
# so a gradient scale error never reaches the update; without it, the unclipped path runs.
# (AdamW is itself nearly scale-invariant: the pre-clip grad norm is what exposes a scale
# error, which is why parity tests compare it.)
NO_CLIP = "training.grad_clip=0"


def compose_dict(*overrides: str) -> DictConfig:
    """The composed (untyped) Hydra config for ``overrides``."""
    register_configs()
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        return compose("train", overrides=list(overrides))


def make_config(*overrides: str, **kw: Any) -> TrainConfig:
    """Compose + convert + validate, exactly as ``trainer/main.py`` does."""
    return to_train_config(compose_dict(*overrides))


def tiny_config(tmp_dir: str, *overrides: str) -> TrainConfig:
    """The tiny run in ``tmp_dir``; later overrides win."""
    return make_config(*TINY, f"job.dump_folder={tmp_dir}", *overrides)
