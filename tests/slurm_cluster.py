"""A private two-node Slurm cluster on this machine, for tests.

Its own munge key and socket, a ``slurm.conf`` with ``NodeName=n1``/``n2`` both on localhost
(each slurmd on its own port), one ``slurmctld`` and one ``slurmd -N nX`` per node, all state
and logs in a temporary folder; every daemon is started in the foreground and stopped by pid.
Needs root (slurmd launches the jobs' tasks) and the Debian packages ``slurm-wlm`` and
``munge``; :func:`unavailable` says why a machine cannot run it.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from typing import Optional

from tests.dist import free_port

BINARIES = ("munged", "slurmctld", "slurmd", "sbatch", "scontrol", "srun")


def unavailable() -> Optional[str]:
    """None if a private cluster can be started here, else the reason it cannot."""
    missing = [b for b in BINARIES if shutil.which(b) is None]
    if missing:
        return f"Slurm/munge not installed (missing {', '.join(missing)}; apt-get install slurm-wlm munge)"
    if os.geteuid() != 0:
        return "a private Slurm cluster needs root (slurmd starts the jobs' tasks)"
    return None


@dataclass
class SlurmCluster:
    root: str
    env: dict[str, str]
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)

    def run(self, *cmd: str, timeout: float = 30) -> str:
        """A Slurm client command against this cluster; its stdout."""
        out = subprocess.run(cmd, env=self.env, capture_output=True, text=True, timeout=timeout)
        if out.returncode != 0:
            raise RuntimeError(
                f"{' '.join(cmd)} failed ({out.returncode}): {out.stderr.strip()}\n{self.logs()}"
            )
        return out.stdout

    def job_field(self, job_id: str, key: str) -> str:
        """One field of ``scontrol show job`` (e.g. JobState, Restarts, ExitCode)."""
        for token in self.run("scontrol", "show", "job", job_id, "-o").split():
            name, _, value = token.partition("=")
            if name == key:
                return value
        raise KeyError(key)

    def wait_state(self, job_id: str, states: tuple[str, ...], timeout: float) -> str:
        end = time.monotonic() + timeout
        state = ""
        while time.monotonic() < end:
            state = self.job_field(job_id, "JobState")
            if state in states:
                return state
            time.sleep(1)
        raise TimeoutError(f"job {job_id} still {state} after {timeout:.0f}s\n{self.logs()}")

    def logs(self) -> str:
        parts = []
        for name in sorted(os.listdir(self.root)):
            if name.endswith(".log"):
                with open(os.path.join(self.root, name), errors="replace") as f:
                    parts.append(f"--- {name}\n" + "".join(f.readlines()[-15:]))
        return "\n".join(parts)

    def stop(self) -> None:
        """SIGTERM every daemon this cluster started (by pid), SIGKILL what is left after 15 s; then
        SIGKILL what its jobs left behind (:meth:`strays`)."""
        for proc in reversed(list(self.procs.values())):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        end = time.monotonic() + 15
        for proc in reversed(list(self.procs.values())):
            try:
                proc.wait(timeout=max(end - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)
        for pid in self.strays():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def strays(self) -> list[int]:
        """Processes of this cluster's jobs still alive: a job running when its slurmd stops leaves
        its ``slurmstepd`` (and any task) waiting for a controller that is gone, for good. They carry
        this cluster's ``SLURM_CONF`` in their environment, which nothing else on the machine does."""
        mark = f"SLURM_CONF={self.env['SLURM_CONF']}".encode()
        found = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit() or int(entry) == os.getpid():
                continue
            try:
                with open(f"/proc/{entry}/environ", "rb") as f:
                    if mark in f.read().split(b"\0"):
                        found.append(int(entry))
            except OSError:  # gone, or not ours to read
                continue
        return found


def _conf(root: str, ctld_port: int, node_ports: tuple[int, int]) -> str:
    host = socket.gethostname()
    return f"""\
ClusterName=mw{random.randrange(10**6)}
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={root}/munge.socket
CredType=cred/munge
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool-%n
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd-%n.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd-%n.log
PlugStackConfig={root}/plugstack.conf
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/builtin
MpiDefault=none
ReturnToService=2
JobRequeue=1
KillWait=60
MinJobAge=3600
InactiveLimit=0
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
FirstJobId={random.randrange(1000, 10**6)}
NodeName=n1 NodeHostname=localhost NodeAddr=127.0.0.1 Port={node_ports[0]} CPUs=2 State=UNKNOWN
NodeName=n2 NodeHostname=localhost NodeAddr=127.0.0.1 Port={node_ports[1]} CPUs=2 State=UNKNOWN
PartitionName=debug Nodes=n[1-2] Default=YES MaxTime=INFINITE State=UP
"""


def start_cluster(root: str, env: dict[str, str]) -> SlurmCluster:
    """Start munged, slurmctld and two slurmd; return once both nodes are idle."""
    os.makedirs(os.path.join(root, "state"), mode=0o700, exist_ok=True)
    with open(os.path.join(root, "munge.key"), "wb") as f:
        f.write(os.urandom(1024))
    os.chmod(os.path.join(root, "munge.key"), 0o400)
    open(os.path.join(root, "plugstack.conf"), "w").close()
    conf = os.path.join(root, "slurm.conf")
    with open(conf, "w") as f:
        f.write(_conf(root, free_port(), (free_port(), free_port())))
    env = dict(env, SLURM_CONF=conf)
    cluster = SlurmCluster(root=root, env=env)
    daemons = {
        "munged": [
            "munged",
            "-F",
            "-f",
            f"--socket={root}/munge.socket",
            f"--key-file={root}/munge.key",
            f"--pid-file={root}/munged.pid",
            f"--log-file={root}/munged.log",
            f"--seed-file={root}/munged.seed",
        ],
        "slurmctld": ["slurmctld", "-D", "-c", "-i", "-f", conf],
        "slurmd-n1": ["slurmd", "-D", "-N", "n1", "-f", conf],
        "slurmd-n2": ["slurmd", "-D", "-N", "n2", "-f", conf],
    }
    try:
        for name, cmd in daemons.items():
            out = open(os.path.join(root, f"{name}.stdout.log"), "w")  # noqa: SIM115
            cluster.procs[name] = subprocess.Popen(
                cmd, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=root
            )
            if name == "munged":
                _wait_for(lambda: os.path.exists(f"{root}/munge.socket"), 20, "munged socket", cluster)
            elif name == "slurmctld":
                _wait_for(lambda: _ok(cluster, "scontrol", "ping"), 30, "slurmctld", cluster)
        _wait_for(lambda: _nodes_idle(cluster), 60, "both nodes idle", cluster)
    except BaseException:
        cluster.stop()
        raise
    return cluster


def _ok(cluster: SlurmCluster, *cmd: str) -> bool:
    out = subprocess.run(cmd, env=cluster.env, capture_output=True, text=True, timeout=20)
    return out.returncode == 0 and "DOWN" not in out.stdout


def _nodes_idle(cluster: SlurmCluster) -> bool:
    out = subprocess.run(
        ["sinfo", "-h", "-N", "-o", "%N %t"], env=cluster.env, capture_output=True, text=True, timeout=20
    )
    states = dict(line.split() for line in out.stdout.splitlines() if line.strip())
    return states.get("n1") == "idle" and states.get("n2") == "idle"


def _wait_for(check, timeout: float, what: str, cluster: SlurmCluster) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        for name, proc in cluster.procs.items():
            if proc.poll() is not None:
                raise RuntimeError(
                    f"{name} exited with {proc.returncode} while waiting for {what}\n{cluster.logs()}"
                )
        if check():
            return
        time.sleep(0.5)
    raise TimeoutError(f"{what} not ready after {timeout:.0f}s\n{cluster.logs()}")
