"""Parity checks: a parallel run against the single-process reference, step by step.

Every layout must train the same model as one process (fp32, CPU): per-step losses and
pre-clip gradient norms within ``PARITY_RTOL`` relative, final parameters within
``PARAM_ATOL``. Losses alone are not enough: with AdamW (scale-invariant) and clipping on,
a gradient scaled by 2 -- a missing 1/N in a reduction, a loss counted twice -- gives the
same losses; the gradient norm is the quantity that sees it.

A run's *history* is what ``Trainer.train()`` returns (and ``metrics.jsonl`` holds): records
with ``step``, ``loss`` and the pre-clip ``grad_norm``; eval records (no ``loss``) are
ignored. Hand-written loops build one with :func:`history_from`.

Typical use: a module-scoped fixture builds ``GroupedRuns`` (cases launched once per world
size), and a test parametrized over layouts compares each with the session-wide
single-process reference (``tiny_reference`` in ``tests/conftest.py``)::

    runs = GroupedRuns({"fsdp_x2": Case(2, tiny_config(tmp, "parallelism.dp_shard=2")), ...})
    assert_parallel_run(tiny_reference["clip"], runs.get("fsdp_x2"), label="fsdp_x2")

``assert_parallel_run`` = ``assert_parity`` (losses, grad norms) + the same numbers on every
rank + ``assert_params_close`` (final weights). Hand-written loops call ``assert_parity`` on
``history_from(losses, grad_norms)``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import nn

from models.common import unwrapped_name
from tests.dist import run_distributed

PARITY_RTOL = 1e-5  # fp32 on CPU; measured ~1e-7 (losses) .. 2.6e-6 (sharded grad norms)
PARAM_ATOL = 1e-5  # final weights after 4-8 AdamW steps (measured <= ~1e-6)
METRICS = ("loss", "grad_norm")


# --------------------------------------------------------------------------------------------
# Comparing histories
# --------------------------------------------------------------------------------------------


def history_from(losses: Sequence[float], grad_norms: Sequence[float], first_step: int = 1) -> list[dict]:
    """A history (records with step, loss, grad_norm) from per-step lists of a hand-written loop."""
    return [
        {"step": first_step + i, "loss": float(loss), "grad_norm": float(norm)}
        for i, (loss, norm) in enumerate(zip(losses, grad_norms, strict=True))
    ]


def step_metrics(history: Iterable[dict], metrics: Sequence[str] = METRICS) -> dict[int, dict[str, float]]:
    """``{step: {metric: value}}`` of the training records (those with a loss) in ``history``.

    A step logged twice (a resumed run repeats the steps after its last checkpoint) keeps
    the last record.
    """
    out: dict[int, dict[str, float]] = {}
    for record in history:
        if "loss" in record:
            out[int(record["step"])] = {m: float(record[m]) for m in metrics}
    return out


def _rel(ref: float, got: float) -> float:
    if ref == got:
        return 0.0
    if not (math.isfinite(ref) and math.isfinite(got)):
        return math.inf
    return abs(got - ref) / max(abs(ref), 1e-30)


def assert_parity(
    ref_history: Iterable[dict],
    got_history: Iterable[dict],
    *,
    rtol: float = PARITY_RTOL,
    metrics: Sequence[str] = METRICS,
    label: str = "run",
) -> dict[str, float]:
    """Assert ``got`` logged the same steps as ``ref`` and every metric within ``rtol`` relative.

    Returns the maximum relative difference per metric. The AssertionError names every
    offending (step, metric) with both values and their relative difference.
    """
    ref, got = step_metrics(ref_history, metrics), step_metrics(got_history, metrics)
    if not ref:
        raise AssertionError(f"{label}: the reference history has no training records")
    if sorted(ref) != sorted(got):
        raise AssertionError(f"{label}: logged steps {sorted(got)}, the reference logged {sorted(ref)}")
    worst = {m: 0.0 for m in metrics}
    bad: list[str] = []
    for step in sorted(ref):
        for m in metrics:
            rel = _rel(ref[step][m], got[step][m])
            worst[m] = max(worst[m], rel)
            if not rel <= rtol:
                bad.append(
                    f"  step {step} {m}: reference {ref[step][m]!r}, got {got[step][m]!r} "
                    f"(relative difference {rel:.2e})"
                )
    if bad:
        total = len(ref) * len(metrics)
        raise AssertionError(
            f"{label}: {len(bad)} of {total} values differ from the single-process reference by more "
            f"than rtol={rtol:g}:\n" + "\n".join(bad)
        )
    return worst


# --------------------------------------------------------------------------------------------
# Comparing parameters
# --------------------------------------------------------------------------------------------


def full_params(parts: Sequence[nn.Module]) -> dict[str, torch.Tensor]:
    """This rank's parameters, gathered to full (unsharded) fp32 CPU copies, under the model's own names.

    Collective for DTensor parameters (FSDP / TP shards): call it on every rank. Takes the
    Trainer's ``model_parts`` in any layout (``parallelisms.parallelize.model_parts``: DDP
    stripped; under a pipeline each rank returns its stages' parameters); compiled or
    checkpoint-wrapped blocks are named without their wrapper prefixes.
    """
    named = {}
    for part in parts:
        for name, p in part.named_parameters():
            named[unwrapped_name(name)] = p
    out = {}
    for name in sorted(named):  # the same order on every rank that shares a DTensor's mesh
        t = named[name].detach()
        t = t.full_tensor() if hasattr(t, "full_tensor") else t
        out[name] = t.to("cpu", torch.float32).clone()
    return out


def merge_rank_params(per_rank: Sequence[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The union of the ranks' :func:`full_params`; replicas of a parameter must agree bitwise."""
    merged: dict[str, torch.Tensor] = {}
    for rank, params in enumerate(per_rank):
        for name, t in params.items():
            if name in merged and not torch.equal(merged[name], t):
                diff = (merged[name] - t).abs().max().item()
                raise AssertionError(f"replicas disagree: rank {rank}'s {name} differs by up to {diff:.2e}")
            merged.setdefault(name, t)
    return merged


def assert_params_close(
    ref: dict[str, torch.Tensor],
    got: dict[str, torch.Tensor],
    *,
    atol: float = PARAM_ATOL,
    label: str = "run",
) -> float:
    """Assert the same parameter names and shapes, and values within ``atol``; return the max difference."""
    if sorted(ref) != sorted(got):
        missing, extra = sorted(set(ref) - set(got)), sorted(set(got) - set(ref))
        raise AssertionError(f"{label}: parameter names differ; missing {missing[:5]}, extra {extra[:5]}")
    worst, worst_name = 0.0, ""
    for name in ref:
        if ref[name].shape != got[name].shape:
            raise AssertionError(
                f"{label}: {name} has shape {tuple(got[name].shape)}, reference {tuple(ref[name].shape)}"
            )
        diff = (ref[name] - got[name]).abs().max().item() if ref[name].numel() else 0.0
        if not diff <= worst:
            worst, worst_name = diff, name
    if not worst <= atol:
        raise AssertionError(
            f"{label}: final parameter {worst_name} differs from the reference by {worst:.2e} > atol={atol:g}"
        )
    return worst


def assert_parallel_run(
    ref: dict, got: dict, *, rtol: float = PARITY_RTOL, atol: float = PARAM_ATOL, label: str = "run"
) -> dict[str, float]:
    """The whole parity check of a :func:`gather_cases` result against the reference's result:
    per-step losses and grad norms (:func:`assert_parity`), the same numbers logged on every
    rank, and final parameters (:func:`assert_params_close`) when both carry them. Prints and
    returns the measured worst differences."""
    worst = assert_parity(ref["history"], got["history"], rtol=rtol, label=label)
    logged = step_metrics(got["history"])
    for rank, history in enumerate(got.get("rank_histories", [])):
        if step_metrics(history) != logged:
            raise AssertionError(f"{label}: rank {rank} logged other numbers than rank 0 (they are global)")
    if ref.get("params") is not None and got.get("params") is not None:
        worst["params_max_abs"] = assert_params_close(ref["params"], got["params"], atol=atol, label=label)
    print(f"{label}: max difference vs 1 process: " + ", ".join(f"{k} {v:.2e}" for k, v in worst.items()))
    return worst


# --------------------------------------------------------------------------------------------
# Running Trainers: several cases in one launch per world size
# --------------------------------------------------------------------------------------------


@dataclass
class Case:
    """One Trainer run: ``world`` ranks, config, and an optional ``setup(trainer)`` called after
    construction (a test-only hook; a module-level function, since it is pickled). ``setup`` may
    return a dict that its hooks fill during training; it comes back as ``observed``."""

    world: int
    cfg: Any
    setup: Optional[Callable[[Any], None]] = None
    params: bool = True  # also return the final parameters (full_params, merged over ranks)


def train_case(case: Case) -> dict[str, Any]:
    """Run ``case`` on this rank (inside a process group); return its history (and parameters)."""
    from trainer.train import Trainer

    trainer = Trainer(case.cfg)
    try:
        observed = case.setup(trainer) if case.setup is not None else None
        out: dict[str, Any] = {"history": trainer.train(), "observed": observed}
        if case.params:
            out["params"] = full_params(trainer.model_parts)
    finally:
        trainer.close()
    return out


def run_cases(rank: int, world_size: int, cases: dict[str, Case]) -> dict[str, dict]:
    """Spawned-rank entry point: every case in turn on the same process group. Before each, DTensor's
    sharding-propagation caches are cleared: they would hand a case the previous case's equal mesh, so
    some of its collectives would run over the previous run's groups (same ranks, same numbers) and
    its comm ledger would name them ``group<N>`` instead of their mesh axis."""
    from trainer.rehearse_trace import forget_meshes

    out = {}
    for name, case in cases.items():
        forget_meshes()
        try:
            out[name] = train_case(case)
        except Exception as e:
            raise RuntimeError(f"case {name!r} failed on rank {rank}") from e
    return out


def gather_cases(cases: dict[str, Case], world: int, timeout: float = 1200.0) -> dict[str, dict]:
    """Run ``cases`` (all of world size ``world``) in one launch; per case: rank 0's ``history``,
    every rank's (``rank_histories``), the ``params`` merged over ranks, and every rank's
    ``observed`` (what the case's setup hooks recorded)."""
    per_rank = run_distributed(run_cases, world, cases, timeout=timeout)
    out = {}
    for name, case in cases.items():
        results = [r[name] for r in per_rank]
        out[name] = {
            "history": results[0]["history"],
            "rank_histories": [r["history"] for r in results],
            "params": merge_rank_params([r["params"] for r in results]) if case.params else None,
            "observed": [r["observed"] for r in results],
        }
    return out


class GroupedRuns:
    """Lazily runs cases grouped by world size: the first ``get`` of a world size launches all
    of its cases once (a spawn of N ranks costs more than a tiny run), later ones reuse them.
    A failed launch is remembered and re-raised for each of its cases."""

    def __init__(self, cases: dict[str, Case], timeout: float = 1200.0) -> None:
        self.cases = cases
        self.timeout = timeout
        self._done: dict[int, dict[str, dict] | BaseException] = {}

    def get(self, name: str) -> dict:
        world = self.cases[name].world
        if world not in self._done:
            group = {n: c for n, c in self.cases.items() if c.world == world}
            try:
                self._done[world] = gather_cases(group, world, self.timeout)
            except Exception as e:  # noqa: BLE001 -- re-raised for every case of the group
                self._done[world] = e
        done = self._done[world]
        if isinstance(done, BaseException):
            raise done
        return done[name]
