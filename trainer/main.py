"""Hydra entry point: ``torchrun trainer/main.py +experiment=NAME key=value ...`` from a checkout,
``torchrun -m trainer.main ...`` (or ``python -m trainer.main ...``) anywhere, e.g. from a wheel.

Exit status of each rank: 0 done; 2 bad config (before any collective); 3 training stopped
(e.g. a non-finite loss, every rank together); 4 a collective failed or timed out (the report
names the step and the collective); 74 a checkpoint could not be written because its disk is
full (the partial folder is removed; the message names the folder, the bytes needed and free,
and the newest intact checkpoint); 75 preempted by SIGTERM/SIGUSR1 after writing a
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
from omegaconf.errors import OmegaConfBaseException  # noqa: E402

from models.errors import ConfigError  # noqa: E402
from trainer.checkpoint.space import EXIT_DISK_FULL, CheckpointDiskFull  # noqa: E402
from trainer.config import (  # noqa: E402
    CONFIG_DIR,
    TrainConfig,
    compose_dict,
    config_error,
    register_configs,
    to_train_config,
)
from trainer.resilience.preemption import EXIT_PREEMPTED, Preempted  # noqa: E402
from trainer.resilience.watchdog import EXIT_COMM_FAILURE, describe_comm_failure, is_comm_failure  # noqa: E402
from trainer.train import Trainer, TrainingError  # noqa: E402

register_configs()


def run(dcfg: DictConfig) -> None:
    """Convert, validate, train. Bad input exits with code 2 and a one-paragraph message."""
    rank = os.environ.get("RANK", "0")
    trainer = None
    try:
        cfg = _typed(dcfg)
        trainer = Trainer(cfg)
        try:
            trainer.train()
        except Exception as e:
            if is_comm_failure(e):
                _exit_comm_failure(e, trainer, rank)
            raise
        trainer.close()
        if trainer.ft is not None:
            # torchft's native parts (manager server, lighthouse client, its gloo groups) take 5-10 s
            # to tear down at interpreter exit; everything is written and closed: leave now.
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)
    except ConfigError as e:
        print(f"[rank{rank}] config error: {e}", file=sys.stderr, flush=True)
        _close(trainer)
        sys.exit(2)
    except TrainingError as e:
        print(f"[rank{rank}] training stopped: {e}", file=sys.stderr, flush=True)
        _close(trainer)
        sys.exit(3)
    except CheckpointDiskFull as e:
        print(f"[rank{rank}] {e} (exit status {EXIT_DISK_FULL})", file=sys.stderr, flush=True)
        if e.in_lockstep:
            _close(trainer)
            sys.exit(EXIT_DISK_FULL)
        sys.stdout.flush()  # async save: the other ranks may be inside a collective; no teardown
        os._exit(EXIT_DISK_FULL)
    except Preempted as e:
        print(f"[rank{rank}] {e} (exit status {EXIT_PREEMPTED})", file=sys.stderr, flush=True)
        _close(trainer)
        sys.exit(EXIT_PREEMPTED)
    except Exception as e:
        if is_comm_failure(e):  # e.g. the init timeout while building the trainer
            _exit_comm_failure(e, trainer, rank)
        _close(trainer)
        raise


def _typed(dcfg: DictConfig) -> TrainConfig:
    try:
        return to_train_config(dcfg)
    except OmegaConfBaseException as e:  # e.g. an interpolation that names no key
        raise config_error(e) from e


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


@hydra.main(version_base="1.3", config_path=CONFIG_DIR, config_name="train")
def _hydra_main(dcfg: DictConfig) -> None:
    run(dcfg)


def main(argv: list[str] | None = None) -> None:
    """Compose the overrides once up front, so that an unknown preset or key, a wrong type or a
    syntax error exits with status 2 and one line (Hydra itself would exit 1), then hand over to
    Hydra's entry point, whose flags (``--cfg job``, ``--help``, ...) work as usual."""
    from hydra._internal.utils import get_args_parser

    if argv is not None:
        sys.argv = [sys.argv[0], *argv]
    args = get_args_parser().parse_args(sys.argv[1:])  # an unknown flag: argparse's usage, status 2
    own_config = args.config_path or args.config_name or args.config_dir
    if not (args.help or args.hydra_help or args.info or args.shell_completion or own_config):
        try:
            compose_dict(*args.overrides)
        except ConfigError as e:
            print(f"[rank{os.environ.get('RANK', '0')}] config error: {e}", file=sys.stderr, flush=True)
            sys.exit(2)
    _hydra_main()


if __name__ == "__main__":
    main()
