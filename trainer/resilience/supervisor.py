"""Launch and supervise torchft replica groups: ``python -m trainer.resilience.supervisor [options] --
<overrides>``.

``launch.sh`` runs it when ``FT_GROUPS`` is set (one machine: a lighthouse and every group) and
``slurm/train.sbatch`` with ``FT=1`` (one supervisor per node: the node's group, plus the
lighthouse on the first node). For each of its groups it runs a restart loop:

* every incarnation of a group is a **fresh** ``torchrun --standalone`` (a new rendezvous store on
  a new free port). ``torchrun --max-restarts`` keeps the old store, to which restarted gloo
  workers failed to reconnect (pytorch/pytorch#135712); a new torchrun has none of that state;
* a group that exits non-zero (a crash, a killed rank, exit 4 after a failed collective) is
  started again after ``--restart-delay`` seconds, at most ``--max-restarts`` times; it rejoins
  the quorum and heals from a live peer (or, when no group is left, resumes from the newest DCP
  checkpoint). Exit 0 ends the loop; exit 2 (bad config) stops every group;
* **hang watchdog**: each rank's main thread rewrites ``<dump>/replica_group_<g>/heartbeat/rank<R>``
  at the start of every step. A group whose oldest heartbeat is older than
  ``parallelism.fault_tolerance.hang_timeout_s`` (a rank hung in Python, a deadlock, SIGSTOP) is
  killed (SIGKILL to torchrun and every rank) and restarted. Waiting for a quorum is not a hang (the
  trainer beats while it waits). A hung group whose torchft manager still heartbeats blocks new
  quorums until it is killed (the lighthouse wants more than half of the heartbeating groups); the
  others retry their quorum meanwhile (trainer/resilience/fault_tolerance.py).

Trust (trainer/resilience/trust.py): the lighthouse binds the host of ``--lighthouse`` (not every
interface); each group gets the job's secret file (``--secret-file``; ``--new-secret`` writes a
fresh one, mode 600, removed at exit) in ``$MESHWRIGHT_FT_SECRET_FILE`` and this node's address
(``--address``) in ``$MESHWRIGHT_FT_ADDRESS``, which its heal and manager servers bind.

The supervisor reads the run folder and the fault-tolerance settings from the same overrides the
trainer gets (Hydra composition, the trainer's own config code).
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import IO, Optional

from trainer.resilience.fault_tolerance import ATTEMPT_ENV, HEARTBEAT_DIR, group_folder

EXIT_CONFIG = 2


@dataclass
class Group:
    """One replica group's restart loop state."""

    group_id: int
    proc: Optional[subprocess.Popen] = None
    started: float = 0.0
    restarts: int = 0
    done: bool = False
    failed: bool = False
    log: Optional[IO[bytes]] = None  # the group's log file, open while it runs
    history: list[str] = field(default_factory=list)


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (from /proc): torchrun starts each worker in a session of its own,
    so killing torchrun's process group leaves them running."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", encoding="utf-8") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def read_heartbeats(folder: str) -> dict[str, tuple[float, str, int]]:
    """rank file -> (time, phase, pid) of a group's heartbeat files."""
    out = {}
    beat_dir = os.path.join(folder, HEARTBEAT_DIR)
    for name in os.listdir(beat_dir) if os.path.isdir(beat_dir) else []:
        if name.endswith(".tmp"):
            continue
        try:
            with open(os.path.join(beat_dir, name), encoding="utf-8") as f:
                when, phase, pid = f.read().split()
            out[name] = (float(when), phase, int(pid))
        except (OSError, ValueError):
            continue  # being rewritten
    return out


class Supervisor:
    def __init__(self, args: argparse.Namespace, overrides: list[str]) -> None:
        from trainer.config import compose_config

        self.args = args
        self.overrides = overrides
        cfg = compose_config(*overrides, *self._ft_overrides(0))
        self.ft = cfg.parallelism.fault_tolerance
        self.dump_folder = cfg.job.dump_folder
        self.groups = [Group(g) for g in args.group_ids]
        from trainer.resilience.trust import SECRET_ENV, new_secret, read_secret

        given = args.secret_file or (None if args.new_secret else os.environ.get(SECRET_ENV))
        self.secret_file = os.path.abspath(given or os.path.join(self.dump_folder, "ft_secret"))
        if args.new_secret:
            new_secret(self.secret_file)
        read_secret(self.secret_file)  # a ConfigError (exit 2) before anything starts
        self.lighthouse: Optional[subprocess.Popen] = None
        import torch

        self.gpus = torch.cuda.device_count() if cfg.training.device != "cpu" else 0
        self._stopping = False
        self._signal: Optional[int] = None  # a signal to forward, set by the handler (``run``)

    def _ft_overrides(self, group_id: int) -> list[str]:
        return [
            f"parallelism.dp_replicate={self.args.groups}",
            "parallelism.fault_tolerance.enable=true",
            f"parallelism.fault_tolerance.replica_group_id={group_id}",
            f"parallelism.fault_tolerance.lighthouse={self.args.lighthouse}",
        ]

    def log(self, message: str) -> None:
        print(f"[supervisor {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)

    # -- lighthouse ---------------------------------------------------------------------
    def start_lighthouse(self) -> None:
        binary = shutil.which("torchft_lighthouse")
        if binary is None:
            raise SystemExit("torchft_lighthouse not found on PATH: pip install 'meshwright[ft]'")
        from urllib.parse import urlsplit

        url = urlsplit(self.args.lighthouse)
        if url.hostname is None or url.port is None:
            raise SystemExit(f"--lighthouse={self.args.lighthouse}: expected http://host:port")
        host = f"[{url.hostname}]" if ":" in url.hostname else url.hostname
        # Stragglers that still heartbeat (a hung group) are waited for join_timeout at most, below
        # the trainers' quorum timeout, so a quorum without them forms before anyone gives up.
        join_ms = int(min(self.args.join_timeout_s, 0.5 * self.ft.quorum_timeout_s) * 1000)
        cmd = [
            binary,
            "--min_replicas",
            str(self.ft.min_replicas),
            "--bind",
            f"{host}:{url.port}",  # the job's address only (not every interface)
            "--join_timeout_ms",
            str(join_ms),
            "--heartbeat_timeout_ms",
            str(self.args.heartbeat_timeout_ms),
        ]
        os.makedirs(self.dump_folder, exist_ok=True)
        log = open(os.path.join(self.dump_folder, "lighthouse.log"), "ab")
        self.lighthouse = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self.log(f"lighthouse {' '.join(cmd[1:])} (pid {self.lighthouse.pid})")

    # -- groups -------------------------------------------------------------------------
    def start(self, group: Group) -> None:
        folder = group_folder(self.dump_folder, group.group_id)
        shutil.rmtree(os.path.join(folder, HEARTBEAT_DIR), ignore_errors=True)  # the old incarnation's
        os.makedirs(os.path.join(folder, "logs"), exist_ok=True)
        attempt = group.restarts
        log_path = os.path.join(folder, "logs", f"attempt{attempt}.log")
        group.log = open(log_path, "ab")
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc_per_node={self.args.nproc}",
            self.args.entry,
            *self.overrides,
            *self._ft_overrides(group.group_id),
        ]
        # faulthandler: a rank the hang watchdog stops first prints every thread's stack (SIGABRT).
        from trainer.resilience.trust import ADDRESS_ENV, SECRET_ENV

        env = dict(os.environ, TORCHFT_LIGHTHOUSE=self.args.lighthouse, PYTHONFAULTHANDLER="1")
        env[ATTEMPT_ENV] = str(attempt)  # > 0: a restart (semi_sync: joins the live groups at their sync)
        env.update({SECRET_ENV: self.secret_file, ADDRESS_ENV: self.args.address})
        if self.gpus >= len(self.groups) * self.args.nproc and "CUDA_VISIBLE_DEVICES" not in os.environ:
            first = self.groups.index(group) * self.args.nproc  # each local group its own GPUs
            env["CUDA_VISIBLE_DEVICES"] = ",".join(str(first + i) for i in range(self.args.nproc))
        group.proc = subprocess.Popen(
            cmd, stdout=group.log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        group.started = time.time()
        self.log(f"group {group.group_id} attempt {attempt}: pid {group.proc.pid}, log {log_path}")

    def kill(self, group: Group, why: str, stack_of: Optional[int] = None) -> None:
        if group.proc is not None and group.proc.poll() is None:
            self.log(f"group {group.group_id}: {why}: killing it")
            if stack_of is not None:  # the hung rank's Python stacks into the group's log (if it can run)
                try:
                    os.kill(stack_of, signal.SIGABRT)
                    time.sleep(1.0)
                except ProcessLookupError:
                    pass
            for pid in [group.proc.pid, *descendants(group.proc.pid)]:  # torchrun and its workers
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            group.proc.wait()

    def reap(self, group: Group) -> None:
        """SIGKILL ranks of an ended incarnation that outlived their torchrun (a rank blocked in a
        collective defers SIGTERM to its step boundary, which it never reaches); their pids are in
        the heartbeat files, checked against /proc so that a recycled pid is left alone."""
        for _, _, pid in read_heartbeats(group_folder(self.dump_folder, group.group_id)).values():
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    if os.path.basename(self.args.entry).encode() not in f.read():
                        continue
                os.kill(pid, signal.SIGKILL)
                self.log(f"group {group.group_id}: killed rank process {pid} left over by its torchrun")
            except (OSError, ProcessLookupError):
                continue

    def hung(self, group: Group) -> Optional[tuple[str, int, str]]:
        """(reason, pid) if a rank of ``group`` has not started a step for longer than hang_timeout_s,
        or has finished training but not exited for as long."""
        beats = read_heartbeats(group_folder(self.dump_folder, group.group_id))
        current = {
            name: b for name, b in beats.items() if b[1] in ("step", "done") and b[0] >= group.started - 1
        }
        if not current:
            return None
        name, (when, phase, pid) = min(current.items(), key=lambda item: item[1][0])
        idle = time.time() - when
        if idle <= self.ft.hang_timeout_s:
            return None
        what = "has not started a step" if phase == "step" else "finished training but has not exited"
        return (
            f"{name} (pid {pid}) {what} for {idle:.1f}s > hang_timeout_s={self.ft.hang_timeout_s:g}",
            pid,
            phase,
        )

    def poll(self, group: Group) -> None:
        if group.done or group.failed or group.proc is None:
            return
        rc = group.proc.poll()
        if rc is None:
            hang = self.hung(group)
            if hang is None:
                return
            self.kill(group, f"hang watchdog: {hang[0]}", stack_of=hang[1])
            rc = 0 if hang[2] == "done" else group.proc.returncode  # stuck in teardown: it did finish
        self.reap(group)
        if group.log is not None:  # opened with the process
            group.log.close()
        group.history.append(str(rc))
        if rc == 0:
            group.done = True
            self.log(f"group {group.group_id} finished")
            return
        if rc == EXIT_CONFIG:
            self.log(f"group {group.group_id}: config error (exit 2); stopping every group")
            group.failed = True
            self.stop(EXIT_CONFIG)
            return
        if group.restarts >= self.args.max_restarts:
            self.log(
                f"group {group.group_id} exited {rc}; no restarts left "
                f"(--max-restarts={self.args.max_restarts})"
            )
            group.failed = True
            return
        group.restarts += 1
        self.log(f"group {group.group_id} exited {rc}; restart {group.restarts}/{self.args.max_restarts}")
        time.sleep(self.args.restart_delay)
        self.start(group)

    def stop(self, code: int) -> None:
        for group in self.groups:
            self.kill(group, "stopping")
        self._stopping = True
        self._code = code

    def _on_signal(self, signum: int, frame: object) -> None:
        self._signal = signum  # handled by the main loop

    def forward(self, signum: int) -> None:
        """SIGTERM/SIGUSR1 (preemption, scancel): pass it to every group (each rank checkpoints if its
        group writes checkpoints, and exits 75), wait up to --stop-grace-s, then kill what is left."""
        name = signal.Signals(signum).name
        self.log(f"got {name}: forwarding it to every group")
        running = [(g, g.proc) for g in self.groups if g.proc is not None and g.proc.poll() is None]
        for _, proc in running:
            try:
                os.kill(proc.pid, signum)  # torchrun forwards it to its workers
            except ProcessLookupError:
                pass
        deadline = time.time() + self.args.stop_grace_s
        codes = []
        for group, proc in running:
            try:
                codes.append(proc.wait(timeout=max(deadline - time.time(), 0.1)))
            except subprocess.TimeoutExpired:
                self.kill(group, f"still running {self.args.stop_grace_s:g}s after {name}")
                codes.append(1)
        self._stopping = True
        self._code = max(codes, default=0) or 0

    def run(self) -> int:
        self._code = 0
        self._signal = None
        if self.args.start_lighthouse:
            self.start_lighthouse()
        for sig in (signal.SIGTERM, signal.SIGUSR1):
            signal.signal(sig, self._on_signal)
        try:
            for group in self.groups:
                self.start(group)
            while not self._stopping and not all(g.done or g.failed for g in self.groups):
                time.sleep(0.2)
                if self._signal is not None:
                    self.forward(self._signal)
                    break
                for group in self.groups:
                    self.poll(group)
        finally:
            for group in self.groups:
                self.kill(group, "supervisor exiting")
            if self.lighthouse is not None:
                os.killpg(self.lighthouse.pid, signal.SIGTERM)
                self.lighthouse.wait()
            if self.args.new_secret:  # this supervisor's own secret: gone with its job
                try:
                    os.remove(self.secret_file)
                except FileNotFoundError:
                    pass
        summary = ", ".join(f"group {g.group_id}: exits [{' '.join(g.history)}]" for g in self.groups)
        self.log(f"done: {summary}")
        if self._code:
            return self._code
        return 1 if any(g.failed for g in self.groups) else 0


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", type=int, required=True, help="replica groups in the job (dp_replicate)")
    parser.add_argument(
        "--group-ids", type=str, default="all", help="groups this supervisor runs: all | 0,1,..."
    )
    parser.add_argument("--nproc", type=int, default=1, help="ranks per group (torchrun --nproc_per_node)")
    parser.add_argument(
        "--lighthouse", default="http://localhost:29510", help="lighthouse URL http://host:port"
    )
    parser.add_argument(
        "--start-lighthouse",
        action="store_true",
        help="start torchft_lighthouse here, bound to the URL's host",
    )
    parser.add_argument(
        "--address",
        default="localhost",
        help="this node's address: the groups' heal and manager servers bind it (not every interface)",
    )
    parser.add_argument(
        "--secret-file",
        default=None,
        help="the job's secret (mode 600): default $MESHWRIGHT_FT_SECRET_FILE (not with --new-secret), "
        "else <dump_folder>/ft_secret",
    )
    parser.add_argument(
        "--new-secret",
        action="store_true",
        help="write a fresh secret to --secret-file first (removed at exit)",
    )
    parser.add_argument("--join-timeout-s", type=float, default=5.0, help="lighthouse: wait for stragglers")
    parser.add_argument("--heartbeat-timeout-ms", type=int, default=1000, help="lighthouse: dead after")
    parser.add_argument("--max-restarts", type=int, default=3, help="restarts per group")
    parser.add_argument("--restart-delay", type=float, default=1.0, help="seconds before a restart")
    parser.add_argument(
        "--stop-grace-s", type=float, default=90.0, help="after SIGTERM/SIGUSR1: wait, then kill"
    )
    parser.add_argument("--entry", default=os.path.join(os.path.dirname(__file__), "..", "main.py"))
    argv = list(argv)
    overrides: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, overrides = argv[:i], argv[i + 1 :]
    args = parser.parse_args(argv)
    if args.groups < 1:
        parser.error(f"--groups={args.groups} must be >= 1")
    ids = range(args.groups) if args.group_ids == "all" else [int(x) for x in args.group_ids.split(",")]
    args.group_ids = list(ids)
    if any(not 0 <= g < args.groups for g in args.group_ids):
        parser.error(f"--group-ids={args.group_ids} must lie in [0, {args.groups})")
    args.entry = os.path.abspath(args.entry)
    return args, overrides


def main(argv: Optional[list[str]] = None) -> None:
    from models.errors import ConfigError

    args, overrides = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        supervisor = Supervisor(args, overrides)
    except ConfigError as e:
        print(f"[supervisor] config error: {e}", file=sys.stderr, flush=True)
        sys.exit(EXIT_CONFIG)
    sys.exit(supervisor.run())


if __name__ == "__main__":
    main()
