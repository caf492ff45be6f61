"""Drive fault-tolerant jobs the way a user runs them (``FT_GROUPS=N NPROC=P ./launch.sh ...``) and
inject failures: the fault-tolerance tests and ``benchmarks/bench_ft.py`` use it."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
from typing import Any, Optional

from tests.configs import REPO
from trainer.resilience.fault_tolerance import HEARTBEAT_DIR, STEP_DELAY_ENV, group_folder

# Short timeouts for one machine: a dead peer costs <= timeout_s, the lighthouse drops a silent
# group after 1 s, a stalled group is killed after hang_timeout_s.
FT_FAST = (
    "parallelism.fault_tolerance.timeout_s=3",
    "parallelism.fault_tolerance.quorum_timeout_s=60",
    "parallelism.fault_tolerance.hang_timeout_s=65",
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def clean_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", **extra)
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHFT_LIGHTHOUSE"):
        env.pop(key, None)
    return env


class FTJob:
    """``FT_GROUPS=groups NPROC=nproc ./launch.sh <overrides>`` with its own lighthouse port."""

    def __init__(
        self,
        dump: str,
        overrides: tuple[str, ...],
        *,
        groups: int = 2,
        nproc: int = 1,
        step_delay_s: float = 0.0,
        supervisor_args: str = "--max-restarts 5 --restart-delay 0.5",
        env: Optional[dict[str, str]] = None,
    ) -> None:
        self.dump = dump
        self.groups = groups
        extra = env
        env = clean_env(
            FT_GROUPS=str(groups),
            NPROC=str(nproc),
            FT_LIGHTHOUSE_PORT=str(free_port()),
            FT_ARGS=supervisor_args,
        )
        if step_delay_s:
            env[STEP_DELAY_ENV] = str(step_delay_s)
        env.update(extra or {})
        os.makedirs(dump, exist_ok=True)
        self.log_path = os.path.join(dump, "supervisor.log")
        self._log = open(self.log_path, "ab")
        self.started = time.time()
        self.proc = subprocess.Popen(
            ["./launch.sh", *overrides, f"job.dump_folder={dump}"],
            cwd=REPO,
            env=env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )

    def records(self, group: int) -> list[dict[str, Any]]:
        path = os.path.join(group_folder(self.dump, group), "metrics.jsonl")
        if not os.path.exists(path):
            return []
        with open(path, encoding="utf-8") as f:
            return [r for r in (json.loads(line) for line in f if line.strip()) if "loss" in r]

    def last_step(self, group: int) -> int:
        records = self.records(group)
        return records[-1]["step"] if records else 0

    def wait_for(self, condition: Any, timeout: float, what: str) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            if condition():
                return
            if self.proc.poll() is not None:
                raise AssertionError(
                    f"the job ended (exit {self.proc.returncode}) before {what}:\n{self.log()}"
                )
            time.sleep(0.1)
        raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}:\n{self.log()}")

    def worker_pid(self, group: int, rank: int = 0) -> int:
        with open(
            os.path.join(group_folder(self.dump, group), HEARTBEAT_DIR, f"rank{rank}"), encoding="utf-8"
        ) as f:
            return int(f.read().split()[2])

    def signal_group(self, group: int, sig: int, rank: int = 0) -> float:
        """Send ``sig`` to a rank of ``group`` (its trainer process); returns the time."""
        os.kill(self.worker_pid(group, rank), sig)
        return time.time()

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.stop()
            raise AssertionError(f"the job did not finish in {timeout:.0f}s:\n{self.log()}") from None

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)  # the supervisor kills its groups and the lighthouse
            try:
                self.proc.wait(timeout=120)  # groups checkpoint (the writer) and exit 75
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self._log.close()

    def log(self, tail: int = 60) -> str:
        with open(self.log_path, encoding="utf-8", errors="replace") as f:
            return "".join(f.readlines()[-tail:])

    def supervisor_lines(self) -> list[str]:
        with open(self.log_path, encoding="utf-8", errors="replace") as f:
            return [line for line in f if line.startswith("[supervisor")]


def stalls(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The survivor's view of each change of the quorum: the first step with fewer participants (the
    failure: a discarded attempt, if the peer died inside the step, plus the new quorum) or more (the
    rejoin: the heal it serves), with its duration (seconds since the previous committed step)."""
    out = []
    for prev, r in zip(records, records[1:]):
        if r["ft/participants"] != prev["ft/participants"]:
            kind = "failure" if r["ft/participants"] < prev["ft/participants"] else "rejoin"
            out.append(
                {
                    "step": r["step"],
                    "kind": kind,
                    "stall_s": r["step_time_s"],
                    "discarded": r["ft/discarded_steps"] - prev["ft/discarded_steps"],
                }
            )
    return out


def first(records: list[dict[str, Any]], key: str) -> Optional[dict[str, Any]]:
    return next((r for r in records if r.get(key) is not None), None)


def compare_with_ddp(groups: list[list[dict[str, Any]]], expected: list[dict[str, Any]]) -> float:
    """Two replica groups' step records against plain DDP's, step by step: the groups bitwise equal to
    each other (replica digest, loss, grad norm); returns the worst relative loss / grad-norm error
    against DDP."""
    worst = 0.0
    for r0, r1, e in zip(*groups, expected, strict=True):
        assert r0["step"] == r1["step"] == e["step"]
        assert r0["ft/participants"] == r1["ft/participants"] == 2
        assert r0["ft/state_sha"] == r1["ft/state_sha"], "replica groups diverged"
        assert r0["loss"] == r1["loss"] and r0["grad_norm"] == r1["grad_norm"]
        for key in ("loss", "grad_norm"):
            worst = max(worst, abs(r0[key] - e[key]) / abs(e[key]))
    return worst


def weight_error(ft_checkpoint: str, ddp_checkpoint: str) -> float:
    """Largest absolute difference between the weights of two checkpoint folders (step-N)."""
    from trainer.checkpoint.load import load_model

    ft_model, _ = load_model(ft_checkpoint)
    ddp_state = load_model(ddp_checkpoint)[0].state_dict()
    return max((v - ddp_state[k]).abs().max().item() for k, v in ft_model.state_dict().items())
