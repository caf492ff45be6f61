"""One trained debug checkpoint for the evaluation tests (session scope): the debug model trained a
few steps on the built-in corpus by the Trainer (scoring the shipped tasks and a named validation
set at its last step), with a DCP checkpoint, the final weights saved as a HF folder by the running
job (``checkpoint.last_save_in_hf``) and the checkpoint exported by ``python -m trainer.export_hf``."""

from __future__ import annotations

import os
from dataclasses import dataclass

import pytest

from tests.configs import make_config

DEBUG_RUN = (
    "+experiment=debug",
    "training.steps=30",
    "training.seq_len=128",
    "training.global_batch_size=8",
    "training.micro_batch_size=8",
    "training.eval_freq=30",
    "training.eval_steps=2",
    "eval.tasks=[next_line,complete_word]",  # scored at the last step (eval.freq=0 follows eval_freq)
    "eval.limit=6",
    "+eval.validation.stdlib={source:builtin,steps:2}",
    "lr_scheduler.warmup_steps=5",
    "metrics.log_freq=10",
    "metrics.tensorboard=true",
    "checkpoint.interval=1000",
    "checkpoint.last_save_in_hf=true",
)


@dataclass
class DebugRun:
    folder: str  # the run folder
    checkpoint: str  # checkpoints/step-30 (DCP)
    hf_from_run: str  # checkpoints/step-30-hf (written by the running job)
    hf_exported: str  # written by python -m trainer.export_hf


@pytest.fixture(scope="session")
def debug_run(tmp_path_factory: pytest.TempPathFactory) -> DebugRun:
    from trainer.export_hf import main as export_main
    from trainer.train import Trainer

    folder = str(tmp_path_factory.mktemp("debug_eval_run"))
    trainer = Trainer(make_config(*DEBUG_RUN, f"job.dump_folder={folder}"))
    try:
        trainer.train()
    finally:
        trainer.close()
    checkpoint = os.path.join(folder, "checkpoints", "step-30")
    exported = os.path.join(folder, "hf_exported")
    assert export_main([checkpoint, exported]) == 0
    return DebugRun(folder, checkpoint, os.path.join(folder, "checkpoints", "step-30-hf"), exported)
