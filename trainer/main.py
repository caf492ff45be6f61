"""Hydra entry point: ``torchrun trainer/main.py +experiment=NAME key=value ...``.

Exit status of each rank: 0 done; 2 bad config (before any collective); 3 training stopped
(e.g. a non-finite loss, every rank together); 4 a collective failed or timed out (the report
names the step and the collective); 75 preempted by SIGTERM/SIGUSR1 after writing a
checkpoint (run the same command again to resume); anything else: a crash.
"""

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
from trainer.comm import EXIT_COMM_FAILURE, describe_comm_failure, is_comm_failure  # noqa: E402
from trainer.config import register_configs, to_train_config  # noqa: E402
from trainer.preemption import EXIT_PREEMPTED, Preempted  # noqa: E402
from trainer.train import Trainer, TrainingError  # noqa: E402

register_configs()


def run(dcfg: DictConfig) -> None:
    """Convert, validate, train. Bad input exits with code 2 and a one-paragraph message."""
    rank = os.environ.get("RANK", "0")
    trainer = None
    try:
        cfg = to_train_config(dcfg)
        trainer = Trainer(cfg)
        try:
            trainer.train()
        except Exception as e:
            if is_comm_failure(e):
                _exit_comm_failure(e, trainer, rank)
            raise
        trainer.close()
    except ConfigError as e:
        print(f"[rank{rank}] config error: {e}", file=sys.stderr, flush=True)
        _close(trainer)
        sys.exit(2)
    except TrainingError as e:
        print(f"[rank{rank}] training stopped: {e}", file=sys.stderr, flush=True)
        _close(trainer)
        sys.exit(3)
    except Preempted as e:
        print(f"[rank{rank}] {e} (exit status {EXIT_PREEMPTED})", file=sys.stderr, flush=True)
        _close(trainer)
        sys.exit(EXIT_PREEMPTED)
    except Exception as e:
        if is_comm_failure(e):  # e.g. the init timeout while building the trainer
            _exit_comm_failure(e, trainer, rank)
        _close(trainer)
        raise


def _close(trainer: Trainer | None) -> None:
    if trainer is not None:
        trainer.close()


def _exit_comm_failure(exc: BaseException, trainer: Trainer | None, rank: str) -> None:
    """Report which step and collective failed, then leave at once: the process group is broken,
    so the usual teardown (checkpoint barrier, destroy) could block on the same peers."""
    report = describe_comm_failure(exc, getattr(trainer, "comm", None), int(rank))
    print(f"[rank{rank}] {report}", file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(EXIT_COMM_FAILURE)


@hydra.main(version_base="1.3", config_path="../configs", config_name="train")
def main(dcfg: DictConfig) -> None:
    run(dcfg)


if __name__ == "__main__":
    main()
