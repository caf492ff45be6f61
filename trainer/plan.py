"""The planner: per-rank memory and per-step communication of a layout, before launch.

``python -m trainer.plan +experiment=7b_hsdp [cluster=h100_node cluster.nodes=4 ...] [--json]``

It composes the same Hydra config as training (plus the planner-only ``cluster`` group,
``configs/cluster/``), validates the layout with ``validated_dims`` and answers the
two questions that decide every layout: does each rank's memory fit, and can communication
hide behind compute. Nothing is built: parameter counts come from ``spec.param_counts`` and
the model args, FLOPs from ``spec.flops_per_token``.

The model, in units of bytes (decimal GB = 1e9 in the formulas, GiB in the verdict):

- model states, per rank, for the parameters it holds after PP (its stages) and TP (1/tp of
  every matrix, norms replicated): fp32 parameters (4 B), gradients (4 B, or the DDP bucket
  dtype), AdamW's two fp32 moments (8 B) -- 16 B per parameter replicated (DDP); ZeRO-1
  divides the moments by the DDP degree; FSDP/HSDP divides all 16 B by dp_shard x cp;
- activations: what each block, the head and the loss save for backward, term by term as our code
  saves them (``trainer/planner/activations.py``, per stage and schedule ``trainer/planner/memory.py``;
  checked against ``metrics.memory_ledger``), per dtype policy, activation checkpointing, TP/SP, CP,
  times the microbatches in flight per pipeline schedule;
  Qwen3's explicit head size and q/k norms, MLA's latents and per-head expanded K/V
  (DeepSeek-V3) and its MTP modules included; full checkpointing keeps the block inputs plus one
  block while it is recomputed;
- buffers: FSDP's gathered units in ``param_dtype`` (root, head, the last block; + the backward
  prefetch on NCCL) and the largest unit's unsharded gradient in ``reduce_dtype``; the DDP buckets
  (the gradients themselves); torch's per-microbatch PP receive buffers and the stage outputs kept
  per in-flight microbatch;
- communication with the alpha-beta ring model: a collective over n ranks moves, per rank,
  ``2 (n-1)/n x size`` (all-reduce) or ``(n-1)/n x size`` (all-gather, reduce-scatter; size
  = the full tensor) and takes ``steps x alpha + bytes / bus_bandwidth``; a group that spans
  nodes runs at the inter-node bandwidth;
- one checkpoint save (``trainer/planner/checkpoint.py``): the bytes and files each rank writes, its
  entries split by the layout and de-duplicated where DCP's coordinator puts them, each a
  ``torch.save`` on disk, plus rank 0's ``.metadata`` and marker.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import sys
from typing import TYPE_CHECKING, Optional

from models.errors import ConfigError
from trainer.planner.cluster import ClusterConfig, compose_cluster
from trainer.planner.plan import build_plan
from trainer.planner.report import render

if TYPE_CHECKING:
    from trainer.config import TrainConfig


def main(argv: Optional[list[str]] = None) -> int:
    """``python -m trainer.plan +experiment=NAME [cluster=... cluster.key=...] [key=value ...] [--json]``;
    ``python -m trainer.plan --run=RUN_FOLDER`` compares a run's plan with its communication and memory
    ledgers;
    ``--recommend`` proposes a layout for the config's model on the cluster."""
    from trainer.config import compose_config

    argv = list(sys.argv[1:] if argv is None else argv)
    if "-h" in argv or "--help" in argv:
        print(inspect.cleandoc(main.__doc__ or ""))
        return 0
    as_json = "--json" in argv
    wants_recommendation = "--recommend" in argv
    run_dir = next((a.split("=", 1)[1] for a in argv if a.startswith("--run=")), None)
    rest = [a for a in argv if a not in ("--json", "--recommend") and not a.startswith("--run=")]
    flags = [a for a in rest if a.startswith("-")]
    if flags or run_dir == "":
        print(
            f"config error: unknown option {(flags or ['--run='])[0]!r}; the options are --json, --recommend "
            "and "
            "--run=RUN_FOLDER, the rest are key=value overrides (e.g. +experiment=debug).",
            file=sys.stderr,
        )
        return 2
    cluster_args = [a for a in rest if a.startswith("cluster=") or a.startswith("cluster.")]
    overrides = [a for a in rest if a not in cluster_args]
    experiment = next((a.split("=", 1)[1] for a in overrides if a.startswith("+experiment=")), "")
    try:
        if run_dir is not None:
            from trainer.planner.compare import main_run

            return main_run(run_dir, cluster_args, as_json)
        cluster = compose_cluster(cluster_args)
        if wants_recommendation:
            return _main_recommend(compose_config(*overrides), cluster, as_json)
        plan = build_plan(compose_config(*overrides), cluster, experiment)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    print(plan.to_json() if as_json else render(plan))
    return 0


def _main_recommend(cfg: TrainConfig, cluster: ClusterConfig, as_json: bool) -> int:
    """``--recommend``: walk the decision order (``trainer/planner/recommend.py``) for the config's model."""
    from trainer.planner.recommend import recommend, render_recommendation

    chosen, tried = recommend(cfg, cluster)
    if as_json:
        print(
            json.dumps(
                {
                    "recommended": None
                    if chosen is None
                    else {
                        "layout": chosen.label,
                        "activation_checkpoint": chosen.ac,
                        "plan": dataclasses.asdict(chosen.plan),
                    },
                    "tried": [
                        {"step": c.step, "layout": c.label, "activation_checkpoint": c.ac, "reason": c.reason}
                        for c in tried
                    ],
                },
                indent=2,
            )
        )
    else:
        print(render_recommendation(chosen, tried))
    return 0 if chosen is not None else 1


if __name__ == "__main__":
    sys.exit(main())
