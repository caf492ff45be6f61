"""Fault tolerance under SIGKILL: 3 trials in one job of 2 replica groups (``FT_GROUPS=2 NPROC=1
./launch.sh``).

Each trial waits a random number of steps (seeded), SIGKILLs group 1's trainer, and waits until the
supervisor has restarted it and it has healed and trained a step with group 0 again. Prints JSON:
per failure the survivor's stall (duration of the first committed step after the failure, against
the median step), the steps group 0 trained alone, the heal time of group 1, group 0's losses
around the failure, and whether both groups ended bitwise equal (weights + optimizer digest).

    python benchmarks/bench_ft.py [--trials 3] [--seed 0] [--step-delay 0.1]
    python benchmarks/bench_ft.py --nproc 2 --signal STOP --rank 1   # FSDP x2 per group, a hung rank 1
    python benchmarks/bench_ft.py --parity --nproc 2   # no faults: 2 groups x FSDP2 vs HSDP 2 x 2
    (./launch.sh)
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests.configs import TINY  # noqa: E402
from tests.ft_harness import FT_FAST, FTJob  # noqa: E402

FT = "parallelism.fault_tolerance"


def parity(nproc: int) -> None:
    """8 steps of 2 groups x ``nproc`` ranks (FSDP inside when nproc > 1) against the same layout without
    fault tolerance (DDP x2, or HSDP 2 x nproc) on the same batches: losses, grad norms, final weights."""
    import subprocess

    from tests.configs import REPO
    from tests.ft_harness import clean_env
    from trainer.checkpoint.load import load_model

    dump = tempfile.mkdtemp(prefix="bench_ft_parity_")
    run = (
        *TINY,
        "training.steps=8",
        "checkpoint.enable=true",
        "checkpoint.interval=100",
        f"parallelism.dp_shard={nproc}",
        *FT_FAST,
    )
    job = FTJob(os.path.join(dump, "ft"), (*run, f"{FT}.min_replicas=2"), nproc=nproc)
    ref = subprocess.run(
        ["./launch.sh", *run, "parallelism.dp_replicate=2", f"job.dump_folder={dump}/plain"],
        cwd=REPO,
        env=clean_env(NPROC=str(2 * nproc)),
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert ref.returncode == 0, ref.stdout[-3000:]
    assert job.wait(1800) == 0, job.log()
    job.stop()
    with open(os.path.join(dump, "plain", "metrics.jsonl"), encoding="utf-8") as f:
        want = [r for r in map(json.loads, f) if "loss" in r]
    g0, g1 = job.records(0), job.records(1)
    err = max(abs(a[k] - e[k]) / abs(e[k]) for a, e in zip(g0, want) for k in ("loss", "grad_norm"))
    ft_model, _ = load_model(os.path.join(dump, "ft", "checkpoints", "step-8"))
    plain = load_model(os.path.join(dump, "plain", "checkpoints", "step-8"))[0].state_dict()
    weights = max((v - plain[k]).abs().max().item() for k, v in ft_model.state_dict().items())
    print(
        json.dumps(
            {
                "layout": f"2 groups x {nproc} ranks vs dp_replicate=2 x dp_shard={nproc}",
                "steps": len(g0),
                "max_rel_loss_grad_norm_error": err,
                "max_weight_error": weights,
                "groups_bitwise_equal": all(a["ft/state_sha"] == b["ft/state_sha"] for a, b in zip(g0, g1)),
            },
            indent=1,
        )
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--step-delay", type=float, default=0.1, help="seconds added to every step")
    parser.add_argument("--nproc", type=int, default=1, help="ranks per group (> 1: FSDP over them)")
    parser.add_argument(
        "--signal", choices=("KILL", "STOP"), default="KILL", help="STOP: the hang watchdog acts"
    )
    parser.add_argument("--rank", type=int, default=0, help="the rank of group 1 that gets the signal")
    parser.add_argument("--parity", action="store_true", help="no faults: compare with the plain run instead")
    args = parser.parse_args()
    if args.parity:
        parity(args.nproc)
        return
    faults(args)


def faults(args: argparse.Namespace) -> None:
    """Kill (or stop) a rank of group 1 ``args.trials`` times; print the stall, heal and loss figures."""
    sig = signal.SIGKILL if args.signal == "KILL" else signal.SIGSTOP
    rng = random.Random(args.seed)
    dump = tempfile.mkdtemp(prefix="bench_ft_")
    job = FTJob(
        dump,
        (
            *TINY,
            "training.steps=100000",
            "checkpoint.enable=false",
            f"parallelism.dp_shard={args.nproc}",
            *FT_FAST,
            f"{FT}.min_replicas=1",
            f"{FT}.quorum_timeout_s=12",
            f"{FT}.hang_timeout_s=14",
            f"{FT}.startup_wait_s=10",
        ),
        step_delay_s=args.step_delay,
        nproc=args.nproc,
    )
    trials = []
    try:
        job.wait_for(lambda: job.last_step(0) >= 3 and job.last_step(1) >= 3, 600, "both groups training")
        for _ in range(args.trials):
            target = job.last_step(0) + rng.randint(3, 15)
            job.wait_for(lambda target=target: job.last_step(0) >= target, 300, f"step {target}")
            killed_at = job.last_step(0)
            t_kill = job.signal_group(1, sig, rank=args.rank)

            def healed(killed_at: int = killed_at) -> bool:
                g1 = job.records(1)
                heals = [r for r in g1 if r.get("ft/heal_s") and r["step"] > killed_at]
                return bool(heals) and g1[-1]["ft/participants"] == 2 and g1[-1]["step"] > heals[0]["step"]

            job.wait_for(healed, 600, "group 1 to heal")
            t_back = time.time()
            g0, g1 = job.records(0), job.records(1)
            normal = statistics.median(r["step_time_s"] for r in g0[3:] if r["ft/participants"] == 2)
            after = [r for r in g0 if r["step"] > killed_at]
            heal = next(r for r in g1 if r.get("ft/heal_s") and r["step"] > killed_at)
            trials.append(
                {
                    "killed_after_step": killed_at,
                    "survivor_stall_s": round(after[0]["step_time_s"], 3),
                    "median_step_s": round(normal, 3),
                    "steps_alone": sum(1 for r in after if r["ft/participants"] == 1),
                    "discarded_steps_total": after[-1]["ft/discarded_steps"],
                    "heal_s": round(heal["ft/heal_s"], 3),
                    "healed_at_step": heal["step"],
                    "kill_to_back_s": round(t_back - t_kill, 1),
                    "losses_around": [
                        (r["step"], round(r["loss"], 4), r["ft/participants"])
                        for r in g0
                        if killed_at - 2 <= r["step"] <= killed_at + 3
                    ],
                }
            )
        shared = {r["step"]: r["ft/state_sha"] for r in job.records(1)}
        equal = all(shared[r["step"]] == r["ft/state_sha"] for r in job.records(0) if r["step"] in shared)
    finally:
        job.stop()
    print(
        json.dumps(
            {
                "signal": args.signal,
                "nproc": args.nproc,
                "rank": args.rank,
                "trials": trials,
                "groups_bitwise_equal_where_both_logged": equal,
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
