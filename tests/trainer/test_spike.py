"""Loss-spike skipping (``training.spike``, trainer/stability.py).

A poisoned batch is injected by a test-only loader wrapper (:func:`inject`): at the chosen reads its
labels are replaced by one token id and the output head's logits of that forward are scaled by
``POISON_SCALE`` through a forward hook, so the loss jumps by two orders of magnitude (~6 -> ~600 on the
tiny run). The same wrapper in ``drop`` mode discards those batches instead (it reads the next one):
from the poisoned step on, a run that skips the poisoned batch must equal, bitwise and in the same
layout, the run whose loader never delivered it -- weights, AdamW/Muon moments and step counts, LR.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import shutil

import pytest
import torch

from models.errors import ConfigError
from tests.configs import tiny_config
from tests.dist import run_distributed
from tests.parity import Case, GroupedRuns, gather_cases, step_metrics, train_case
from trainer.config import SpikeConfig
from trainer.stability import SpikeWindow

POISON_SCALE = 100.0
POISON_LABEL = 7
SPIKE = ("training.spike.enable=true", "training.spike.window=8", "training.spike.warmup=4")
STEPS = "training.steps=7"
POISONED = (6,)  # the 6th batch read: the 6th step
# the per-step extras' figures, compared bitwise too where a run logs them
FAMILY_FIGURES = ("aux_loss", "moe_imbalance_max", "mtp_loss", "qk_max_logit", "qk_clipped_heads")
MOE = ("model=moe_debug", "model.moe_hidden_dim=64", "optimizer.qk_clip_tau=2")  # expert bias, QK-clip
MTP = ("model=deepseek_v3_debug", "model.n_kv_heads=null", "model.moe_hidden_dim=64", "model.mtp_depth=1")


class _Buffers:
    """Test-only hook: the model's buffers (MoE expert bias, ...) after the last applied step."""

    def __init__(self, trainer, out: dict) -> None:
        self.trainer, self.out = trainer, out

    def after_optimizer_step(self, state) -> None:
        for part in self.trainer.model_parts:
            for name, b in part.named_buffers():
                self.out[name] = b.detach().clone()


def inject(trainer, reads: tuple[int, ...], mode: str) -> dict:
    """Test-only: poison (``mode="poison"``) or drop (``"drop"``) the batches read ``reads``-th (1-based)
    by the training loader; returns the model's buffers after the last applied step (``observed``)."""
    from trainer.hooks import StepHooks

    buffers: dict = {}
    trainer.hooks = StepHooks([*trainer.hooks.hooks, _Buffers(trainer, buffers)])
    loader, head = trainer.train_loader, None
    next_batch, poisoned, count = loader.next_batch, {"now": False}, {"n": 0}
    for part in trainer.model_parts:
        head = dict(part.named_modules()).get(trainer.spec.last_modules[-1], head)

    def read():
        count["n"] += 1
        batch = next_batch()
        poisoned["now"] = count["n"] in reads and mode == "poison"
        if count["n"] in reads and mode == "drop":
            count["n"] += 1
            batch = next_batch()
        if poisoned["now"]:
            batch = dataclasses.replace(batch, labels=torch.full_like(batch.labels, POISON_LABEL))
        return batch

    loader.next_batch = read
    if head is not None:  # a pipeline stage without the head: the last stage scales
        head.register_forward_hook(lambda m, i, out: out * POISON_SCALE if poisoned["now"] else None)
    return buffers


def _case(world: int, folder: str, mode: str, *overrides: str, reads: tuple[int, ...] = POISONED) -> Case:
    cfg = tiny_config(folder, STEPS, *SPIKE, *overrides)
    return Case(world, cfg, setup=functools.partial(inject, reads=reads, mode=mode))


def _skips(history: list[dict]) -> list[dict]:
    return [r for r in history if r.get("skipped")]


def assert_skipped_equals_dropped(poisoned: dict, dropped: dict, label: str) -> None:
    """The poisoned run skipped exactly the poisoned step and then equals the dropped run bitwise."""
    skips = _skips(poisoned["history"])
    assert [r["step"] for r in skips] == list(POISONED), f"{label}: skipped steps {skips}"
    first = poisoned["history"][0]  # the poisoned step's loss or grad norm: > 30 x step 1's
    jump = max(skips[0]["spike/loss"] / first["loss"], skips[0]["spike/grad_norm"] / first["grad_norm"])
    assert jump > 30, f"{label}: {skips[0]}"
    assert not _skips(dropped["history"]), f"{label}: the dropped run skipped {_skips(dropped['history'])}"
    figures = (
        "loss",
        "grad_norm",
        "lr",
        *(k for k in FAMILY_FIGURES if dropped["history"][-1].get(k) is not None),
    )
    got = step_metrics(poisoned["history"], figures)
    ref = step_metrics(dropped["history"], figures)
    assert got == ref, f"{label}: per-step figures differ\n{got}\n{ref}"  # bitwise, every step
    for rank, (a, b) in enumerate(zip(poisoned["observed"], dropped["observed"], strict=True)):
        assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a), (
            f"{label}: rank {rank} buffers"
        )
    assert sorted(poisoned["params"]) == sorted(dropped["params"])
    for name, t in dropped["params"].items():
        assert torch.equal(poisoned["params"][name], t), f"{label}: final {name} differs"
    for rank, h in enumerate(poisoned["rank_histories"]):  # every rank skipped the same step
        assert [r["step"] for r in _skips(h)] == list(POISONED), f"{label}: rank {rank}"


# -- the rule ------------------------------------------------------------------------------------


def test_window_rule_warmup_threshold_and_state() -> None:
    """z = (value - mean) / std over the accepted window, upward only, after ``warmup`` steps;
    non-finite always skipped; the state round-trips."""
    w = SpikeWindow(SpikeConfig(enable=True, window=4, warmup=3, z_threshold=3.0))
    for loss, norm in ((2.0, 1.0), (2.2, 1.2)):
        assert w.judge(100.0, 100.0)["spike/reason"] == ""  # warm-up: not judged
        w.accept(loss, norm)
    assert "non-finite" in w.judge(math.nan, 1.0)["spike/reason"]
    w.accept(2.4, 1.4)
    mean, std = 2.2, math.sqrt(((0.2**2) * 2) / 3)
    verdict = w.judge(2.2 + 3.5 * std, 1.2)
    assert verdict["spike/z_loss"] == pytest.approx(3.5) and "loss" in verdict["spike/reason"]
    assert w.judge(mean - 10 * std, 1.2)["spike/reason"] == ""  # a falling loss is training
    assert "grad_norm" in w.judge(2.2, 1.2 + 4 * std)["spike/reason"]
    for _ in range(3):
        w.accept(5.0, 1.0)  # the window keeps the last 4 accepted steps
    assert list(w.losses) == [2.4, 5.0, 5.0, 5.0]
    w.reject()
    again = SpikeWindow(w.cfg)
    again.load_state_dict(w.state_dict())
    assert (
        again.state_dict()
        == w.state_dict()
        == {
            "losses": [2.4, 5.0, 5.0, 5.0],
            "grad_norms": [1.4, 1.0, 1.0, 1.0],
            "consecutive": 1,
            "skipped_total": 1,
        }
    )


@pytest.mark.parametrize(
    "override, message",
    [
        ("training.spike.warmup=1", "warmup"),
        ("training.spike.warmup=200", "warmup"),
        ("training.spike.z_threshold=0", "z_threshold"),
        ("training.spike.max_consecutive=0", "max_consecutive"),
    ],
)
def test_bad_spike_config(tmp_path, override: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        tiny_config(str(tmp_path), "training.spike.enable=true", override)


# -- one process ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def one_process(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    tmp = tmp_path_factory.mktemp("spike1")
    muon = ("optimizer=muon",)
    cases = {
        "poison": _case(1, str(tmp / "poison"), "poison"),
        "drop": _case(1, str(tmp / "drop"), "drop"),
        "muon_poison": _case(1, str(tmp / "muon_poison"), "poison", *muon),
        "muon_drop": _case(1, str(tmp / "muon_drop"), "drop", *muon),
        "moe_poison": _case(1, str(tmp / "moe_poison"), "poison", *MOE),
        "moe_drop": _case(1, str(tmp / "moe_drop"), "drop", *MOE),
        "mtp_poison": _case(1, str(tmp / "mtp_poison"), "poison", *MTP),
        "mtp_drop": _case(1, str(tmp / "mtp_drop"), "drop", *MTP),
    }
    return gather_cases(cases, world=1)


@pytest.mark.parametrize("run", ["adamw", "muon", "moe", "mtp"])
def test_skip_equals_dropped_batch_one_process(one_process: dict, run: str) -> None:
    """AdamW and Muon (moments, step counts), the MoE expert bias and QK-clip (moe with
    qk_clip_tau), DeepSeek-V3's MTP statistics: nothing of the skipped step remains."""
    prefix = "" if run == "adamw" else f"{run}_"
    assert_skipped_equals_dropped(one_process[f"{prefix}poison"], one_process[f"{prefix}drop"], run)


def test_no_false_alarm_on_a_normal_run(tmp_path) -> None:
    """The default rule (window 128, warm-up 20, z 6) skips nothing over 80 normal steps of the tiny run
    (the debug run's 300 steps: measured separately, see the README)."""
    cfg = tiny_config(str(tmp_path), "training.steps=80", "training.spike.enable=true", "metrics.log_freq=1")
    run = gather_cases({"run": Case(1, cfg, params=False)}, world=1)["run"]
    assert len(step_metrics(run["history"])) == 80 and not _skips(run["history"])
    assert run["history"][-1]["spike/skipped_total"] == 0
    judged = [r for r in run["history"] if "spike/z_loss" in r]
    assert [r["step"] for r in judged] == list(range(21, 81))  # after the 20-step warm-up
    worst = max(max(r["spike/z_loss"], r["spike/z_grad_norm"]) for r in judged)
    print(f"largest z over steps 21-80: {worst:.2f} (threshold 6)")


def test_skip_record_in_metrics_jsonl(one_process: dict, tmp_path_factory: pytest.TempPathFactory) -> None:
    """The skipped step is a record of its own: ``skipped`` and its figures, no ``loss`` key."""
    (skip,) = _skips(one_process["poison"]["history"])
    assert "loss" not in skip and skip["spike/consecutive"] == 1 and skip["spike/z_loss"] > 6
    assert skip["spike/reason"].startswith("loss")


def test_resume_keeps_the_window(tmp_path) -> None:
    """Checkpointed at step 4, resumed: the window (4 accepted steps = warmup) comes back, so the
    poisoned step 6 is skipped and the run ends as the uninterrupted one, bitwise."""
    ckpt = ("checkpoint.enable=true", "checkpoint.interval=4", "checkpoint.keep_latest=0")
    whole = gather_cases({"whole": _case(1, str(tmp_path / "whole"), "poison", *ckpt)}, world=1)["whole"]
    shutil.copytree(
        tmp_path / "whole" / "checkpoints" / "step-4", tmp_path / "resumed" / "checkpoints" / "step-4"
    )
    # the resumed run reads from the checkpoint's data position: its 2nd read is the 6th batch
    resumed = _case(1, str(tmp_path / "resumed"), "poison", *ckpt, reads=(2,))
    again = gather_cases({"resumed": resumed}, world=1)["resumed"]
    assert [r["step"] for r in _skips(again["history"])] == [6]
    got = step_metrics(again["history"], ("loss", "grad_norm", "lr"))
    ref = step_metrics(whole["history"], ("loss", "grad_norm", "lr"))
    assert got == {s: v for s, v in ref.items() if s > 4}
    for name, t in whole["params"].items():
        assert torch.equal(again["params"][name], t), name


def _stop_message(rank: int, world: int, case: Case) -> str:
    from trainer.train import TrainingError

    try:
        train_case(case)
    except TrainingError as e:
        return str(e)
    return "the run did not stop"


def test_consecutive_skips_stop_the_run(tmp_path) -> None:
    """``max_consecutive`` poisoned batches in a row stop the run, naming the step and the checkpoint."""
    ckpt = ("checkpoint.enable=true", "checkpoint.interval=4", "training.spike.max_consecutive=2")
    case = _case(1, str(tmp_path / "run"), "poison", *ckpt, reads=(6, 7))
    (message,) = run_distributed(_stop_message, 1, case)
    assert "2 consecutive steps were skipped" in message and "at step 6" in message, message
    assert os.path.join(str(tmp_path / "run"), "checkpoints", "step-4") in message, message


# -- layouts (2 ranks, one launch) ---------------------------------------------------------------

DDP = ("parallelism.dp_replicate=2", "parallelism.dp_shard=1")
LAYOUTS = {
    "ddp_x2": DDP,
    "zero1_x2": (*DDP, "parallelism.ddp.sharded_optimizer=true"),
    "fsdp_x2": ("parallelism.dp_shard=2",),
    "tp_x2": ("parallelism.tp=2", "parallelism.dp_shard=1"),  # loss parallel: vocab-sharded logits
    "pp_x2": ("parallelism.pp=2", "parallelism.dp_shard=1"),
    "cp_x2": ("parallelism.cp=2", "parallelism.dp_shard=1"),
    "ep_x2": (*MOE[:2], "parallelism.ep=2", "parallelism.dp_shard=2"),  # experts over ep, bias updates
}


@pytest.fixture(scope="module")
def layout_runs(tmp_path_factory: pytest.TempPathFactory) -> GroupedRuns:
    tmp = tmp_path_factory.mktemp("spike2")
    cases = {
        f"{name}_{mode}": _case(2, str(tmp / f"{name}_{mode}"), mode, *overrides)
        for name, overrides in LAYOUTS.items()
        for mode in ("poison", "drop")
    }
    return GroupedRuns(cases)


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_skip_equals_dropped_batch_in_layouts(layout_runs: GroupedRuns, layout: str) -> None:
    """Every rank skips the poisoned step; the run then equals the dropped-batch run bitwise."""
    poisoned, dropped = layout_runs.get(f"{layout}_poison"), layout_runs.get(f"{layout}_drop")
    assert_skipped_equals_dropped(poisoned, dropped, layout)
