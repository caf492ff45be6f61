"""Validation losses (the run's split and named sets) and task scores are the same under every
layout as in one process: DDP, FSDP, TP (+SP, loss parallel), PP, CP and EP (MoE), all in one
spawned launch of 4 gloo ranks, against single-process references (fp32, CPU): the debug model
with the weights of the session's trained debug checkpoint (``checkpoint.initial_load_path``), and
the tiny MoE at its deterministic initial weights. Every rank must report the same numbers.

The validation batches are the same in every case (``micro_batch_size x dp`` = 8 sequences, 2
batches). Per-example log-likelihoods must match to 1e-5 relative, losses too; accuracies and
greedy exact-match flags exactly. A table of the worst differences is printed.
"""

from __future__ import annotations

import json
import os
import sysconfig

import pytest

from tests.configs import tiny_config
from tests.dist import run_distributed

pytestmark = pytest.mark.slow

RTOL = 1e-5
DEBUG_SHAPES = ["model.dim=256", "model.n_heads=8", "model.n_kv_heads=4", "model.ffn_hidden_dim=768"]
MOE = ["model=moe_debug", "model.moe_hidden_dim=64", "model.first_k_dense=1", "model.num_shared_experts=1"]
LAYOUTS = {  # name -> (model overrides, data-parallel degree, layout overrides); world 4
    "ddp_x4": ("dense", 4, ["parallelism.dp_replicate=4", "parallelism.dp_shard=1"]),
    "fsdp_x4": ("dense", 4, ["parallelism.dp_shard=4"]),
    "tp2_fsdp2": ("dense", 2, ["parallelism.tp=2", "parallelism.dp_shard=2"]),
    "pp2_fsdp2": (
        "dense",
        2,
        ["parallelism.pp=2", "parallelism.dp_shard=2", "parallelism.pp_microbatches=2"],
    ),
    "cp2_fsdp2": ("dense", 2, ["parallelism.cp=2", "parallelism.dp_shard=2"]),
    "ep2_fsdp4": ("moe", 4, ["parallelism.ep=2", "parallelism.dp_shard=4"]),
}


def _overrides(tmp: str, dp: int) -> list[str]:
    notes = os.path.join(tmp, "notes.jsonl")
    return [
        f"training.micro_batch_size={8 // dp}",
        "training.eval_freq=1",
        "training.eval_steps=2",
        "eval.tasks=[next_line,complete_word]",
        "eval.limit=10",
        "eval.batch_size=3",
        "+eval.validation.stdlib={source:builtin,max_documents:120}",
        f"+eval.validation.notes={{source:json,path:{notes},split:all,steps:2}}",
    ]


def _evaluate(cfg) -> dict:  # noqa: ANN001
    from trainer.train import Trainer

    trainer = Trainer(cfg)
    try:
        tasks = trainer.evaluate_tasks()
        return {
            "tasks": {name: r.metrics for name, r in tasks.items()},
            "details": {name: r.details for name, r in tasks.items()},
            "validation": trainer.evaluate(),
            "sets": {
                name: trainer.evaluate(loader, steps)
                for name, (loader, steps) in trainer.named_val_loaders.items()
            },
        }
    finally:
        trainer.close()


def _worker(rank: int, world_size: int, cfgs: dict) -> dict:
    return {name: _evaluate(cfg) for name, cfg in cfgs.items()}


def _loglik_rows(result: dict) -> list[float]:
    rows = []
    for name in sorted(result["details"]):
        for d in result["details"][name]:
            rows += d.get("loglikelihoods", [d.get("loglikelihood")])
    return rows


def _greedy(result: dict) -> list:
    return [
        (d.get("is_greedy"), d.get("exact_match"))
        for n in sorted(result["details"])
        for d in result["details"][n]
    ]


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(a), 1e-12)


def test_validation_and_tasks_match_single_process_under_every_layout(tmp_path, debug_run) -> None:
    tmp = str(tmp_path)
    root = sysconfig.get_paths()["stdlib"]
    with open(os.path.join(tmp, "notes.jsonl"), "w") as f:
        for name in ("this.py", "abc.py", "keyword.py", "bisect.py"):
            f.write(json.dumps({"text": open(os.path.join(root, name), encoding="utf-8").read()}) + "\n")
    models = {"dense": [*DEBUG_SHAPES, f"checkpoint.initial_load_path={debug_run.checkpoint}"], "moe": MOE}
    refs = {
        m: _evaluate(tiny_config(os.path.join(tmp, f"ref_{m}"), *ov, *_overrides(tmp, 1)))
        for m, ov in models.items()
    }
    cfgs = {
        name: tiny_config(os.path.join(tmp, name), *models[m], *ov, *_overrides(tmp, dp))
        for name, (m, dp, ov) in LAYOUTS.items()
    }
    per_rank = run_distributed(_worker, 4, cfgs, timeout=1800)
    table = [
        f"{'layout':<12} {'val loss':>10} {'rel diff':>9} {'named sets rel':>14} {'loglik rows':>11} "
        f"{'max rel':>9} {'next_line acc/norm/bytes':>26} {'complete_word em':>16}"
    ]
    for m, ref in refs.items():
        tasks = ref["tasks"]
        table.append(
            f"{'1 proc ' + m:<12} {ref['validation'][0]:>10.6f} {'':>9} {'':>14} "
            f"{len(_loglik_rows(ref)):>11} "
            f"{'':>9} {tasks['next_line']['acc']:>8.3f}/{tasks['next_line']['acc_norm']:.3f}/"
            f"{tasks['next_line']['acc_bytes']:.3f} {tasks['complete_word']['exact_match']:>16.3f}"
        )
    failures = []
    for name, (m, _, _) in LAYOUTS.items():
        ref, got = refs[m], per_rank[0][name]
        for rank, results in enumerate(per_rank[1:], 1):
            if results[name] != got:
                failures.append(f"{name}: rank {rank} reports other numbers than rank 0")
        val_rel = _rel(ref["validation"][0], got["validation"][0])
        sets_rel = max(_rel(ref["sets"][s][0], got["sets"][s][0]) for s in ref["sets"])
        rows_ref, rows_got = _loglik_rows(ref), _loglik_rows(got)
        ll_rel = max(_rel(a, b) for a, b in zip(rows_ref, rows_got))
        tasks = got["tasks"]
        table.append(
            f"{name:<12} {got['validation'][0]:>10.6f} {val_rel:>9.1e} {sets_rel:>14.1e} {len(rows_got):>11} "
            f"{ll_rel:>9.1e} {tasks['next_line']['acc']:>8.3f}/{tasks['next_line']['acc_norm']:.3f}/"
            f"{tasks['next_line']['acc_bytes']:.3f} {tasks['complete_word']['exact_match']:>16.3f}"
        )
        if got["validation"][1] != ref["validation"][1] or any(
            got["sets"][s][1] != ref["sets"][s][1] for s in ref["sets"]
        ):
            failures.append(f"{name}: validation token counts differ")
        if max(val_rel, sets_rel, ll_rel) > RTOL or len(rows_got) != len(rows_ref):
            failures.append(f"{name}: relative difference {max(val_rel, sets_rel, ll_rel):.1e} > {RTOL}")
        if got["tasks"] != ref["tasks"] or _greedy(got) != _greedy(ref):
            failures.append(f"{name}: task scores differ: {got['tasks']} vs {ref['tasks']}")
    print("\n" + "\n".join(table))
    assert not failures, failures
