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

__all__ = [
    "compare_memory",
    "compare_with_ledger",
    "load_run",
    "main_run",
    "measured_memory_terms",
    "pp_rank_of",
    "render_comparison",
]


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
        for key, want in (
            ("params", stage.params_bytes),
            ("grads", stage.grads_bytes),
            ("optimizer", stage.optimizer_bytes),
        ):
            if key in state:
                out.append(_ratio_row(rank, "memory", key, want, state[key]))
    return out


def measured_memory_terms(rank_record: dict[str, Any]) -> dict[str, float]:
    """One rank's memory-ledger record summed into the planner's terms: saved bytes per step of the
    blocks (``activations`` in ``block.*`` scopes), ``ac_inputs``, ``weight_copies``, the embedding,
    head and loss scopes (anything else under ``other``), and the peak of live saved bytes."""
    out = {
        "blocks": 0.0,
        "ac_inputs": 0.0,
        "weight_copies": 0.0,
        "embedding": 0.0,
        "head": 0.0,
        "loss": 0.0,
        "mtp": 0.0,
    }
    for scope, kinds in rank_record["saved"].items():
        for kind, by_dtype in kinds.items():
            nbytes = sum(by_dtype.values())
            if kind in ("ac_inputs", "weight_copies"):
                out[kind] += nbytes
            elif scope.startswith("block."):
                out["blocks"] += nbytes
            else:
                out[scope if scope in out else "other"] = (
                    out.get(scope if scope in out else "other", 0.0) + nbytes
                )
    out["peak_saved"] = rank_record["peak_saved"]
    return out


# measured buffer -> the planned term it is checked against (ddp_buckets hold the gradients, ZeRO-1's
# flat storage is the parameters themselves: no second copy exists or is planned)
_BUFFER_PLAN = {
    "ddp_buckets": "grads",
    "zero1_flat_params": "params",
    "pp_fwd_cache_peak": "pp_stage_outputs",
}


def compare_memory(plan: Plan, memory: dict[str, Any]) -> list[dict[str, Any]]:
    """Per rank of a memory-ledger record (``metrics.jsonl``'s ``memory``), planned vs measured
    bytes: saved for backward per step by term, the peak of live saved bytes, model states and
    buffers. ``ratio`` = measured / planned."""
    out = []
    for rank_key, rec in sorted(memory["ranks"].items(), key=lambda kv: int(kv[0])):
        rank = int(rank_key)
        stage = plan.stages[pp_rank_of(plan, rank)]
        measured = measured_memory_terms(rec)
        planned = {**stage.saved_per_step, "peak_saved": stage.peak_saved}
        for key in sorted(set(planned) | set(measured), key=lambda k: (k == "peak_saved", k)):
            if planned.get(key, 0.0) or measured.get(key, 0.0):
                out.append(_ratio_row(rank, "saved", key, planned.get(key, 0.0), measured.get(key, 0.0)))
        states = {
            "params": stage.params_bytes,
            "grads": stage.grads_bytes,
            "optimizer": stage.optimizer_bytes,
        }
        for key, want in states.items():
            out.append(_ratio_row(rank, "state", key, want, rec["model_state"][key]))
        for key, got in sorted(rec["buffers"].items()):
            target = _BUFFER_PLAN.get(key, key)
            want = states.get(target, stage.buffers.get(target, 0.0))
            out.append(_ratio_row(rank, "buffer", key if target == key else f"{key}~{target}", want, got))
        for key, want in sorted(stage.buffers.items()):
            if key not in rec["buffers"] and key not in _BUFFER_PLAN.values():
                out.append(_ratio_row(rank, "buffer", key, want, 0.0))
        for key, want in (("recompute", stage.recompute_bytes), ("sac_cache", stage.sac_cache_bytes)):
            if want:  # transient, not seen by the hooks: planned only (CUDA's allocator peak sees them)
                out.append({**_ratio_row(rank, "unseen", key, want, 0.0), "ratio": None})
        if "cuda" in rec:
            out.append(
                {**_ratio_row(rank, "cuda", "max_allocated", stage.total_bytes, rec["cuda"]["max_allocated"])}
            )
    return out


def _ratio_row(rank: int, kind: str, what: str, planned: float, measured: float) -> dict[str, Any]:
    ratio = measured / planned if planned else (1.0 if not measured else math.inf)
    return {
        "rank": rank,
        "kind": kind,
        "what": what,
        "planned": planned,
        "measured": measured,
        "ratio": ratio,
    }


def load_run(run_dir: str) -> tuple[Any, dict[str, Any]]:
    """(the run's config, its newest communication ledger record) from a run folder."""
    cfg, records = load_run_records(run_dir)
    if records["comm"] is None:
        raise ConfigError(
            f"{os.path.join(run_dir, 'metrics.jsonl')} has no communication ledger; train with "
            "metrics.comm_ledger=true "
            "to measure it."
        )
    return cfg, records["comm"]


def load_run_records(run_dir: str) -> tuple[Any, dict[str, Any]]:
    """(the run's config, ``{"comm": newest comm-ledger record or None, "memory": newest
    memory-ledger record or None}``) from a run folder."""
    from trainer.config import to_train_config

    config_path, metrics_path = os.path.join(run_dir, "config.yaml"), os.path.join(run_dir, "metrics.jsonl")
    if not (os.path.isfile(config_path) and os.path.isfile(metrics_path)):
        raise ConfigError(
            f"{run_dir!r} is not a run folder (needs config.yaml and metrics.jsonl from a training run)."
        )
    try:  # OmegaConf parses with a yaml.SafeLoader: a Python tag is an error, never a call
        raw = OmegaConf.load(config_path)
    except yaml.YAMLError as e:
        raise ConfigError(
            f"{config_path} is not a plain YAML run config ({str(e).splitlines()[0]}); pass the folder a "
            "training run wrote."
        ) from None
    cfg = to_train_config(raw)
    found: dict[str, Any] = {"comm": None, "memory": None}
    with open(metrics_path, encoding="utf-8") as f:
        for line in f:
            record = json.loads(line)
            for key in found:
                if key in record:
                    found[key] = record[key]
    return cfg, found


def render_comparison(rows: list[dict[str, Any]], title: str = "planned vs measured per step") -> str:
    lines = [
        f"{title} (bytes; ratio = measured / planned)",
        f"{'rank':>4} {'kind':<6} {'what':<32} {'planned':>14} {'measured':>14} {'ratio':>7}",
    ]
    for r in rows:
        ratio = "   n/a" if r["ratio"] is None else f"{r['ratio']:>7.3f}"
        lines.append(
            f"{r['rank']:>4} {r['kind']:<6} {r['what']:<32} {r['planned']:>14,.0f} {r['measured']:>14,.0f} "
            f"{ratio}"
        )
    return "\n".join(lines)


def main_run(run_dir: str, cluster_args: list[str], as_json: bool) -> int:
    """``--run=DIR``: the plan of a finished run's own config next to what its ledgers measured
    (communication: ``metrics.comm_ledger``; memory: ``metrics.memory_ledger``)."""
    cfg, records = load_run_records(run_dir)
    if records["comm"] is None and records["memory"] is None:
        raise ConfigError(
            f"{os.path.join(run_dir, 'metrics.jsonl')} has no ledger; train with metrics.comm_ledger=true "
            "and/or "
            "metrics.memory_ledger=true to measure it."
        )
    import torch

    on_cpu = cfg.training.device == "cpu" or (cfg.training.device == "auto" and not torch.cuda.is_available())
    if not any(a.startswith("cluster=") for a in cluster_args) and on_cpu:
        cluster_args = ["cluster=cpu", *cluster_args]
    plan = build_plan(cfg, compose_cluster(cluster_args), os.path.basename(os.path.normpath(run_dir)))
    comm = compare_with_ledger(plan, records["comm"]) if records["comm"] is not None else []
    memory = compare_memory(plan, records["memory"]) if records["memory"] is not None else []
    if as_json:
        print(
            json.dumps({"comm": comm, "memory": memory}, indent=1) if memory else json.dumps(comm, indent=1)
        )
        return 0
    parts = [render(plan)]
    if comm:
        parts.append(render_comparison(comm))
    if memory:
        parts.append(
            render_comparison(
                memory,
                "memory: planned vs measured (saved: per step; peak_saved, states, buffers: bytes held)",
            )
        )
    print("\n\n".join(parts))
    return 0
