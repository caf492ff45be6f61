"""WSD (warmup-stable-decay): the factors against the formula, decay from a stable checkpoint, and
``checkpoint.keep_every`` keeping the stable checkpoints across a restart."""

from __future__ import annotations

import math
import os
import re

import pytest
import torch

from models.errors import ConfigError
from tests.configs import make_config, tiny_config
from tests.parity import Case, gather_cases
from trainer.checkpoint.storage import complete_steps
from trainer.optim import lr_factor

SHAPES = {
    "linear": lambda p: 1 - p,
    "cosine": lambda p: 0.5 * (1 + math.cos(math.pi * p)),
    "1-sqrt": lambda p: 1 - math.sqrt(p),
}


@pytest.mark.parametrize("shape", list(SHAPES))
def test_wsd_factors_match_the_formula(shape: str) -> None:
    """Warmup (s+1)/W, the peak until D, then floor + (1-floor) * shape((s-D+1)/L) to the floor at the
    last step; decay_fraction, decay_steps and decay_start_step place the same decay."""
    W, T, L, floor = 3, 20, 5, 0.1
    D = T - L
    kw = {
        "warmup_steps": W,
        "total_steps": T,
        "decay_type": "wsd",
        "min_lr_ratio": floor,
        "decay_shape": shape,
    }
    by_steps = [lr_factor(s, decay_steps=L, **kw) for s in range(T + 3)]
    expected = [
        (s + 1) / W
        if s < W
        else 1.0
        if s < D
        else floor + (1 - floor) * SHAPES[shape](min(1, (s - D + 1) / L))
        for s in range(T + 3)
    ]
    assert by_steps == pytest.approx(expected, abs=1e-15)
    assert by_steps[D - 1] == 1.0 and by_steps[D] < 1.0 and by_steps[T - 1] == pytest.approx(floor)
    assert by_steps[T:] == pytest.approx([floor] * 3)  # past the end: the floor
    assert [lr_factor(s, decay_fraction=L / T, **kw) for s in range(T)] == by_steps[:T]
    assert [lr_factor(s, decay_start_step=D, **kw) for s in range(T)] == by_steps[:T]
    # Before the decay start the factor depends on neither the decay nor the run length.
    longer = [lr_factor(s, **{**kw, "total_steps": 1000}, decay_start_step=900) for s in range(D)]
    assert longer == by_steps[:D]
    # decay_fraction=0: a stable run (the peak to the end), the run to branch decays from.
    assert [lr_factor(s, decay_fraction=0.0, **kw) for s in range(W, T)] == [1.0] * (T - W)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ("lr_scheduler=wsd", "lr_scheduler.decay_shape=sqrt"),
            "lr_scheduler.decay_shape='sqrt' is not one of",
        ),
        (
            ("lr_scheduler=wsd", "lr_scheduler.decay_start_step=30"),
            "lr_scheduler.decay_start_step=30 must lie in",
        ),
        (("lr_scheduler=wsd", "lr_scheduler.decay_steps=18"), "the decay start 2 (training.steps=20"),
        (("lr_scheduler=wsd", "lr_scheduler.decay_steps=2", "lr_scheduler.decay_start_step=18"), "set one"),
        (("lr_scheduler.decay_start_step=12",), "decay_type=cosine; use lr_scheduler=wsd"),
        (("checkpoint.interval=4", "checkpoint.keep_every=6"), "multiple of checkpoint.interval=4"),
    ],
)
def test_wsd_and_keep_every_refusals(overrides: tuple[str, ...], message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        make_config("training.steps=20", "lr_scheduler.warmup_steps=10", *overrides)


# The tiny run, 2 layers, WSD with 2 warmup steps, a checkpoint every step, the 2 newest kept plus every
# 2nd step's; the stable run has no decay (decay_fraction=0).
COMMON = (
    "model.n_layers=2",
    "training.deterministic=true",
    "lr_scheduler=wsd",
    "lr_scheduler.warmup_steps=2",
    "lr_scheduler.min_lr_ratio=0.0",
    "lr_scheduler.decay_shape=1-sqrt",
    "checkpoint.enable=true",
    "checkpoint.interval=1",
)
STABLE = (*COMMON, "lr_scheduler.decay_fraction=0.0", "checkpoint.keep_latest=2", "checkpoint.keep_every=2")
DECAY = (*COMMON, "lr_scheduler.decay_start_step=4", "training.steps=7")  # steps 5-7 decay (1-based)


def _losses(run: dict) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in run["history"] if "loss" in r}


@pytest.mark.slow
def test_decay_from_a_stable_checkpoint_and_keep_every(tmp_path) -> None:
    """The stable run (6 steps, then restarted to 8) keeps step-2/4/6 besides the 2 newest; a decay run
    that starts from the stable run's step-4 checkpoint (``decay_start_step=4``) logs bitwise the
    losses, LRs and final weights of the same decay run trained from scratch, whose first 4 steps are
    bitwise the stable run's."""
    stable = str(tmp_path / "stable")
    runs = gather_cases(
        {
            "stable": Case(1, tiny_config(stable, *STABLE, "training.steps=6"), params=False),
            "stable_more": Case(1, tiny_config(stable, *STABLE, "training.steps=8"), params=False),
            "branch": Case(
                1,
                tiny_config(
                    str(tmp_path / "branch"),
                    *DECAY,
                    f"checkpoint.initial_load_path={os.path.join(stable, 'checkpoints', 'step-4')}",
                    "checkpoint.initial_load_model_only=false",
                ),
            ),
            "scratch": Case(1, tiny_config(str(tmp_path / "scratch"), *DECAY)),
        },
        world=1,
    )
    # keep_every across the restart: 2, 4, 6 (every 2nd) + 7, 8 (the 2 newest); 1, 3, 5 purged.
    assert complete_steps(os.path.join(stable, "checkpoints")) == [2, 4, 6, 7, 8]
    first, more = _losses(runs["stable"]), _losses(runs["stable_more"])
    assert sorted(first) == [1, 2, 3, 4, 5, 6] and sorted(more) == [7, 8]
    # A record's lr is get_last_lr() after the scheduler's step: the LR of the next step.
    stable_lrs = [r["lr"] for r in runs["stable"]["history"] + runs["stable_more"]["history"] if "loss" in r]
    assert stable_lrs[1:] == [3e-3] * 7  # tiny run's optimizer.lr, no decay (nor after the end)
    scratch, branch = _losses(runs["scratch"]), _losses(runs["branch"])
    # Step 5's loss is taken before the first decayed update (0-based step 4): steps 1-5 are the stable
    # run's, bitwise; step 6 is the first that sees the decay.
    assert {s: scratch[s] for s in range(1, 6)} == {s: first[s] for s in range(1, 6)}
    assert scratch[6] != first[6]
    assert sorted(branch) == [5, 6, 7] and branch == {s: scratch[s] for s in (5, 6, 7)}  # bitwise
    lrs = {r["step"]: r["lr"] for r in runs["scratch"]["history"] if "loss" in r}
    assert lrs == pytest.approx(
        {3: 3e-3, 4: 3e-3 * (1 - math.sqrt(1 / 3)), 5: 3e-3 * (1 - math.sqrt(2 / 3))}
        | {s: lrs[s] for s in (1, 2, 6, 7)},
        abs=1e-12,
    )
    assert lrs[6] == lrs[7] == 0.0  # the last step (0-based 6) is at the floor, and so is what follows
    assert {r["step"]: r["lr"] for r in runs["branch"]["history"] if "loss" in r} == {
        s: lrs[s] for s in (5, 6, 7)
    }
    for name, p in runs["scratch"]["params"].items():
        assert torch.equal(p, runs["branch"]["params"][name]), name
