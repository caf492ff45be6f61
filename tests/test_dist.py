"""The multi-process harness fails fast and says which rank died and how, instead of hanging."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch.distributed as dist

from tests.dist import DistributedError, describe_exit, run_distributed

pytestmark = pytest.mark.slow


def _rank1_killed_rank0_in_barrier(rank: int, world_size: int) -> None:
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    dist.barrier()  # never completes: its peer is gone


def _rank1_hangs(rank: int, world_size: int) -> int:
    if rank == 1:
        time.sleep(3600)
    return rank


def test_a_rank_killed_by_a_signal_is_named_and_nothing_hangs() -> None:
    start = time.monotonic()
    with pytest.raises(DistributedError) as info:
        run_distributed(_rank1_killed_rank0_in_barrier, 2, timeout=120)
    elapsed = time.monotonic() - start
    message = str(info.value)
    assert info.value.outcomes[1] == "killed by signal SIGKILL (exit code -9) without reporting a result"
    assert message.splitlines()[1].startswith("rank 1: killed by signal SIGKILL"), message  # root cause first
    # Rank 0 either saw its barrier fail (gloo noticed the closed socket) or was killed by the harness.
    assert (
        "raised" in info.value.outcomes[0] or "killed by the harness after rank 1" in info.value.outcomes[0]
    )
    assert elapsed < 60, elapsed  # not the 120 s timeout


def test_a_hung_rank_is_killed_at_the_timeout() -> None:
    # (Results larger than a pipe's buffer are covered by every parity test: they return weights.)
    # 6 s: the clock starts once the ranks are forked (the fork server is up by then), and a forked
    # rank joins its process group in well under a second.
    with pytest.raises(DistributedError, match=r"rank 1: no result within the 6 s timeout"):
        run_distributed(_rank1_hangs, 2, timeout=6)


def test_describe_exit() -> None:
    assert describe_exit(-signal.SIGSEGV) == "killed by signal SIGSEGV (exit code -11)"
    assert describe_exit(3) == "exited with code 3"
    assert describe_exit(None) == "still running"
