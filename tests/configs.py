"""Build typed configs the way the CLI does (Hydra compose + validation), for tests."""

from __future__ import annotations

import copy
import os
from typing import Any

from hydra import compose, initialize_config_dir
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import DictConfig, OmegaConf

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

# The parity runs (tests/parity.py) take 4 optimizer steps of the tiny run, not TINY's 8: the 2 warmup
# steps and 2 of the decay, AdamW's moments in use from step 2 on, every step clipped (pre-clip norms
# > 1); each step's loss and grad norm and the final weights are compared, so a reduction or sharding
# error shows at step 1 already. Half the steps of the multi-rank runs that make those tests' time.
PARITY_STEPS = "training.steps=4"

# Clipping off. With it on, every step of the tiny run is clipped (pre-clip norms 1.0-2.7),
# so a gradient scale error never reaches the update; without it, the unclipped path runs.
# (AdamW is itself nearly scale-invariant: the pre-clip grad norm is what exposes a scale
# error, which is why parity tests compare it.)
NO_CLIP = "training.grad_clip=0"


# Composition is memoized per process (a Hydra compose costs ~0.3-1 s on 2 cores, and the suite
# composes the same override lists many times, differing only in the run folder): the cache
# holds each composed config, callers get deep copies.
_COMPOSED: dict[tuple[str, ...], DictConfig] = {}
_DUMP_FOLDER = "job.dump_folder"


def compose_dict(*overrides: str) -> DictConfig:
    """The composed (untyped) Hydra config for ``overrides`` (a fresh copy on every call)."""
    if overrides not in _COMPOSED:
        register_configs()
        with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
            _COMPOSED[overrides] = compose("train", overrides=list(overrides))
    return copy.deepcopy(_COMPOSED[overrides])


def make_config(*overrides: str, **kw: Any) -> TrainConfig:
    """Compose + convert + validate, exactly as ``trainer/main.py`` does."""
    return to_train_config(compose_dict(*overrides))


def tiny_config(tmp_dir: str, *overrides: str) -> TrainConfig:
    """The tiny run in ``tmp_dir``; later overrides win.

    The run folder is applied to the composed config afterwards, the way Hydra applies a value
    override (its parsed value, ``OmegaConf.update``), so runs that differ only in their folder
    share one composition; validation runs on every call.
    """
    folder = f"{_DUMP_FOLDER}={tmp_dir}"
    if any(o.split("=", 1)[0].lstrip("+~") == _DUMP_FOLDER for o in overrides):
        return make_config(*TINY, folder, *overrides)  # a later override names the folder: compose as is
    dcfg = compose_dict(*TINY, *overrides)
    (parsed,) = OverridesParser.create().parse_overrides([folder])
    OmegaConf.update(dcfg, _DUMP_FOLDER, parsed.value(), merge=True)
    return to_train_config(dcfg)
