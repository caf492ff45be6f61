"""Cost of the communication ledger (``metrics.comm_ledger=true``) or, with ``--ledger memory``, of the
memory ledger (``metrics.memory_ledger=true``): step time with it on vs off, in one run.

Two gloo ranks train the same model under one layout (default FSDP x2, the debug model). One
Trainer per rank; rounds alternate between the ledger off (the run's step hooks without it: no mode,
no gather -- what ``comm_ledger=false`` builds) and on (its ``LedgerHook``: entered around each logged
step -- every ``--log-freq`` steps -- and its counts gathered there), so drift of the machine hits
both. The median over rounds of each setting's mean step time is compared. ``--log-freq 1``
measures every step: the cost of one measured step.

    python benchmarks/bench_ledger.py [--ledger comm|memory] [--model debug] [--layout
    parallelism.dp_shard=2] [--steps 10] [--rounds 5] [--log-freq 10]

(The memory ledger's scope hooks stay registered in the "off" rounds, inactive: one attribute test
per block call; what ``memory_ledger=false`` builds has none.)

Prints JSON with both step times and ``overhead = on / off - 1`` (target < 3%).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests.spawn import run_distributed  # noqa: E402


def _rank(rank: int, world: int, overrides: list[str], steps: int, rounds: int, which: str = "comm") -> dict:
    import torch

    from trainer.config import compose_config
    from trainer.hooks import LedgerHook, StepHooks
    from trainer.observe.comm_ledger import CommLedger, axis_names_of_groups
    from trainer.train import Trainer

    torch.set_num_threads(1)
    cfg = compose_config(*overrides)
    trainer = Trainer(cfg)
    logging.getLogger("meshwright").setLevel(logging.WARNING)
    dims = trainer.dims
    names = (*dims.mesh_dim_names, *dims.flat_views, "dp_replicate_cp")
    if which == "memory":
        from trainer.observe.memory_ledger import MemoryLedger

        ledger = MemoryLedger(
            trainer.model_parts,
            trainer.spec,
            model=trainer.model,
            optimizer=trainer.optimizer,
            device=trainer.device,
        )
        collect = lambda: ledger.collect(trainer.parameters)  # noqa: E731
    else:
        ledger = CommLedger(axis_names_of_groups(dims.mesh, names))
        collect = lambda: ledger.collect(trainer.parameters, trainer.optimizer)  # noqa: E731
    off_hooks = trainer.hooks
    on_hooks = StepHooks([*off_hooks.hooks, LedgerHook(ledger, which, collect, trainer.parameters)])

    def timed(with_ledger: bool) -> float:
        trainer.hooks = on_hooks if with_ledger else off_hooks
        trainer.cfg.training.steps = trainer.state.step + steps
        start = time.perf_counter()
        trainer.train()
        return (time.perf_counter() - start) / steps

    timed(False)  # warm-up
    timed(True)
    off, on = [], []
    for _ in range(rounds):
        off.append(timed(False))
        on.append(timed(True))
    trainer.close()
    return {"off": off, "on": on}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--ledger", choices=("comm", "memory"), default="comm")
    ap.add_argument("--model", default="debug")
    ap.add_argument("--layout", nargs="*", default=["parallelism.dp_shard=2"])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument(
        "--log-freq", type=int, default=10, help="metrics.log_freq: the ledger measures the logged steps"
    )
    args = ap.parse_args()
    folder = tempfile.mkdtemp(prefix="bench_ledger_")
    overrides = [
        f"model={args.model}",
        "training.seq_len=256",
        "training.global_batch_size=8",
        "training.micro_batch_size=4",
        "training.eval_freq=0",
        f"metrics.log_freq={args.log_freq}",
        "metrics.tensorboard=false",
        "checkpoint.enable=false",
        f"job.dump_folder={folder}",
        *args.layout,
    ]
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    per_rank = run_distributed(_rank, 2, overrides, args.steps, args.rounds, args.ledger, timeout=3600)
    off = statistics.median(max(r["off"][i] for r in per_rank) for i in range(args.rounds))
    on = statistics.median(max(r["on"][i] for r in per_rank) for i in range(args.rounds))
    print(
        json.dumps(
            {
                "ledger": args.ledger,
                "model": args.model,
                "layout": args.layout,
                "steps_per_round": args.steps,
                "rounds": args.rounds,
                "log_freq": args.log_freq,
                "step_s_off": round(off, 4),
                "step_s_on": round(on, 4),
                "overhead": round(on / off - 1, 4),
                "target": "< 0.03",
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
