"""Resharding: a checkpoint written under one layout loads under another.

Each source runs 5 steps of an 8-step schedule, checkpointing at step 4. Each target starts
from that step-4 checkpoint (``checkpoint.initial_load_path``, full state) under another
layout, and must

* hold, gathered to full form, exactly (bitwise) the model and optimizer tensors stored in
  the checkpoint, which are the source's;
* resume the data at global sample 32 whatever its dp degree (no duplicates, no gaps);
* produce the source's step-5 loss and pre-clip gradient norm (to 1e-5 relative: the layouts
  reduce in another order), with clipping off so the restored state alone decides the step.

Spawns are grouped by world size: sources at 4 ranks, then sources and targets at 2 ranks,
then the single-process target.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from tests.configs import NO_CLIP, tiny_config
from tests.dist import run_distributed
from tests.parity import assert_parity
from trainer.checkpoint.checkpointer import load_full_state
from trainer.config import TrainConfig

pytestmark = pytest.mark.slow

DDP = ["parallelism.dp_replicate=2", "parallelism.dp_shard=1"]
ZERO1 = ["parallelism.dp_shard=1", "parallelism.ddp.sharded_optimizer=true"]
SOURCES = {  # name -> (world, overrides)
    "fsdp_x4": (4, ["parallelism.dp_shard=4"]),
    "zero1_x4": (4, ["parallelism.dp_replicate=4", *ZERO1]),
    "fsdp_x2": (2, ["parallelism.dp_shard=2"]),
    "torch_ddp_x2": (2, [*DDP, "parallelism.ddp.impl=torch"]),
    "tp_x2": (2, ["parallelism.tp=2", "parallelism.dp_shard=1"]),
    "hsdp_2x2": (4, ["parallelism.dp_replicate=2", "parallelism.dp_shard=2"]),
    "pp_x2": (2, ["parallelism.pp=2", "parallelism.dp_shard=1"]),
}
PAIRS = {  # target name -> (source, world, overrides)
    "fsdp_x4->fsdp_x2": ("fsdp_x4", 2, ["parallelism.dp_shard=2"]),
    "fsdp_x2->zero1_x2": ("fsdp_x2", 2, ["parallelism.dp_replicate=2", *ZERO1]),
    "zero1_x4->zero1_x2": ("zero1_x4", 2, ["parallelism.dp_replicate=2", *ZERO1]),
    "tp_x2->fsdp_x2": ("tp_x2", 2, ["parallelism.dp_shard=2"]),
    "hsdp_2x2->zero1_x2": ("hsdp_2x2", 2, ["parallelism.dp_replicate=2", *ZERO1]),
    "pp_x2->single": ("pp_x2", 1, []),
    "torch_ddp_x2->single": ("torch_ddp_x2", 1, []),
}
COMMON = ["checkpoint.interval=4", NO_CLIP]


def _full_state(trainer) -> dict[str, torch.Tensor]:
    """Model + optimizer tensors of any layout, gathered to full form on every rank (collective)."""
    from trainer.checkpoint.contents import ModelState, OptimizerState

    parts = trainer.model_parts
    flat = {f"model.{k}": v for k, v in ModelState(parts).state_dict().items()}
    flat.update(
        {f"optimizer.{k}": v for k, v in OptimizerState(parts, trainer.optimizer).state_dict().items()}
    )
    local = {}
    for key in sorted(flat):  # same DTensor keys in the same order on every rank
        value = flat[key]
        if isinstance(value, DTensor):
            value = value.full_tensor()
        if isinstance(value, torch.Tensor):
            local[key] = value.detach().cpu().clone()
    parts: list = [None] * dist.get_world_size()
    dist.all_gather_object(parts, local)  # ZeRO-1: each rank holds its own parameters' state
    merged: dict[str, torch.Tensor] = {}
    for part in parts:
        for key, value in part.items():
            assert key not in merged or torch.equal(merged[key], value), key
            merged[key] = value
    return merged


def _step5(history: list[dict]) -> dict:
    return [r for r in history if r.get("step") == 5 and "loss" in r][0]


def _source_config(tmp: str, name: str) -> TrainConfig:
    _, overrides = SOURCES[name]
    return tiny_config(os.path.join(tmp, name), "checkpoint.enable=true", *COMMON, *overrides)


def _target_config(tmp: str, name: str) -> TrainConfig:
    source, _, overrides = PAIRS[name]
    path = os.path.join(tmp, source, "checkpoints", "step-4")
    return tiny_config(
        os.path.join(tmp, name.replace("->", "_to_")),
        *COMMON,
        *overrides,
        f"checkpoint.initial_load_path={path}",
        "checkpoint.initial_load_model_only=false",
    )


def _source(cfg: TrainConfig) -> dict:
    from trainer.train import Trainer

    trainer = Trainer(cfg)
    history = trainer.train(until_step=5)
    trainer.close()
    return _step5(history)


def _target(cfg: TrainConfig) -> dict:
    from trainer.train import Trainer

    path = cfg.checkpoint.initial_load_path
    trainer = Trainer(cfg)
    got = _full_state(trainer)
    want = {f"model.{k}": v for k, v in load_full_state(path, "model.").items()}
    want.update({f"optimizer.{k}": v for k, v in load_full_state(path, "optimizer.").items()})
    mismatched = sorted(
        k
        for k in want.keys() | got.keys()
        if k not in got or k not in want or not torch.equal(got[k], want[k])
    )
    step, samples = trainer.state.step, trainer.train_loader.samples_seen
    history = trainer.train(until_step=5)
    trainer.close()
    return {
        "mismatched": mismatched,
        "num_tensors": len(want),
        "step": step,
        "samples": samples,
        "step5": _step5(history),
    }


def _worker(
    rank: int, world_size: int, sources: dict[str, TrainConfig], targets: dict[str, TrainConfig]
) -> dict:
    out = {name: _source(cfg) for name, cfg in sources.items()}
    out.update({name: _target(cfg) for name, cfg in targets.items()})
    return out


def test_reshard_across_layouts(tmp_path) -> None:
    tmp = str(tmp_path)
    results: dict = {}
    for world in (4, 2, 1):
        # Configs composed here once, not on every rank.
        sources = {n: _source_config(tmp, n) for n, (w, _) in SOURCES.items() if w == world}
        targets = {n: _target_config(tmp, n) for n, (_, w, _) in PAIRS.items() if w == world}
        if sources or targets:
            per_rank = run_distributed(_worker, world, sources, targets, timeout=1200)
            results.update(per_rank[0])
    report = []
    for name, (source, _, _) in PAIRS.items():
        r = results[name]
        assert r["mismatched"] == [], (name, r["mismatched"][:5])
        assert r["num_tensors"] > 100 and r["step"] == 4 and r["samples"] == 4 * 8, (name, r)
        rel = assert_parity([results[source]], [r["step5"]], label=f"{name} step 5")
        report.append(
            f"{name}: {r['num_tensors']} tensors, step-5 rel diff loss {rel['loss']:.1e}, "
            f"grad norm {rel['grad_norm']:.1e}"
        )
    print("\n".join(report))
