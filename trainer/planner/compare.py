"""Planned vs measured: a run folder trained with ``metrics.comm_ledger=true`` next to the plan of
its own config (``python -m trainer.plan --run=RUN_FOLDER``), per rank and step: bytes per
collective op and in total, and the model-state bytes."""

from __future__ import annotations

import json
import math
import os
from typing import Any

import yaml
from omegaconf import OmegaConf

from models.errors import ConfigError
from trainer.planner.cluster import compose_cluster
from trainer.planner.context import Plan
from trainer.planner.plan import build_plan
from trainer.planner.report import render

__all__ = ["compare_with_ledger", "load_run", "main_run", "pp_rank_of", "render_comparison"]


def pp_rank_of(plan: Plan, rank: int) -> int:
    """The pipeline rank of a global rank (pp is the outermost mesh dim)."""
    lay = plan.layout
    return rank // (lay["world_size"] // lay["pp"])


def compare_with_ledger(plan: Plan, ledger: dict[str, Any]) -> list[dict[str, Any]]:
    """Per rank of a ledger record (``metrics.jsonl``'s ``comm``), planned vs measured bytes per step:
    each planned collective op (summed over the plan's rows of that op) and the total, and the
    model-state bytes (parameters, gradients, optimizer state). ``ratio`` = measured / planned.

    The planned total leaves out what the plan does not model: scalars (token counts, the loss,
    grad-norm partial sums) and the load-balancer's per-expert counts; they are a fraction of a
    percent of the bytes and show up as ``measured`` ops without a plan."""
    from trainer.observe.comm_ledger import ledger_totals

    out = []
    for rank_key, counts in sorted(ledger["ranks"].items(), key=lambda kv: int(kv[0])):
        rank = int(rank_key)
        pp_rank = pp_rank_of(plan, rank)
        planned: dict[str, float] = {}
        for x in plan.pp_rank_collectives[pp_rank]:
            planned[x.op] = planned.get(x.op, 0.0) + x.logical_bytes
        measured = {op: v["bytes"] for op, v in ledger_totals(counts).items()}
        for op in sorted(set(planned) | set(measured)):
            out.append(_ratio_row(rank, "comm", op, planned.get(op, 0.0), measured.get(op, 0.0)))
        out.append(_ratio_row(rank, "comm", "total", sum(planned.values()), counts.get("total_bytes", 0.0)))
        stage = plan.stages[pp_rank]
        state = counts.get("model_state", {})
        for key, want in (("params", stage.params_bytes), ("grads", stage.grads_bytes), ("optimizer", stage.optimizer_bytes)):
            if key in state:
                out.append(_ratio_row(rank, "memory", key, want, state[key]))
    return out


def _ratio_row(rank: int, kind: str, what: str, planned: float, measured: float) -> dict[str, Any]:
    ratio = measured / planned if planned else (1.0 if not measured else math.inf)
    return {"rank": rank, "kind": kind, "what": what, "planned": planned, "measured": measured, "ratio": ratio}


def load_run(run_dir: str) -> tuple[Any, dict[str, Any]]:
    """(the run's config, its newest ledger record) from a run folder."""
    from trainer.config import to_train_config

    config_path, metrics_path = os.path.join(run_dir, "config.yaml"), os.path.join(run_dir, "metrics.jsonl")
    if not (os.path.isfile(config_path) and os.path.isfile(metrics_path)):
        raise ConfigError(f"{run_dir!r} is not a run folder (needs config.yaml and metrics.jsonl from a training run).")
    try:  # OmegaConf parses with a yaml.SafeLoader: a Python tag is an error, never a call
        raw = OmegaConf.load(config_path)
    except yaml.YAMLError as e:
        raise ConfigError(
            f"{config_path} is not a plain YAML run config ({str(e).splitlines()[0]}); pass the folder a "
            "training run wrote."
        ) from None
    cfg = to_train_config(raw)
    ledger = None
    with open(metrics_path, encoding="utf-8") as f:
        for line in f:
            record = json.loads(line)
            if "comm" in record:
                ledger = record["comm"]
    if ledger is None:
        raise ConfigError(
            f"{metrics_path} has no communication ledger; train with metrics.comm_ledger=true to measure it."
        )
    return cfg, ledger


def render_comparison(rows: list[dict[str, Any]]) -> str:
    lines = ["planned vs measured per step (bytes; ratio = measured / planned)",
             f"{'rank':>4} {'kind':<6} {'what':<15} {'planned':>14} {'measured':>14} {'ratio':>7}"]  # fmt: skip
    for r in rows:
        lines.append(f"{r['rank']:>4} {r['kind']:<6} {r['what']:<15} {r['planned']:>14,.0f} {r['measured']:>14,.0f} "
                     f"{r['ratio']:>7.3f}")  # fmt: skip
    return "\n".join(lines)


def main_run(run_dir: str, cluster_args: list[str], as_json: bool) -> int:
    """``--run=DIR``: the plan of a finished run's own config next to what its ledger measured."""
    cfg, ledger = load_run(run_dir)
    import torch

    on_cpu = cfg.training.device == "cpu" or (cfg.training.device == "auto" and not torch.cuda.is_available())
    if not any(a.startswith("cluster=") for a in cluster_args) and on_cpu:
        cluster_args = ["cluster=cpu", *cluster_args]
    plan = build_plan(cfg, compose_cluster(cluster_args), os.path.basename(os.path.normpath(run_dir)))
    rows = compare_with_ledger(plan, ledger)
    print(json.dumps(rows, indent=1) if as_json else render(plan) + "\n\n" + render_comparison(rows))
    return 0
