"""Scale, suite-sized: prepare a 100 MB synthetic corpus and a 10 MB one; a fresh process opening
each prepared folder and reading 50 batches must not use more memory or start-up time for the
large one (peak RSS within 150 MB, opening + first batch within 5 s). The 2 GB version with the real
Trainer is
``benchmarks/bench_data.py``; 100 MB (not 200) keeps this test under a minute on 2 busy cores
(writing and preparing the corpus dominate; 200 MB doubles that).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.configs import REPO

sys.path.insert(0, os.path.join(REPO, "benchmarks"))
from bench_data import prepare, write_corpus  # noqa: E402

pytestmark = pytest.mark.slow

CHILD = """
import json, resource, sys, time
from trainer.config import DataConfig
from trainer.data import build_dataloader
from trainer.data.tokenizer import ByteTokenizer
t0 = time.perf_counter()  # after the imports, whose time on a busy machine is noise here
dl = build_dataloader(DataConfig(source="tokens", path=sys.argv[1]), ByteTokenizer(), split="train",
                      seq_len=256, global_batch_size=16, dp_rank=0, dp_size=1, seed=0)
dl.next_batch()
startup = time.perf_counter() - t0
for _ in range(50):
    dl.next_batch()
print(json.dumps({"startup_s": startup, "rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""


def _open(preps: list[Path]) -> list[dict]:
    """One fresh process per folder, run side by side."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": REPO}
    procs = [
        subprocess.Popen([sys.executable, "-c", CHILD, str(p)], env=env, stdout=subprocess.PIPE, text=True)
        for p in preps
    ]
    outs = [p.communicate()[0] for p in procs]
    assert all(p.returncode == 0 for p in procs)
    return [json.loads(out.strip().splitlines()[-1]) for out in outs]


def test_memory_and_startup_do_not_grow_with_the_corpus(tmp_path: Path) -> None:
    stats = {}
    for name, mb in (("small", 10), ("large", 100)):
        corpus = tmp_path / f"{name}.jsonl"
        write_corpus(str(corpus), mb * 10**6)
        stats[name] = prepare(str(corpus), str(tmp_path / f"{name}_tok"), num_proc=1)
        corpus.unlink()
    for name, opened in zip(stats, _open([tmp_path / f"{name}_tok" for name in stats])):
        stats[name].update(opened)
    print(json.dumps(stats, indent=1))
    assert stats["large"]["tokens"] > 9 * stats["small"]["tokens"]
    assert stats["large"]["rss_mb"] - stats["small"]["rss_mb"] < 150
    assert stats["large"]["startup_s"] - stats["small"]["startup_s"] < 5
