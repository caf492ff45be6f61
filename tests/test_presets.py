"""Every experiment preset composes and validates at its intended world size."""

from __future__ import annotations

import glob
import os

import pytest
import torch

from models import get_spec
from tests.configs import CONFIG_DIR, make_config
from tests.models.test_llama import PUBLISHED
from trainer.planner.context import dims_of
from trainer.rehearse import intended_world_size

EXPERIMENTS = sorted(
    os.path.basename(p)[:-5] for p in glob.glob(os.path.join(CONFIG_DIR, "experiment", "*.yaml"))
)


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_experiment_composes_and_validates(name: str) -> None:
    cfg = make_config(f"+experiment={name}")
    world = intended_world_size(name)
    t = cfg.training
    spec = get_spec(cfg.model.family)
    dims = dims_of(cfg, world)
    assert dims.grad_accum_steps(t.global_batch_size, t.micro_batch_size) >= 1
    assert dims.dp * dims.cp * dims.tp * dims.pp == world
    with torch.device("meta"):
        model = spec.build(cfg.model)
    n = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    assert n == spec.param_counts(cfg.model).total
    if cfg.model.name in PUBLISHED:
        assert abs(n - PUBLISHED[cfg.model.name]) / PUBLISHED[cfg.model.name] < 0.02
    # What the spec declares (the trainer's config checks read it) is what the model builds.
    names = [name for name, _ in model.named_parameters()]  # k_norm: MLA has a q_norm of its latent only
    assert spec.qk_norm(cfg.model) == any(name.endswith("attention.k_norm.weight") for name in names)
    experts = {m.w1.shape[0] for m in spec.expert_modules(model)} if spec.has_experts else {0}
    assert experts == {spec.num_experts(cfg.model)}


def test_experiment_list_is_not_empty() -> None:
    assert {"debug", "38m_ddp", "7b_fsdp", "7b_hsdp"} <= set(EXPERIMENTS)


# -- every CPU-sized preset trains, through the CLI, at its intended world size ----------------

# ``debug`` itself is trained by tests/trainer/test_cli.py (./launch.sh, 2 ranks, 8 steps), ``qwen3_debug``
# by tests/models/test_qwen3.py (./launch.sh, 12 steps) and ``deepseek_v3_debug`` by
# tests/models/test_deepseek_v3.py (./launch.sh, 2 ranks, 12 steps).
CPU_PRESETS = [
    name
    for name in EXPERIMENTS
    if "debug" in name and name not in ("debug", "qwen3_debug", "deepseek_v3_debug")
]


@pytest.mark.slow
@pytest.mark.parametrize("name", CPU_PRESETS)
def test_cpu_preset_trains_at_its_intended_world_size(name: str, tmp_path) -> None:
    """``torchrun --nproc_per_node=<intended> trainer/main.py +experiment=<name>`` on the built-in
    corpus (its real, long documents), 2 steps and an evaluation: finite losses, exit 0."""
    import json
    import math
    import subprocess

    from tests.configs import REPO

    world = intended_world_size(name)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        env.pop(key, None)
    cmd = [
        "torchrun",
        "--standalone",
        f"--nproc_per_node={world}",
        "trainer/main.py",
        f"+experiment={name}",
        "training.steps=2",
        "training.eval_freq=2",
        "training.eval_steps=1",
        "metrics.log_freq=1",
        "metrics.tensorboard=false",
        f"job.dump_folder={tmp_path}",
    ]
    res = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-4000:]
    assert "Traceback" not in out and "Warning: Environment variable" not in out, out[-4000:]
    with open(tmp_path / "metrics.jsonl", encoding="utf-8") as f:
        records = [json.loads(line) for line in f]
    losses = [r["loss"] for r in records if "loss" in r]
    evals = [r["eval_loss"] for r in records if "eval_loss" in r]
    print(f"{name} on {world} ranks: losses {losses}, eval {evals}")
    assert len(losses) == 2 and all(math.isfinite(x) for x in losses)
    assert len(evals) == 1 and math.isfinite(evals[0])
