"""Run a function on N gloo ranks in spawned processes (CPU): the test harness and the benchmarks use it.

Every wait is bounded, so a broken run fails the test instead of hanging the suite:

* each rank reports through its own pipe, and the parent waits on those pipes and on the
  processes' exit sentinels together: a rank that dies without reporting (SIGKILL, a
  segfault, ``os._exit``) is noticed the moment it exits, with its exit code or signal name;
* once one rank has failed, the others get ``FAILURE_GRACE_S`` to report their own error
  (usually a collective that lost its peer); the rest print every thread's stack (SIGUSR1 to
  faulthandler) and are killed, as a group with any children they started, and named as
  collateral;
* ``timeout`` bounds the whole run, and the gloo process group gets the same timeout, so a
  collective stuck inside a rank errors out even if the parent itself was killed.

Failures raise :class:`DistributedError`, whose message names each rank and what happened
to it, root causes first.
"""

from __future__ import annotations

import faulthandler
import os
import pickle
import re
import signal
import socket
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

FAILURE_GRACE_S = 5.0  # after the first failure: time the other ranks get to report theirs
EXIT_GRACE_S = 30.0  # after every rank reported: time each gets to tear down and exit
STACK_DUMP_S = 1.0  # before a still-running rank is killed: time it gets to print its stacks


class DistributedError(RuntimeError):
    """A multi-process run failed; ``outcomes`` maps each rank to a one-line account."""

    def __init__(self, message: str, outcomes: dict[int, str]) -> None:
        super().__init__(message)
        self.outcomes = outcomes


def free_port() -> int:
    """A TCP port on localhost that is free right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def describe_exit(exitcode: int | None) -> str:
    """'killed by signal SIGKILL (exit code -9)', 'exited with code 3', or 'still running'."""
    if exitcode is None:
        return "still running"
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        return f"killed by signal {name} (exit code {exitcode})"
    return f"exited with code {exitcode}"


def _worker(
    rank: int,
    world_size: int,
    port: int,
    fn: Callable[..., Any],
    args: tuple,
    conn: Connection,
    timeout: float,
) -> None:
    os.setpgrp()  # its own process group: the parent can kill it together with its children
    # A rank that aborts or segfaults (SIGABRT/SIGSEGV inside a kernel or gloo) prints its Python
    # stack to stderr before it dies, so the test's output says where.
    faulthandler.enable(all_threads=True)
    # A rank still running when another failed gets SIGUSR1 before it is killed: it prints every
    # thread's Python stack, so a hang says where each rank was (not only the one that timed out).
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
        OMP_NUM_THREADS="1",
    )
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout))
        result = fn(rank, world_size, *args)
        # Plain pickle, by value: torch's ForkingPickler would share tensors through file
        # descriptors that vanish when this process exits before the parent reads them.
        conn.send_bytes(pickle.dumps(("ok", result)))
    except BaseException:  # report every failure to the parent, then re-raise
        conn.send_bytes(pickle.dumps(("error", traceback.format_exc())))
        raise
    finally:
        conn.close()
        if dist.is_initialized():
            dist.destroy_process_group()


def _dump_stacks(procs: list[mp.Process]) -> None:
    """Ask ranks that are still running to print their stacks (SIGUSR1, see ``_worker``), and give
    them a moment to write before they are killed."""
    signalled = False
    for proc in procs:
        try:
            os.kill(proc.pid, signal.SIGUSR1)
            signalled = True
        except (ProcessLookupError, PermissionError):
            continue
    if signalled:
        time.sleep(STACK_DUMP_S)


def _kill(proc: mp.Process) -> None:
    """SIGKILL a worker and everything in its process group."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        proc.kill()


def run_distributed(
    fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 300.0, start_method: str = "spawn"
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; return the per-rank results.

    ``fn`` must be a module-level function (it is pickled) and its result picklable. Raises
    :class:`DistributedError` if a rank raises, dies, or the run exceeds ``timeout`` seconds.
    ``start_method="forkserver"`` forks the ranks from a server process that imported its
    preload modules once (``set_forkserver_preload``), instead of a fresh interpreter per rank.
    """
    ctx = mp.get_context(start_method)
    port = free_port()
    conns: list[Connection] = []
    procs: list[mp.Process] = []
    pending: set[int] = set()
    try:
        for r in range(world_size):
            recv, send = ctx.Pipe(duplex=False)
            p = ctx.Process(target=_worker, args=(r, world_size, port, fn, args, send, timeout), daemon=False)
            p.start()
            send.close()  # the parent keeps only the read end: EOF once the rank is gone
            conns.append(recv)
            procs.append(p)
        results, failures, pending = _collect(conns, procs, timeout)
    finally:
        _dump_stacks([procs[r] for r in sorted(pending) if procs[r].is_alive()])
        for p in procs:
            if p.is_alive():
                _kill(p)
        for p in procs:
            p.join(timeout=EXIT_GRACE_S)
        for c in conns:
            c.close()
    if failures or pending:
        outcomes = dict(failures)  # root causes, in the order they were seen
        cause = "after " + ", ".join(f"rank {r}" for r in failures) + " failed" if failures else None
        late = (
            f"no result within the {timeout:.0f} s timeout, killed by the harness (hung, or too slow; "
            "its threads' stacks are on stderr)"
        )
        for r in sorted(pending):
            outcomes[r] = (
                f"no result, killed by the harness {cause} (probably waiting in a collective; "
                "its threads' stacks are on stderr)"
                if cause
                else late
            )
        for r in range(world_size):
            outcomes.setdefault(r, "finished")
        header = f"distributed run of {getattr(fn, '__name__', fn)} on {world_size} rank(s) failed"
        lines = [f"rank {r}: {outcomes[r]}" for r in outcomes]
        # Each rank's account again in one line, last: a log cut to its head and tail (a CI excerpt)
        # still shows the root cause, not only the peer's lost connection that a long traceback ends on.
        summary = [f"rank {r}: {_in_one_line(outcomes[r])}" for r in outcomes]
        message = "\n".join([header, *lines, "in short:", *summary])
        raise DistributedError(message, outcomes)
    return [results[r] for r in range(world_size)]


_CHAINED = re.compile(
    r"^(The above exception was the direct cause of the following exception:|"
    r"During handling of the above exception, another exception occurred:)$",
    re.M,
)


def _in_one_line(account: str) -> str:
    """A rank's account in one line: the exception line of each traceback in a chain (the cause
    first), or the account itself when it is no traceback; each shortened."""
    ends = []
    for part in _CHAINED.split(account):
        lines = [line.strip() for line in part.splitlines() if line.strip()]
        if lines and not _CHAINED.match(lines[-1]):
            last = lines[-1]
            ends.append(last if len(last) <= 240 else last[:237] + "...")
    return " -> ".join(ends) if ends else account


def _collect(
    conns: list[Connection], procs: list[mp.Process], timeout: float
) -> tuple[dict[int, Any], dict[int, str], set[int]]:
    """Wait for every rank's report, a death, or the deadline; return (results, failures, pending)."""
    results: dict[int, Any] = {}
    died: dict[int, str] = {}
    raised: dict[int, str] = {}
    pending = set(range(len(procs)))
    deadline = time.monotonic() + timeout
    stop_at = deadline
    while pending:
        remaining = stop_at - time.monotonic()
        if remaining <= 0:
            break
        handles = [conns[r] for r in pending] + [procs[r].sentinel for r in pending]
        wait(handles, timeout=min(remaining, 1.0))
        for r in sorted(pending):
            outcome = _poll_rank(conns[r], procs[r])
            if outcome is None:
                continue
            pending.discard(r)
            status, payload = outcome
            if status == "ok":
                results[r] = payload
                continue
            (died if status == "died" else raised)[r] = payload
            stop_at = min(stop_at, time.monotonic() + FAILURE_GRACE_S)
    # A rank that died is the likelier root cause than one whose collective then lost its peer.
    return results, {**died, **raised}, pending


def _poll_rank(conn: Connection, proc: mp.Process) -> tuple[str, Any] | None:
    """('ok', result), ('error', traceback) or ('died', account) once the rank is done; None while it runs."""
    if conn.poll():
        try:
            status, payload = pickle.loads(conn.recv_bytes())
        except EOFError:  # it closed the pipe without a word: it died
            proc.join(timeout=EXIT_GRACE_S)
            return "died", f"{describe_exit(proc.exitcode)} without reporting a result"
        if status == "ok":
            return status, payload
        return status, f"raised (pid {proc.pid}):\n{payload}"
    if not proc.is_alive():
        proc.join()
        if conn.poll():  # it reported just before exiting
            return _poll_rank(conn, proc)
        return "died", f"{describe_exit(proc.exitcode)} without reporting a result"
    return None
