"""Data at scale: preparation throughput, per-rank memory and start-up vs corpus size, loader speed.

1. Writes a synthetic JSON Lines corpus of ``--gb`` GB (streamed to disk) and a 20 MB one.
2. Prepares both with ``trainer.prepare_data`` (byte tokenizer, ``--num-proc`` workers):
   ``prep_mb_per_s``.
3. Trains the debug model for ``--steps`` steps from each prepared folder, each in a fresh
   process (one rank, the real Trainer): peak resident memory (``rss_mb``) and start-up to
   the end of the first step (``startup_s``, interpreter start included); the large corpus
   must stay within 150 MB and 5 s of the small one. Also the step rate and ``data_wait_s``.
4. Loader throughput from the large prepared folder (debug batch 16 x 256, no prefetch)
   against the debug model's step rate: must be >= 20x.

Everything is deleted afterwards. Prints JSON.

    python benchmarks/bench_data.py [--gb 2] [--num-proc 2] [--steps 8] [--dir /tmp]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

SMALL_MB = 20


def write_corpus(path: str, num_bytes: int, seed: int = 0) -> int:
    """JSON Lines of random lowercase words, ~0.5-6 KB per document, streamed to ``path``."""
    import numpy as np

    rng = np.random.default_rng(seed)
    letters = np.frombuffer(b"abcdefghijklmnopqrstuvwxyz     \n", dtype=np.uint8)
    block = letters[rng.integers(0, len(letters), 1 << 24)].tobytes().replace(b"\n", b"\\n")
    written = 0
    with open(path, "wb", buffering=1 << 23) as f:
        while written < num_bytes:
            n = int(rng.integers(500, 6000))
            a = int(rng.integers(0, len(block) - n - 2))
            text = block[a : a + n].rstrip(b"\\")
            line = b'{"text": "' + text + b'"}\n'
            f.write(line)
            written += len(line)
    return written


def prepare(corpus: str, out: str, num_proc: int) -> dict[str, Any]:
    from trainer.config import DataConfig
    from trainer.data.prepared import prepare as run

    start = time.perf_counter()
    index = run(
        DataConfig(source="json", path=corpus, val_fraction=0.001), out, num_proc=num_proc, chunk_mb=64
    )
    seconds = time.perf_counter() - start
    return {
        "mb": os.path.getsize(corpus) / 1e6,
        "seconds": seconds,
        "mb_per_s": os.path.getsize(corpus) / 1e6 / seconds,
        "tokens": index["splits"]["train"]["num_tokens"],
        "shards": len(index["splits"]["train"]["shards"]),
    }


def child(prep: str, dump: str, steps: int, t0: float) -> None:
    """In a fresh process: train ``steps`` steps; print start-up, RSS, step time, data wait."""
    import logging

    from trainer.config import compose_config as make_config
    from trainer.train import Trainer

    logging.disable(logging.INFO)
    cfg = make_config(
        "+experiment=debug",
        "data=tokens",
        f"data.path={prep}",
        f"job.dump_folder={dump}",
        f"training.steps={steps}",
        "training.eval_freq=0",
        "checkpoint.enable=false",
        "metrics.log_freq=1",
        "metrics.tensorboard=false",
    )
    trainer = Trainer(cfg)
    trainer.train(until_step=1)
    startup = time.time() - t0
    history = trainer.train()
    trainer.close()
    times = [r["step_time_s"] for r in history if "loss" in r and r["step"] > 2]
    waits = [r["data_wait_s"] for r in history if "loss" in r and r["step"] > 1]
    rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(
        json.dumps(
            {
                "startup_s": startup,
                "rss_mb": rss_mb,
                "step_s": sum(times) / len(times),
                "data_wait_s": sum(waits) / len(waits),
            }
        )
    )


def train(prep: str, dump: str, steps: int) -> dict[str, Any]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": REPO}
    cmd = [sys.executable, __file__, "--child", prep, dump, str(steps), repr(time.time())]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if out.returncode:
        raise RuntimeError(out.stderr[-3000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def loader_rate(prep: str, seconds: float = 3.0) -> float:
    """Batches per second of the debug run's loader (16 x 256, one rank, no prefetch)."""
    from trainer.config import DataConfig
    from trainer.data import build_dataloader
    from trainer.data.tokenizer import ByteTokenizer

    dl = build_dataloader(
        DataConfig(source="tokens", path=prep, prefetch=0),
        ByteTokenizer(),
        split="train",
        seq_len=256,
        global_batch_size=16,
        dp_rank=0,
        dp_size=1,
        seed=0,
    )
    dl.next_batch()
    n, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        dl.next_batch()
        n += 1
    return n / (time.perf_counter() - start)


def run(gb: float, num_proc: int, steps: int, root: str) -> dict[str, Any]:
    """The whole benchmark in a temporary folder under ``root`` (removed at the end)."""
    work = tempfile.mkdtemp(prefix="bench_data_", dir=root)
    try:
        result: dict[str, Any] = {"gb": gb, "num_proc": num_proc}
        for name, size in (("small", SMALL_MB * 10**6), ("large", int(gb * 10**9))):
            corpus = os.path.join(work, f"{name}.jsonl")
            start = time.perf_counter()
            write_corpus(corpus, size)
            result[f"{name}_write_s"] = time.perf_counter() - start
            prep = os.path.join(work, f"{name}_tok")
            result[f"{name}_prep"] = prepare(corpus, prep, num_proc)
            os.remove(corpus)  # only the shards are needed from here on
            result[f"{name}_train"] = train(prep, os.path.join(work, f"{name}_run"), steps)
        result["loader_batches_per_s"] = loader_rate(os.path.join(work, "large_tok"))
        small, large = result["small_train"], result["large_train"]
        result["rss_delta_mb"] = large["rss_mb"] - small["rss_mb"]
        result["startup_delta_s"] = large["startup_s"] - small["startup_s"]
        result["step_rate_per_s"] = 1.0 / small["step_s"]
        result["loader_over_step_rate"] = result["loader_batches_per_s"] * small["step_s"]
        return result
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main() -> None:
    if sys.argv[1:2] == ["--child"]:
        prep, dump, steps, t0 = sys.argv[2:6]
        child(prep, dump, int(steps), float(t0))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gb", type=float, default=2.0)
    parser.add_argument("--num-proc", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--dir", default=tempfile.gettempdir())
    args = parser.parse_args()
    print(json.dumps(run(args.gb, args.num_proc, args.steps, args.dir), indent=1))


if __name__ == "__main__":
    main()
