"""A full checkpoint disk is an operational error, on a real (small) tmpfs.

Real CLI processes (``python trainer/main.py`` and ``torchrun``) write their checkpoints to a
tmpfs with room for one tiny-run checkpoint (~3.6 MB) but not two:

* sync, 1 process: the step-4 save fails; the partial folder is removed, the run stops with
  exit status 74 and a message naming the folder, the bytes needed and free and the intact
  step-2 checkpoint. With room made (remount), the same command resumes from step 2 and logs
  the uninterrupted run's losses bitwise (same layout resumed).
* async, 2 ranks (FSDP x2): both ranks stop with the message and exit status 74.
* a disk that cannot hold even one checkpoint is a config error (exit 2) at start.

Mounting needs root (CI runs as root); elsewhere the test is skipped, saying why.
"""

from __future__ import annotations

import json
import os
import re
import subprocess

import pytest

from tests.configs import REPO, TINY
from trainer.checkpoint.checkpointer import complete_steps
from trainer.checkpoint.space import EXIT_DISK_FULL

pytestmark = pytest.mark.slow

RUN = (
    *TINY,
    "training.deterministic=true",
    "checkpoint.enable=true",
    "checkpoint.interval=2",
    "checkpoint.keep_latest=0",
)
MESSAGE = re.compile(
    r"checkpoint step 4 could not be written: the disk holding (\S+) is full \(a checkpoint needs "
    r"about [\d.]+ MiB, [\d.]+ (KiB|MiB|B) are free (after removing the partial step-4 folder|when the "
    r"write failed)\)\. The newest intact checkpoint is (\S+): the same command resumes from it"
)


@pytest.fixture
def tmpfs(tmp_path):
    """A mount helper: ``tmpfs(name, size)`` mounts a tmpfs at tmp_path/name; all unmounted after."""
    mounted: list[str] = []

    def mount(name: str, size: str) -> str:
        path = str(tmp_path / name)
        os.makedirs(path, exist_ok=True)
        opts = f"size={size}"
        if path in mounted:
            opts = f"remount,{opts}"
        res = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", opts, "tmpfs", path], capture_output=True, text=True
        )
        if res.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs (needs root): {res.stderr.strip()}")
        if path not in mounted:
            mounted.append(path)
        return path

    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    yield mount
    for path in mounted:
        subprocess.run(["umount", "-l", path], check=False)


def _env() -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        env.pop(key, None)
    return env


def _run(dump: str, *extra: str, nproc: int = 1) -> tuple[int, str]:
    launcher = ["python"] if nproc == 1 else ["torchrun", "--standalone", f"--nproc_per_node={nproc}"]
    cmd = [*launcher, "trainer/main.py", *RUN, *extra, f"job.dump_folder={dump}"]
    res = subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=300)
    return res.returncode, res.stdout + res.stderr


def _losses(dump: str) -> dict[int, float]:
    with open(os.path.join(dump, "metrics.jsonl"), encoding="utf-8") as f:
        return {r["step"]: r["loss"] for r in map(json.loads, f) if "loss" in r}


def test_full_disk_stops_with_a_message_and_the_resume_is_exact(tmp_path, tmpfs) -> None:
    rc, out = _run(str(tmp_path / "straight"))
    assert rc == 0, out[-3000:]
    want = _losses(str(tmp_path / "straight"))

    disk = tmpfs("disk", "6m")  # one checkpoint (~3.6 MB) fits, two do not
    dump = os.path.join(disk, "run")
    rc, out = _run(dump)
    print(next(line for line in out.splitlines() if "could not be written" in line))
    assert rc == EXIT_DISK_FULL, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    assert "the save will likely fail" in out  # the warning before the save
    m = MESSAGE.search(out)
    assert m, out[-3000:]
    folder = os.path.join(dump, "checkpoints")
    assert m.group(1) == folder and m.group(4) == os.path.join(folder, "step-2")
    assert sorted(os.listdir(folder)) == ["step-2"]  # the partial step-4 folder is gone
    assert complete_steps(folder) == [2]

    tmpfs("disk", "64m")  # make room: the same command resumes exactly
    rc, out = _run(dump)
    assert rc == 0, out[-3000:]
    assert "loaded step 2" in out
    got = _losses(dump)
    assert [got[s] for s in range(3, 9)] == [want[s] for s in range(3, 9)]  # bitwise: same layout


def test_full_disk_during_an_async_save_stops_every_rank(tmp_path, tmpfs) -> None:
    dump = os.path.join(tmpfs("async", "6m"), "run")
    rc, out = _run(dump, "checkpoint.async_mode=async", "parallelism.dp_shard=2", nproc=2)
    assert rc != 0, out[-3000:]
    for rank in (0, 1):
        assert re.search(rf"\[rank{rank}\] " + MESSAGE.pattern, out), out[-4000:]
    assert out.count(f"exitcode  : {EXIT_DISK_FULL}") == 2, out[-3000:]  # torchrun's summary, both ranks
    assert complete_steps(os.path.join(dump, "checkpoints")) == [2]


def test_a_disk_too_small_for_one_checkpoint_is_refused_at_start(tmpfs) -> None:
    dump = os.path.join(tmpfs("small", "1m"), "run")
    rc, out = _run(dump)
    assert rc == 2, out[-3000:]
    assert "Traceback" not in out
    assert re.search(
        r"has [\d.]+ (KiB|MiB) free but one checkpoint of this run needs about [\d.]+ MiB", out
    ), out
    assert (
        not os.path.exists(os.path.join(dump, "metrics.jsonl"))
        or "step" not in open(os.path.join(dump, "metrics.jsonl"), encoding="utf-8").read()
    )
