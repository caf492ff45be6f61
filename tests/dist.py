"""The multi-process test harness is the spawner in ``tests/spawn.py`` (not shipped: only the tests
and the benchmarks use it): run a function on N gloo ranks with bounded waits and a report of which
rank died and how.

The tests start their ranks from a fork server (``start_method="forkserver"``) that imported
torch and the trainer once per test session: a freshly spawned interpreter spends ~3-4 s (more
on a loaded 2-core machine) importing them, for every rank of every launch. A forked rank
starts from the state of a fresh import (the server only imports), and is handed what a spawned
rank would inherit from the test process at the moment of the launch rather than at the
server's start: the environment, the working directory and stdout/stderr (so pytest captures a
rank's output in the test that launched it).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp

from tests.spawn import DistributedError, describe_exit, free_port
from tests.spawn import run_distributed as _run_distributed

__all__ = ["DistributedError", "describe_exit", "free_port", "run_distributed"]

START_METHOD = "forkserver"
# What every rank imports anyway; imported once, in the server. torch._dynamo is imported by the
# first model initialisation of a rank (torch._refs.normal_ under a device context goes through
# torch._compile): ~1.5-4 s of CPU per rank and launch on 2 cores, once per session here instead.
PRELOAD = [
    "torch",
    "torch.distributed",
    "torch._dynamo",
    "trainer.train",
    "trainer.checkpoint.checkpointer",
    "tests.configs",
    "tests.parity",
]
# Set by tests/spawn.py's worker for its rank: kept when the test process's environment is applied.
_RANK_ENV = (
    "MASTER_ADDR",
    "MASTER_PORT",
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "OMP_NUM_THREADS",
)

mp.get_context(START_METHOD).set_forkserver_preload(PRELOAD)


def _restore_stdio(out: Any, err: Any) -> None:
    """In the rank, while its arguments are unpickled: stdout/stderr become the launcher's."""
    for fd, dup in ((1, out.detach()), (2, err.detach())):
        os.dup2(dup, fd)
        os.close(dup)


class _LauncherStdio:
    """Pickles as the launching process's file descriptors 1 and 2 (passed along by multiprocessing)."""

    def __reduce__(self) -> tuple:
        from multiprocessing.reduction import DupFd

        sys.stdout.flush()
        sys.stderr.flush()
        return (_restore_stdio, (DupFd(1), DupFd(2)))


def _as_launched(
    rank: int, world_size: int, fn: Callable[..., Any], env: dict, cwd: str, _stdio: None, *args: Any
) -> Any:
    """In the rank: the launcher's environment (keeping this rank's own variables) and working
    directory, then ``fn``."""
    own = {k: os.environ[k] for k in _RANK_ENV if k in os.environ}
    os.environ.clear()
    os.environ.update(env)
    os.environ.update(own)
    os.chdir(cwd)
    return fn(rank, world_size, *args)


def run_distributed(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 300.0) -> list[Any]:
    """``tests.spawn.run_distributed`` with ranks forked from the session's preloaded fork server."""
    return _run_distributed(
        _as_launched,
        world_size,
        fn,
        dict(os.environ),
        os.getcwd(),
        _LauncherStdio(),
        *args,
        timeout=timeout,
        start_method=START_METHOD,
    )
