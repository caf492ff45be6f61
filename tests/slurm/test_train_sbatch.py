"""slurm/train.sbatch on a real (private, two-node) Slurm cluster: losses equal one node's, and a
requeued job resumes and finishes with the losses of an uninterrupted run.

The cluster (tests/slurm_cluster.py) runs two slurmd on this machine as nodes n1 and n2; the
project's script is submitted unchanged (only sbatch's own options and the environment are
given), on 2 nodes x 2 CPU ranks (gloo). The reference is ``torchrun --nproc_per_node=4`` on
one node, started alongside.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from collections.abc import Iterator

import pytest

from tests.configs import REPO, TINY
from tests.dist import free_port
from tests.slurm_cluster import SlurmCluster, start_cluster, unavailable

pytestmark = pytest.mark.slow

STEPS = 30
RUN = (
    "+experiment=debug",
    *TINY,
    f"training.steps={STEPS}",
    "training.deterministic=true",
    "checkpoint.interval=100",
)
DONE = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE")


def _env() -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    env = {k: v for k, v in env.items() if not k.startswith(("SLURM_", "SBATCH_", "MESHWRIGHT_TEST_"))}
    return env


def _losses(dump: str) -> list[tuple[int, float]]:
    with open(os.path.join(dump, "metrics.jsonl"), encoding="utf-8") as f:
        return [(r["step"], r["loss"]) for r in map(json.loads, f) if "loss" in r]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Iterator[subprocess.Popen]:
    """torchrun --nproc_per_node=4 on one node, started now and awaited by the tests."""
    dump = str(tmp_path_factory.mktemp("reference"))
    cmd = [
        "torchrun",
        "--standalone",
        "--nproc_per_node=4",
        "trainer/main.py",
        *RUN,
        f"job.dump_folder={dump}",
    ]
    proc = subprocess.Popen(
        cmd, cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    proc.dump = dump  # type: ignore[attr-defined]
    yield proc
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def _reference_losses(proc: subprocess.Popen) -> list[tuple[int, float]]:
    if proc.returncode is None:
        proc.out, _ = proc.communicate(timeout=400)  # type: ignore[attr-defined]
    assert proc.returncode == 0, proc.out[-3000:]  # type: ignore[attr-defined]
    losses = _losses(proc.dump)  # type: ignore[attr-defined]
    assert [s for s, _ in losses] == list(range(1, STEPS + 1))
    return losses


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, reference) -> Iterator[SlurmCluster]:
    reason = unavailable()
    if reason:
        pytest.skip(reason)
    root = str(tmp_path_factory.mktemp("slurm"))
    os.chmod(root, 0o700)
    c = start_cluster(root, _env())
    yield c
    c.stop()


def _submit(cluster: SlurmCluster, dump: str) -> str:
    return cluster.run(
        "sbatch",
        "--parsable",
        "--nodes=2",
        f"--output={cluster.root}/batch-%j.out",
        f"--export=ALL,CPU_RANKS_PER_NODE=2,HEAD_PORT={free_port()}",
        os.path.join(REPO, "slurm", "train.sbatch"),
        *RUN,
        f"job.dump_folder={dump}",
    ).strip()


def _job_logs(cluster: SlurmCluster, job: str, dump: str) -> str:
    text = []
    for path in [f"{cluster.root}/batch-{job}.out"] + sorted(
        os.path.join(dp, f) for dp, _, fs in os.walk(os.path.join(dump, "logs")) for f in fs
    ):
        if os.path.exists(path):
            with open(path, errors="replace") as f:
                text.append(f"=== {path}\n{f.read()}")
    return "\n".join(text)


def test_sbatch_two_nodes_matches_one_node(cluster: SlurmCluster, reference, tmp_path) -> None:
    dump = str(tmp_path / "run")
    start = time.monotonic()
    job = _submit(cluster, dump)
    state = cluster.wait_state(job, DONE, timeout=400)
    logs = _job_logs(cluster, job, dump)
    assert state == "COMPLETED" and cluster.job_field(job, "ExitCode") == "0:0", logs[-5000:]
    print(f"slurm job {job}: {time.monotonic() - start:.1f}s")
    # Per-node logs under the run folder; the run was one world of 4 ranks over both nodes.
    node_logs = sorted(os.listdir(os.path.join(dump, "logs", f"slurm-{job}")))
    assert node_logs == ["node0.attempt0.log", "node1.attempt0.log"], node_logs
    assert "world 4 = pp 1 x dp_replicate 1 x dp_shard 4" in logs, logs[-3000:]
    assert f"training done: {STEPS} steps" in logs
    want = _reference_losses(reference)
    got = _losses(dump)
    assert [s for s, _ in got] == list(range(1, STEPS + 1))
    diff = max(abs(a - b) / abs(b) for (_, a), (_, b) in zip(got, want))
    print(f"max relative loss difference vs torchrun --nproc_per_node=4: {diff:.2e}")
    assert diff <= 1e-6, (got, want)


def test_scontrol_requeue_resumes_and_finishes(cluster: SlurmCluster, reference, tmp_path) -> None:
    dump = str(tmp_path / "run")
    start = time.monotonic()
    job = _submit(cluster, dump)
    metrics = os.path.join(dump, "metrics.jsonl")
    end = time.monotonic() + 300
    while not (os.path.exists(metrics) and len(_losses(dump)) >= 3):
        assert time.monotonic() < end, _job_logs(cluster, job, dump)[-5000:]
        assert cluster.job_field(job, "JobState") in ("PENDING", "RUNNING"), _job_logs(cluster, job, dump)[
            -5000:
        ]
        time.sleep(0.5)
    cluster.run("scontrol", "requeue", job)
    requeued_at = time.monotonic()
    # Requeued jobs are held back (BeginTime) for a while; release it at once.
    end = time.monotonic() + 120
    while cluster.job_field(job, "JobState") != "PENDING":
        assert time.monotonic() < end, _job_logs(cluster, job, dump)[-5000:]
        time.sleep(0.5)
    cluster.run("scontrol", "update", f"JobId={job}", "StartTime=now")
    state = cluster.wait_state(job, DONE, timeout=400)
    logs = _job_logs(cluster, job, dump)
    assert state == "COMPLETED" and cluster.job_field(job, "ExitCode") == "0:0", logs[-5000:]
    assert int(cluster.job_field(job, "Restarts")) == 1
    print(
        f"slurm requeue job {job}: {time.monotonic() - start:.1f}s ({time.monotonic() - requeued_at:.1f}s "
        "after requeue)"
    )

    # The first attempt stopped on SIGTERM with a checkpoint; the second resumed from it.
    stopped = re.search(r"preempted by SIGTERM after step (\d+): checkpoint of step \1 written", logs)
    assert stopped, logs[-5000:]
    step = int(stopped.group(1))
    assert 3 <= step < STEPS
    assert f"loaded step {step} from" in logs, logs[-5000:]
    assert os.path.exists(os.path.join(dump, "logs", f"slurm-{job}", "node1.attempt1.log"))
    # Each step once in metrics.jsonl, with the uninterrupted run's losses.
    got = _losses(dump)
    assert [s for s, _ in got] == list(range(1, STEPS + 1))
    want = _reference_losses(reference)
    diff = max(abs(a - b) / abs(b) for (_, a), (_, b) in zip(got, want))
    print(f"requeued run (stopped after step {step}): max relative loss difference {diff:.2e}")
    assert diff <= 1e-6


def test_fault_tolerant_sbatch_node_group_rejoins(cluster: SlurmCluster, tmp_path) -> None:
    """``FT=1``: one torchft replica group per node. SIGKILL of node n2's group: the job keeps
    running (n1's group trains alone), n2's supervisor restarts the group, which heals from n1's and
    trains with it again, bitwise equal. The job is long; scancel ends it once that is seen."""
    pytest.importorskip("torchft")
    from tests.ft_harness import FT_FAST, free_port
    from trainer.resilience.fault_tolerance import STEP_DELAY_ENV, group_folder

    ft = "parallelism.fault_tolerance"
    dump = str(tmp_path / "run")
    args = (
        "+experiment=debug",
        *TINY,
        "training.steps=100000",
        "checkpoint.enable=false",
        *FT_FAST,
        f"{ft}.min_replicas=1",
        f"{ft}.quorum_timeout_s=12",
        f"{ft}.hang_timeout_s=14",
        f"{ft}.startup_wait_s=10",
    )
    job = cluster.run(
        "sbatch",
        "--parsable",
        "--nodes=2",
        f"--output={cluster.root}/batch-%j.out",
        f"--export=ALL,FT=1,CPU_RANKS_PER_NODE=1,HEAD_PORT={free_port()},FT_LIGHTHOUSE_PORT={free_port()},"
        f"{STEP_DELAY_ENV}=0.1",
        os.path.join(REPO, "slurm", "train.sbatch"),
        *args,
        f"job.dump_folder={dump}",
    ).strip()

    def records(group: int) -> list[dict]:
        path = os.path.join(group_folder(dump, group), "metrics.jsonl")
        if not os.path.exists(path):
            return []
        with open(path, encoding="utf-8") as f:
            return [r for r in map(json.loads, f) if "loss" in r]

    def wait(check, what: str, timeout: float = 400) -> None:
        end = time.monotonic() + timeout
        while not check():
            assert time.monotonic() < end, f"{what}:\n" + _job_logs(cluster, job, dump)[-5000:]
            assert cluster.job_field(job, "JobState") in ("PENDING", "RUNNING"), _job_logs(
                cluster, job, dump
            )[-5000:]
            time.sleep(0.5)

    try:
        wait(lambda: len(records(0)) >= 3 and len(records(1)) >= 3, "both nodes' groups training")
        killed_at = records(0)[-1]["step"]
        with open(os.path.join(group_folder(dump, 1), "heartbeat", "rank0"), encoding="utf-8") as f:
            os.kill(int(f.read().split()[2]), 9)  # n2's trainer (the nodes share this machine)

        def healed() -> bool:
            g1 = records(1)
            heals = [r for r in g1 if r.get("ft/heal_s") and r["step"] > killed_at]
            return bool(heals) and g1[-1]["ft/participants"] == 2 and g1[-1]["step"] > heals[0]["step"]

        wait(healed, "n2's group to rejoin and heal")
        assert cluster.job_field(job, "JobState") == "RUNNING"
    finally:
        subprocess.run(["scancel", job], env=cluster.env, timeout=30)
    g0, g1 = records(0), records(1)
    alone = [r["step"] for r in g0 if r["step"] > killed_at and r["ft/participants"] == 1]
    assert alone, "n1's group did not train alone while n2's was down"
    sha = {r["step"]: r["ft/state_sha"] for r in g1}
    shared = [r for r in g0 if r["step"] in sha]
    assert shared and all(sha[r["step"]] == r["ft/state_sha"] for r in shared)
    heal = next(r for r in g1 if r.get("ft/heal_s") and r["step"] > killed_at)
    print(
        f"slurm FT job {job}: n2's group killed after step {killed_at}, n1 trained {len(alone)} steps alone, "
        f"n2 healed at step {heal['step']} in {heal['ft/heal_s']:.2f}s; {len(shared)} steps bitwise equal"
    )
