"""Hydra entry point: ``torchrun trainer/main.py +experiment=NAME key=value ...``."""

from __future__ import annotations

import os
import sys

# Run as a script, Python puts trainer/ first on sys.path, where data.py or config.py
# could shadow other packages' modules; use the repository root instead.
_HERE = os.path.dirname(os.path.abspath(__file__))
if sys.path and os.path.abspath(sys.path[0]) == _HERE:
    sys.path[0] = os.path.dirname(_HERE)

import hydra  # noqa: E402
from omegaconf import DictConfig  # noqa: E402

from models.errors import ConfigError  # noqa: E402
from trainer.config import register_configs, to_train_config  # noqa: E402
from trainer.train import Trainer, TrainingError  # noqa: E402

register_configs()


def run(dcfg: DictConfig) -> None:
    """Convert, validate, train. Bad input exits with code 2 and a one-paragraph message."""
    rank = os.environ.get("RANK", "0")
    try:
        cfg = to_train_config(dcfg)
        trainer = Trainer(cfg)
        try:
            trainer.train()
        finally:
            trainer.close()
    except ConfigError as e:
        print(f"[rank{rank}] config error: {e}", file=sys.stderr, flush=True)
        sys.exit(2)
    except TrainingError as e:
        print(f"[rank{rank}] training stopped: {e}", file=sys.stderr, flush=True)
        sys.exit(3)


@hydra.main(version_base="1.3", config_path="../configs", config_name="train")
def main(dcfg: DictConfig) -> None:
    run(dcfg)


if __name__ == "__main__":
    main()
