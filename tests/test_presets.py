"""Every experiment preset composes and validates at its intended world size."""

from __future__ import annotations

import glob
import os
import re

import pytest
import torch

from models.llama import Transformer, num_params
from parallelisms.parallel_dims import ParallelDims
from parallelisms.pipeline_parallel import validate_pp
from tests.configs import CONFIG_DIR, make_config
from tests.models.test_llama import PUBLISHED

EXPERIMENTS = sorted(
    os.path.basename(p)[:-5] for p in glob.glob(os.path.join(CONFIG_DIR, "experiment", "*.yaml"))
)

def intended_world_size(name: str) -> int:
    with open(os.path.join(CONFIG_DIR, "experiment", f"{name}.yaml"), encoding="utf-8") as f:
        match = re.search(r"intended world size:\s*(\d+)", f.read())
    assert match, f"experiment/{name}.yaml must state '# intended world size: N'"
    return int(match.group(1))


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_experiment_composes_and_validates(name: str) -> None:
    cfg = make_config(f"+experiment={name}")
    world = intended_world_size(name)
    p = cfg.parallelism
    dims = ParallelDims(p.dp_replicate, p.dp_shard, p.cp, p.tp, p.pp, p.ep, world)
    dims.validate_model(cfg.model, seq_len=cfg.training.seq_len, sequence_parallel=p.sequence_parallel)
    accum = dims.grad_accum_steps(cfg.training.global_batch_size, cfg.training.micro_batch_size)
    assert accum >= 1
    validate_pp(
        cfg.model, p, pp=dims.pp, local_batch_size=cfg.training.global_batch_size // dims.dp,
        micro_batch_size=cfg.training.micro_batch_size,
    )  # fmt: skip
    assert dims.dp * dims.cp * dims.tp * dims.pp == world
    with torch.device("meta"):
        model = Transformer(cfg.model)
    n = num_params(model)
    if cfg.model.name in PUBLISHED:
        assert abs(n - PUBLISHED[cfg.model.name]) / PUBLISHED[cfg.model.name] < 0.02


def test_experiment_list_is_not_empty() -> None:
    assert {"debug", "38m_ddp", "7b_fsdp", "7b_hsdp"} <= set(EXPERIMENTS)
