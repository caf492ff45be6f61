"""The seed checkpoint (``checkpoint.create_seed=true``): one process builds the model in no layout
at all and writes its initial weights as a model-only ``step-0``, which the real run, in any layout,
then starts from (``checkpoint.initial_load_path``), instead of every rank of a big job initialising
its own shards.

What a seed is lives here: the one-process check, the layout it is built in and the refusal to write
it beside existing checkpoints. Writing it is the ``Checkpointer``'s ordinary model-only DCP save
(``Checkpointer.save_seed``), so its files and keys are those of any checkpoint's model.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from models.errors import ConfigError
from trainer.checkpoint.storage import complete_steps

if TYPE_CHECKING:
    from parallelisms.config import ParallelismConfig
    from trainer.config import CheckpointConfig

__all__ = ["check_seed_folder", "seed_parallelism", "validate_checkpoint_config"]


def validate_checkpoint_config(cfg: CheckpointConfig, world_size: int) -> None:
    """The checkpoint options' checks that need the world size (a seed runs on one process); run
    before any process group exists."""
    if cfg.create_seed and world_size != 1:
        raise ConfigError(
            f"checkpoint.create_seed=true runs on one process, but the world size is {world_size}; "
            "run it with `python trainer/main.py ... checkpoint.create_seed=true` (or --nproc_per_node=1)."
        )


def seed_parallelism(parallelism: ParallelismConfig) -> ParallelismConfig:
    """The layout a seed checkpoint is built in: one process, nothing sharded (the preset's
    degrees are for the real run, which then loads the seed under any layout)."""
    return dataclasses.replace(parallelism, dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=1, ep=1)


def check_seed_folder(folder: str) -> None:
    """A seed starts a run: refuse to write one into a checkpoint folder that already holds steps."""
    steps = complete_steps(folder)
    if steps:
        raise ConfigError(
            f"checkpoint.create_seed=true but {folder} already holds checkpoints "
            f"{steps}; use a fresh job.dump_folder (or checkpoint.folder)."
        )
