"""Per-layer statistics (``metrics.layer_stats_freq``, trainer/observe/layer_stats.py).

Each layout's figures equal one process's (computed from local shards, never gathered), and the root
of the sum of the squared per-group gradient norms is the global pre-clip gradient norm.

What they showed (issue 36; README "Per-layer statistics"): every group's gradient norm agrees between 1
process, DDP, FSDP and TP to ~2e-8 relative, while the logged global norm differs by ~1e-6 (tiny run) to
~8e-6 (debug model): that difference is the float32 reduction error of the global norm itself (torch's
CPU ``vector_norm`` over the output head's gradient, the largest tensor: -2.6e-6 relative for its 32,768
elements here, and a sharded head is reduced in pieces with less error), not a gradient difference.
"""

from __future__ import annotations

import math

import pytest

from models.errors import ConfigError
from tests.configs import PARITY_STEPS, tiny_config
from tests.parity import Case, GroupedRuns
from trainer.observe.trackers import _scalars

ON = "metrics.layer_stats_freq=1"
LAYOUTS = {
    "fsdp_x2": ("parallelism.dp_shard=2",),
    "tp_x2": ("parallelism.tp=2", "parallelism.dp_shard=1"),  # sequence parallel: the norms' grads Partial
    "pp_x2": ("parallelism.pp=2", "parallelism.dp_shard=1"),  # each stage its groups, summed over pp
}
GROUPS = ["embedding", "head", "layers.0", "layers.1", "layers.2", "layers.3"]
LAYOUT_RTOL = 1e-6  # measured <= 5e-8 (float64 sums of the local squares)
NORM_RTOL = 5e-6  # the logged global norm is float32: measured 2.4e-6 (1 process), 1.1e-6 (sharded)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> GroupedRuns:
    tmp = tmp_path_factory.mktemp("layer_stats")
    cases = {"one": Case(1, tiny_config(str(tmp / "one"), PARITY_STEPS, ON), params=False)}
    for name, overrides in LAYOUTS.items():
        cases[name] = Case(2, tiny_config(str(tmp / name), PARITY_STEPS, ON, *overrides), params=False)
    return GroupedRuns(cases)


def _records(run: dict) -> list[dict]:
    return [r for r in run["history"] if "layer_stats" in r]


@pytest.mark.parametrize("layout", ["one", *LAYOUTS])
def test_groups_add_up_to_the_global_norm(runs: GroupedRuns, layout: str) -> None:
    records = _records(runs.get(layout))
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    for r in records:
        stats = r["layer_stats"]
        assert sorted(stats) == GROUPS
        total = math.sqrt(sum(g["grad_norm"] ** 2 for g in stats.values()))
        assert total == pytest.approx(r["grad_norm"], rel=NORM_RTOL), (layout, r["step"])
        assert all(g["param_norm"] > 0 and 0 < g["update_ratio"] < 1 for g in stats.values())
    # the trackers (TensorBoard, W&B) get one scalar per group and figure
    assert "layer_stats/layers.3/update_ratio" in _scalars(records[0])


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layouts_equal_one_process(runs: GroupedRuns, layout: str) -> None:
    ref, got = _records(runs.get("one")), _records(runs.get(layout))
    worst = 0.0
    for r, g in zip(ref, got, strict=True):
        for group, figures in r["layer_stats"].items():
            for figure, value in figures.items():
                rel = abs(g["layer_stats"][group][figure] / value - 1)
                assert rel <= LAYOUT_RTOL, (layout, r["step"], group, figure, value, rel)
                worst = max(worst, rel)
    print(f"{layout}: per-layer statistics vs 1 process: max relative difference {worst:.1e}")


def test_frequency_must_follow_the_logged_steps(tmp_path) -> None:
    with pytest.raises(ConfigError, match="layer_stats_freq"):
        tiny_config(str(tmp_path), "metrics.log_freq=10", "metrics.layer_stats_freq=15")
