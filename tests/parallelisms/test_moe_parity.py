"""MoE layouts train the same model as one process (fp32, CPU, gloo), and EP checkpoints resume
exactly and reshard.

A tiny MoE (moe_debug shrunk: 4 layers, the first dense, 8 experts top-2, one shared expert,
q/k head norms) runs 4 optimizer steps (``PARITY_STEPS``) through the real Trainer under each
layout; losses and pre-clip gradient norms must equal the single-process run's to 1e-5 relative
(measured ~1e-7: only reduction order differs; routing is identical). Config ``B`` adds
aux-loss-free expert bias, a sequence-wise aux loss and ``grad_clip=0``. Spawns are grouped by
world size (one process group runs several Trainers), and the tests below assert on the cached
results.
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.configs import PARITY_STEPS, tiny_config
from tests.dist import run_distributed
from trainer.config import TrainConfig

pytestmark = pytest.mark.slow

RTOL = 1e-5
MOE = [
    PARITY_STEPS,
    "model=moe_debug",
    "model.moe_hidden_dim=64",
    "model.first_k_dense=1",
    "model.num_shared_experts=1",
    "model.qk_norm=true",
]
CONFIGS = {
    "A": MOE,
    "B": [
        *MOE,
        "model.bias_update_coeff=0.01",
        "model.aux_loss_coeff=0.01",
        "model.aux_loss_type=sequence",
        "training.grad_clip=0",
        "training.deterministic=true",
    ],
}
EP2 = ["parallelism.ep=2", "parallelism.dp_shard=2"]
DDP2 = ["parallelism.dp_replicate=2", "parallelism.dp_shard=1"]
LAYOUTS = {  # name -> (world, config, overrides)
    "ep2": (2, "A", EP2),
    "ep2_bias_aux_noclip": (2, "B", [*EP2, "checkpoint.enable=true", "checkpoint.interval=2"]),
    "fsdp2": (2, "A", ["parallelism.dp_shard=2"]),
    "custom_ddp2": (2, "A", DDP2),
    "ep2_fsdp2": (4, "A", ["parallelism.ep=2", "parallelism.dp_shard=4"]),
    "ep2_tp2": (4, "A", [*EP2, "parallelism.tp=2"]),
    "ep2_pp2": (4, "A", [*EP2, "parallelism.pp=2"]),
    "ep2_hsdp2x2": (4, "A", [*EP2, "parallelism.dp_replicate=2"]),
}
SOURCE = "ep2_bias_aux_noclip"  # its step-2 checkpoint is resumed (EP x 2) and resharded (FSDP x 2)
RESUMES = {"resume_ep2": EP2, "reshard_ep2_to_fsdp2": ["parallelism.dp_shard=2"]}


def _records(history: list[dict]) -> list[tuple[float, float]]:
    return [(r["loss"], r["grad_norm"]) for r in history if "loss" in r]


def _biases(trainer) -> dict[str, list[float]]:
    """Plain lists: tensors would travel between processes through shared memory."""
    return {
        f"{name}.expert_bias": moe.expert_bias.tolist()
        for part in trainer.model_parts
        for name, moe in trainer.spec.moe_layers(part)
    }


def _train(cfg: TrainConfig) -> dict:
    from trainer.train import Trainer

    trainer = Trainer(cfg)
    history = trainer.train()
    out = {"records": _records(history), "first": history[0], "last": history[-1], "biases": _biases(trainer)}
    trainer.close()
    return out


def _resume(cfg: TrainConfig) -> dict:
    from trainer.checkpoint.checkpointer import load_full_state
    from trainer.train import Trainer

    path = cfg.checkpoint.initial_load_path
    trainer = Trainer(cfg)
    saved = {k: v.tolist() for k, v in load_full_state(path, "model.").items() if k.endswith("expert_bias")}
    loaded = _biases(trainer)
    step = trainer.state.step
    history = trainer.train()
    trainer.close()
    return {"records": _records(history), "step": step, "saved_biases": saved, "loaded_biases": loaded}


def _configs(tmp: str, runs: list[str], resumes: list[str]) -> dict[str, tuple[str, TrainConfig]]:
    """name -> ("train" or "resume", config): one launch's runs, composed in the test process."""
    out = {}
    for name in runs:
        config, folder, overrides = (
            (name, f"ref_{name}", []) if name in CONFIGS else (LAYOUTS[name][1], name, LAYOUTS[name][2])
        )
        out[name] = ("train", tiny_config(os.path.join(tmp, folder), *CONFIGS[config], *overrides))
    path = os.path.join(tmp, SOURCE, "checkpoints", "step-2")
    for name in resumes:
        out[name] = (
            "resume",
            tiny_config(
                os.path.join(tmp, name),
                *CONFIGS["B"],
                *RESUMES[name],
                f"checkpoint.initial_load_path={path}",
                "checkpoint.initial_load_model_only=false",
            ),
        )
    return out


def _worker(rank: int, world_size: int, cfgs: dict[str, tuple[str, TrainConfig]]) -> dict:
    return {name: (_train if kind == "train" else _resume)(cfg) for name, (kind, cfg) in cfgs.items()}


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    tmp = str(tmp_path_factory.mktemp("moe"))
    out = run_distributed(_worker, 1, _configs(tmp, list(CONFIGS), []))[0]
    two = [n for n, (w, _, _) in LAYOUTS.items() if w == 2]
    out.update(run_distributed(_worker, 2, _configs(tmp, two, list(RESUMES)))[0])
    out.update(
        run_distributed(_worker, 4, _configs(tmp, [n for n, (w, _, _) in LAYOUTS.items() if w == 4], []))[0]
    )
    return out


def _max_rel(records: list[tuple[float, float]], ref: list[tuple[float, float]]) -> tuple[float, float]:
    loss = max(abs(a[0] - b[0]) / abs(b[0]) for a, b in zip(records, ref))
    norm = max(abs(a[1] - b[1]) / abs(b[1]) for a, b in zip(records, ref))
    return loss, norm


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_moe_layout_matches_single_process(layout: str, results: dict) -> None:
    _, config, _ = LAYOUTS[layout]
    ref, got = results[config]["records"], results[layout]["records"]
    assert len(got) == len(ref) == 4 and ref[-1][0] < ref[0][0]
    loss_rel, norm_rel = _max_rel(got, ref)
    print(
        f"{layout}: max relative difference vs 1 process over 4 steps: loss {loss_rel:.1e}, grad norm "
        f"{norm_rel:.1e}"
    )
    assert loss_rel < RTOL and norm_rel < RTOL, (layout, got, ref)
    # Tokens per expert are all-reduced to the same global counts in every layout (pp included: its
    # stages have static shapes, so no extra forward runs on step 1).
    for record in ("first", "last"):
        want = results[config][record]["moe_tokens_per_expert"]
        assert results[layout][record]["moe_tokens_per_expert"] == want, (layout, record)
    if config == "B":  # the bias moved, identically in both runs
        for key, bias in results["B"]["biases"].items():
            assert any(bias)
            torch.testing.assert_close(
                torch.tensor(results[layout]["biases"][key]), torch.tensor(bias), rtol=0, atol=1e-6
            )


def test_moe_metrics_are_logged(results: dict) -> None:
    last = results["ep2_bias_aux_noclip"]["last"]
    assert last["aux_loss"] > 0 and last["moe_imbalance_max"] >= 1.0
    assert set(last["moe_tokens_per_expert"]) == {"layers.1", "layers.2", "layers.3"}
    # Every token picks top_k = 2 experts: 8 sequences x 32 tokens x 2 per layer and step.
    assert all(sum(c) == 8 * 32 * 2 for c in last["moe_tokens_per_expert"].values())
    assert results["A"]["last"]["aux_loss"] is None


@pytest.mark.parametrize("name", list(RESUMES))
def test_ep_checkpoint_resumes_and_reshards(name: str, results: dict) -> None:
    straight, r = results[SOURCE]["records"], results[name]
    assert r["step"] == 2 and len(r["saved_biases"]) == 3
    for key, saved in r["saved_biases"].items():  # the expert bias is part of the checkpoint
        assert any(saved) and r["loaded_biases"][key] == saved, key
    if name == "resume_ep2":  # same layout: bitwise
        assert r["records"] == straight[2:], (r["records"], straight[2:])
    rel = abs(r["records"][0][0] - straight[2][0]) / straight[2][0]
    print(f"{name}: step-3 loss relative difference {rel:.1e}")
    assert rel < RTOL
