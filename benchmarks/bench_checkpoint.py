"""Checkpoint cost for the 38m preset on the CPU: sync save, async stall, load.

One process, the real Trainer and Checkpointer (model + AdamW state + scheduler + data +
RNG, i.e. ~3x the fp32 weights on disk). One training step populates the optimizer state;
then, per round:

* ``sync_save_s``: ``save()`` in ``async_mode=disabled`` (write + fsync + commit);
* ``async_stall_s``: how long ``save()`` blocks the loop in ``async_mode=async`` (staging:
  the copy to host memory), and ``async_total_s`` until the background write is committed;
* ``load_s``: resuming from the newest checkpoint (integrity checks + DCP load), warm: the
  files were just written or read, so they come from the page cache;
* ``load_cold_s``: the same after evicting the checkpoint's files from the page cache. Tried
  in order: ``posix_fadvise(POSIX_FADV_DONTNEED)`` on each (fsynced, hence clean) file, then
  the global ``/proc/sys/vm/drop_caches`` (root with a writable /proc/sys only). The JSON says
  which worked (``cold_cache_method``) and the fraction of the files' pages still resident
  right before the cold load (``cold_resident_fraction``, via ``mincore``; 0.0 = truly cold);
* ``read_cold_s`` / ``read_warm_s``: the I/O alone, reading the checkpoint's files from disk
  after the eviction and again from the page cache (``load`` also checksums and unpickles,
  which is CPU time and dominates on a busy machine).

    python benchmarks/bench_checkpoint.py [--model 38m] [--rounds 3] [--dump outputs/bench_checkpoint]

Prints JSON with the medians.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import logging
import mmap
import os
import shutil
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from trainer.config import compose_config as make_config  # noqa: E402
from trainer.train import Trainer  # noqa: E402


def _trainer(model: str, dump: str, async_mode: str) -> Trainer:
    cfg = make_config(
        f"model={model}",
        f"job.dump_folder={dump}",
        "training.steps=1000",
        "training.seq_len=64",
        "training.global_batch_size=1",
        "training.micro_batch_size=1",
        "data.max_documents=50",
        "metrics.tensorboard=false",
        "metrics.log_freq=1000",
        "checkpoint.enable=true",
        "checkpoint.interval=1000000",
        "checkpoint.save_final=false",
        f"checkpoint.async_mode={async_mode}",
    )
    return Trainer(cfg)


def _files(folder: str) -> list[str]:
    return [e.path for e in os.scandir(folder) if e.is_file()]


def _read_all(paths: list[str]) -> float:
    """Seconds to read ``paths`` start to end in 16 MiB chunks."""
    t0 = time.perf_counter()
    for path in paths:
        with open(path, "rb", buffering=0) as f:
            while f.read(16 << 20):
                pass
    return time.perf_counter() - t0


def resident_fraction(paths: list[str]) -> float:
    """Fraction of the files' pages in the page cache (``mincore`` on a read-only mapping)."""
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_long,
    ]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    page = os.sysconf("SC_PAGE_SIZE")
    resident = total = 0
    for path in paths:
        size = os.path.getsize(path)
        if size == 0:
            continue
        pages = (size + page - 1) // page
        fd = os.open(path, os.O_RDONLY)
        try:
            addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
            if addr in (None, ctypes.c_void_p(-1).value):
                raise OSError(ctypes.get_errno(), f"mmap {path}")
            vec = ctypes.create_string_buffer(pages)
            try:
                if libc.mincore(addr, size, vec) != 0:
                    raise OSError(ctypes.get_errno(), f"mincore {path}")
            finally:
                libc.munmap(addr, size)
        finally:
            os.close(fd)
        resident += sum(b & 1 for b in vec.raw)
        total += pages
    return resident / total if total else 0.0


def drop_page_cache(paths: list[str]) -> str:
    """Evict ``paths`` from the page cache; return the method that worked.

    First ``posix_fadvise(DONTNEED)`` per file (only these files, any user); if pages remain,
    the global ``/proc/sys/vm/drop_caches`` (root with a writable /proc/sys only)."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)  # only clean pages can be dropped (they are: DCP and the commit fsync)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    if resident_fraction(paths) < 0.01:
        return "posix_fadvise_dontneed"
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1")
        return "drop_caches"
    except OSError:
        return "none (pages stay cached: the cold figure is not cold)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="38m")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dump", default="outputs/bench_checkpoint")
    args = parser.parse_args()
    logging.disable(logging.INFO)
    shutil.rmtree(args.dump, ignore_errors=True)
    results: dict[str, list[float]] = {
        "sync_save_s": [],
        "async_stall_s": [],
        "async_total_s": [],
        "load_s": [],
        "load_cold_s": [],
        "cold_resident_fraction": [],
        "read_warm_s": [],
        "read_cold_s": [],
    }
    method = ""

    trainer = _trainer(args.model, args.dump, "disabled")
    t0 = time.perf_counter()
    trainer.train(until_step=1)  # populates the AdamW state
    step_s = time.perf_counter() - t0
    ckpt = trainer.checkpointer
    for r in range(args.rounds):
        t0 = time.perf_counter()
        ckpt.save(100 + r)
        results["sync_save_s"].append(time.perf_counter() - t0)
    size = sum(e.stat().st_size for e in os.scandir(os.path.join(ckpt.folder, "step-100")))
    newest = os.path.join(ckpt.folder, f"step-{100 + args.rounds - 1}")  # what load() resumes from
    for _ in range(args.rounds):
        trainer.state.step = 0  # load() below must really restore it
        t0 = time.perf_counter()
        ckpt.load()
        results["load_s"].append(time.perf_counter() - t0)
        method = drop_page_cache(_files(newest))
        results["cold_resident_fraction"].append(resident_fraction(_files(newest)))
        trainer.state.step = 0
        t0 = time.perf_counter()
        ckpt.load()
        results["load_cold_s"].append(time.perf_counter() - t0)
        # The I/O alone (no checksums, no unpickling): read every file, cold then warm.
        drop_page_cache(_files(newest))
        results["read_cold_s"].append(_read_all(_files(newest)))
        results["read_warm_s"].append(_read_all(_files(newest)))
    trainer.close()

    trainer = _trainer(args.model, args.dump, "async")  # resumes from step-102
    ckpt = trainer.checkpointer
    for r in range(args.rounds):
        t0 = time.perf_counter()
        ckpt.save(200 + r)
        results["async_stall_s"].append(time.perf_counter() - t0)
        ckpt.wait()
        results["async_total_s"].append(time.perf_counter() - t0)
    trainer.close()

    out = {
        "model": args.model,
        "params_m": round(sum(p.numel() for p in trainer.model.parameters()) / 1e6, 2),
        "checkpoint_mb": round(size / 2**20, 1),
        "train_step_s": round(step_s, 3),
        "rounds": args.rounds,
        **{k: round(statistics.median(v), 3) for k, v in results.items()},
    }
    out["async_stall_vs_sync"] = round(out["async_stall_s"] / out["sync_save_s"], 3)
    out["cold_cache_method"] = method
    out["cold_vs_warm_load"] = round(out["load_cold_s"] / out["load_s"], 2)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
