"""Prepared data: a corpus tokenized once into flat token shards plus an index.

Layout of a prepared folder::

    index.json                  format, dtype, tokenizer identity (kind, vocab, specials,
                                SHA-256), source settings, source files with sizes and
                                mtimes, and per split its shards with token/document counts
    train-00000.bin             flat uint16/uint32 tokens: [bos] doc [eos] [bos] doc [eos] ...
    train-00000.docs.npy        int64 start offset of every document inside that shard
    validation-00000.bin, ...   the held-out documents, the same way

Concatenating a split's shards in order gives exactly the token stream the in-memory loader
builds from the same corpus (same canonical document order, same hash split), so
preparing is a pure speed/memory change. ``index.json`` is written last, atomically: a folder
without it is an unfinished preparation.

Preparation streams the corpus (never all of it in memory): the input is cut into tasks
(groups of files, byte ranges of JSON Lines files aligned to line starts, Parquet row
groups; hub datasets are one streamed task), each task tokenizes and writes its own shard
in a worker process, and the shards are numbered in task order. The tasks and the workers'
tokenization are ``prepare_tasks.py``'s; this module keeps the folder's format, its reading side
(``read_index``, ``open_split``) and the driver (``prepare``: checks, index, progress, the final
shards).
"""

from __future__ import annotations

import json
import logging
import multiprocessing as mp
import os
import re
import shutil
import sys
import time
from typing import TYPE_CHECKING, Any, Optional

import numpy as np

from models.errors import ConfigError
from trainer.data.documents import _SOURCE_ALIASES
from trainer.data.prepare_tasks import SPLITS, Task, _init_worker, _list_files, plan_tasks, run_task
from trainer.data.tokenizer import Tokenizer, build_tokenizer, token_dtype, tokenizer_fingerprint

if TYPE_CHECKING:
    from trainer.config import DataConfig

logger = logging.getLogger("meshwright")

INDEX_FILE = "index.json"
FORMAT_VERSION = 1
PREPARABLE = ("builtin", "text", "json", "parquet", "hub")
_SHARD_RE = re.compile(r"^(train|validation)-\d{5}\.(bin|docs\.npy)$")
_TMP_PREFIX = ".tmp-"

# --------------------------------------------------------------------------- reading side


def read_index(path: str) -> dict[str, Any]:
    """The parsed ``index.json`` of a prepared folder, or a ConfigError saying how to make one."""
    index_path = os.path.join(path, INDEX_FILE)
    if not os.path.isfile(index_path):
        raise ConfigError(
            f"data.path={path!r} is not prepared data (no {INDEX_FILE}); create it with "
            f"`python -m trainer.prepare_data data=<preset> data.path=<corpus> out={path}` "
            "or train on the raw corpus with data=jsonl|text|parquet|hub"
        )
    try:
        with open(index_path, encoding="utf-8") as f:
            index = json.load(f)
    except (OSError, ValueError) as err:
        raise ConfigError(
            f"data.path={path!r}: cannot read {INDEX_FILE} ({err}); prepare the data again"
        ) from err
    if index.get("format_version") != FORMAT_VERSION:
        raise ConfigError(
            f"data.path={path!r} has format_version={index.get('format_version')}, this trainer reads "
            f"{FORMAT_VERSION}; prepare the data again with this version"
        )
    return index


def check_tokenizer(index: dict[str, Any], tokenizer: Tokenizer, path: str) -> None:
    """Refuse to train with another tokenizer than the one the shards were prepared with."""
    saved, current = index["tokenizer"], tokenizer_fingerprint(tokenizer)
    keys = ("kind", "vocab_size", "bos_id", "eos_id", "sha256")
    if any(saved[k] != current[k] for k in keys):
        raise ConfigError(
            f"data.path={path!r} was prepared with tokenizer {saved['spec']!r} (vocab {saved['vocab_size']}, "
            f"sha256 {str(saved['sha256'])[:12]}), but data.tokenizer={current['spec']!r} is another one "
            f"(vocab {current['vocab_size']}, sha256 {str(current['sha256'])[:12]}); set "
            f"data.tokenizer={saved['spec']} or prepare the corpus again with this tokenizer"
        )


def open_split(path: str, split: str, tokenizer: Tokenizer) -> Any:
    """The token store (a ``ShardStore``) of ``split`` in the prepared folder ``path``."""
    from trainer.data.windows import ShardStore  # local: preparation workers never import torch

    index = read_index(path)
    check_tokenizer(index, tokenizer, path)
    info = index["splits"][split]
    dtype = np.dtype(index["dtype"])
    token_files, doc_files = [], []
    for shard in info["shards"]:
        tokens, docs = os.path.join(path, shard["tokens"]), os.path.join(path, shard["docs"])
        expected = shard["num_tokens"] * dtype.itemsize
        size = os.path.getsize(tokens) if os.path.isfile(tokens) else None
        if size != expected or not os.path.isfile(docs):
            raise ConfigError(
                f"data.path={path!r}: shard {shard['tokens']} has {size} bytes, the index says {expected} "
                "(missing or truncated files); prepare the data again into a fresh folder"
            )
        token_files.append(tokens)
        doc_files.append(docs)
    return ShardStore(
        token_files,
        doc_files,
        [s["num_tokens"] for s in info["shards"]],
        [s["num_docs"] for s in info["shards"]],
        dtype,
    )


# ------------------------------------------------------------------------------- index


def _source_settings(cfg: DataConfig, source: str) -> dict[str, Any]:
    path = cfg.path if source in ("builtin", "hub") or cfg.path is None else os.path.abspath(cfg.path)
    return {
        "source": source,
        "path": path,
        "name": cfg.name if source == "hub" else None,
        "split": cfg.split if source == "hub" else None,
        "text_field": cfg.text_field if source in ("json", "parquet", "hub") else None,
        "val_fraction": float(cfg.val_fraction),
        "max_documents": cfg.max_documents,
    }


def _file_records(files: list[str]) -> list[dict[str, Any]]:
    out = []
    for f in files:
        st = os.stat(f)
        out.append({"path": os.path.abspath(f), "bytes": st.st_size, "mtime_ns": st.st_mtime_ns})
    return out


# ------------------------------------------------------------------------------ progress


class _Progress:
    """Documents, tokens, MB/s and ETA on stderr every few seconds."""

    def __init__(self, total_bytes: int, every_s: float = 2.0) -> None:
        self.total, self.every = total_bytes, every_s
        self.bytes = self.docs = self.tokens = 0
        self.start = self._last = time.perf_counter()

    def add(self, num_bytes: int, docs: int, tokens: int) -> None:
        self.bytes += num_bytes
        self.docs += docs
        self.tokens += tokens

    def add_and_print(self, num_bytes: int, docs: int, tokens: int) -> None:
        self.add(num_bytes, docs, tokens)
        self.maybe_print()

    def line(self) -> str:
        elapsed = max(time.perf_counter() - self.start, 1e-9)
        rate = self.bytes / 1e6 / elapsed
        eta = f"{max(self.total - self.bytes, 0) / 1e6 / rate:.0f}s" if self.total and rate > 0 else "?"
        return (
            f"prepare: {self.docs:,} docs, {self.tokens:,} tokens, {self.bytes / 1e6:,.0f}/"
            f"{self.total / 1e6:,.0f} MB, {rate:.1f} MB/s, ETA {eta}"
        )

    def maybe_print(self, force: bool = False) -> None:
        now = time.perf_counter()
        if force or now - self._last >= self.every:
            self._last = now
            print(self.line(), file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------ driver


def _fingerprint(index: dict[str, Any]) -> dict[str, Any]:
    tok = {k: index["tokenizer"][k] for k in ("kind", "vocab_size", "bos_id", "eos_id", "sha256")}
    return {
        "format_version": index["format_version"],
        "tokenizer": tok,
        "source": index["source"],
        "files": index["files"],
    }


def _differences(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    out = []
    if old["tokenizer"] != new["tokenizer"]:
        out.append(f"tokenizer was {old['tokenizer']}, now {new['tokenizer']}")
    for key in sorted(set(old["source"]) | set(new["source"])):
        if old["source"].get(key) != new["source"].get(key):
            out.append(f"data.{key} was {old['source'].get(key)!r}, now {new['source'].get(key)!r}")
    before = {f["path"]: f for f in old["files"]}
    after = {f["path"]: f for f in new["files"]}
    for path in sorted(before.keys() | after.keys()):
        a, b = before.get(path), after.get(path)
        if a is None or b is None:
            out.append(f"source file {path} was {'added' if a is None else 'removed'}")
        elif a != b:
            out.append(f"source file {path} changed ({a['bytes']} -> {b['bytes']} bytes, mtime changed)")
    if old["format_version"] != new["format_version"]:
        out.append(f"format_version was {old['format_version']}, now {new['format_version']}")
    return out


def _clean(out: str) -> None:
    """Remove what an interrupted preparation left (temporary folders, shards without index)."""
    for name in os.listdir(out):
        full = os.path.join(out, name)
        if name.startswith(_TMP_PREFIX):
            shutil.rmtree(full, ignore_errors=True)
        elif _SHARD_RE.match(name):
            os.remove(full)


def _run_all(
    tasks: list[Task],
    settings: dict[str, Any],
    spec: str,
    tmp: str,
    num_proc: int,
    progress: _Progress,
    pool: Optional[Any],
    queue: Optional[Any],
) -> list[dict[str, Any]]:
    if pool is None:
        results = []
        for task in tasks:
            results.append(run_task(task, settings, spec, tmp, report=progress.add_and_print))
        return results
    pending = pool.starmap_async(run_task, [(t, settings, spec, tmp) for t in tasks], chunksize=1)
    while True:
        pending.wait(0.2)
        while not queue.empty():
            progress.add(*queue.get())
        progress.maybe_print()
        if pending.ready():
            results = pending.get()  # re-raises a worker's error (ConfigError included)
            while not queue.empty():
                progress.add(*queue.get())
            return results


def _move_last_train_doc(out: str, shards: dict[str, list[dict[str, Any]]], dtype: np.dtype) -> None:
    """A corpus too small for the hash to hold any document out gives its last training
    document to validation (as the in-memory loader does), so evaluation has data."""
    last = shards["train"][-1]
    starts = np.load(last["docs"])
    a = int(starts[-1])
    tokens = np.fromfile(last["tokens"], dtype=dtype)
    val_tokens = os.path.join(os.path.dirname(last["tokens"]), "validation-moved.bin")
    val_docs = os.path.join(os.path.dirname(last["tokens"]), "validation-moved.docs.npy")
    tokens[a:].tofile(val_tokens)
    np.save(val_docs, np.zeros(1, dtype=np.int64))
    shards["validation"] = [
        {"tokens": val_tokens, "docs": val_docs, "num_tokens": len(tokens) - a, "num_docs": 1}
    ]
    os.truncate(last["tokens"], a * dtype.itemsize)
    np.save(last["docs"], starts[:-1])
    last["num_tokens"], last["num_docs"] = a, last["num_docs"] - 1
    if not last["num_docs"]:
        shards["train"].pop()


def _finalize(
    out: str, tmp: str, results: list[dict[str, Any]], settings: dict[str, Any], dtype: np.dtype
) -> dict[str, Any]:
    shards = {s: [r[s] for r in results if r[s]["num_docs"]] for s in SPLITS}
    total_docs = sum(s["num_docs"] for s in shards["train"]) + sum(
        s["num_docs"] for s in shards["validation"]
    )
    if not total_docs:
        raise ConfigError(f"data.path={settings['path']!r} has no documents; point it at data")
    if (
        settings["val_fraction"] > 0
        and not shards["validation"]
        and sum(s["num_docs"] for s in shards["train"]) > 1
    ):
        _move_last_train_doc(out, shards, dtype)
    if not shards["train"]:
        raise ConfigError(
            f"data.val_fraction={settings['val_fraction']} leaves no training documents out of {total_docs} "
            f"(data.path={settings['path']!r}); add documents or lower data.val_fraction"
        )
    splits: dict[str, Any] = {}
    for split in SPLITS:
        entries = []
        for i, shard in enumerate(shards[split]):
            names = {"tokens": f"{split}-{i:05d}.bin", "docs": f"{split}-{i:05d}.docs.npy"}
            for key, name in names.items():
                os.replace(shard[key], os.path.join(out, name))
            entries.append({**names, "num_tokens": shard["num_tokens"], "num_docs": shard["num_docs"]})
        splits[split] = {
            "num_tokens": sum(e["num_tokens"] for e in entries),
            "num_docs": sum(e["num_docs"] for e in entries),
            "shards": entries,
        }
    return splits


def check_out_folder(out: str) -> None:
    """``ConfigError`` unless ``out`` is a folder, or a path under a writable folder where it can be
    created."""
    if os.path.exists(out) and not os.path.isdir(out):
        raise ConfigError(
            f"out={out!r} is an existing file, not a folder; pass a folder (it is created if missing) or "
            "move the "
            "file away."
        )
    parent = os.path.dirname(os.path.abspath(out))
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent) or not os.access(parent, os.W_OK):
        raise ConfigError(
            f"out={out!r} cannot be created: {parent!r} is not a writable folder; pass another out=."
        )


def _check_prepare_inputs(cfg: DataConfig, num_proc: int, vocab_size: Optional[int]) -> tuple[str, Tokenizer]:
    """(canonical source, tokenizer) once the inputs are usable; ``ConfigError`` before any work."""
    if cfg.sources:
        raise ConfigError(
            "data.sources: prepare each corpus into its own folder, then mix them at training "
            "time with data=tokens data.sources=[{path: DIR, weight: W}, ...]"
        )
    source = _SOURCE_ALIASES.get(cfg.source, cfg.source)
    if source not in PREPARABLE:
        raise ConfigError(f"data.source={cfg.source!r} cannot be prepared; use one of {list(PREPARABLE)}")
    if (source == "builtin") != (cfg.path is None):
        raise ConfigError(
            f"data.path={cfg.path!r} with data.source={source}: builtin takes no path, "
            "every other source needs one"
        )
    if not 0.0 <= cfg.val_fraction < 1.0:
        raise ConfigError(f"data.val_fraction={cfg.val_fraction} must be in [0, 1)")
    if num_proc < 1:
        raise ConfigError(f"num_proc={num_proc} must be >= 1")
    tokenizer = build_tokenizer(cfg.tokenizer)
    if vocab_size is not None and vocab_size < tokenizer.vocab_size:
        raise ConfigError(
            f"model vocab_size={vocab_size} is smaller than the tokenizer's "
            f"vocab_size={tokenizer.vocab_size}; "
            f"set model.vocab_size>={tokenizer.vocab_size} or use a smaller tokenizer"
        )
    return source, tokenizer


def prepare(
    cfg: DataConfig, out: str, *, num_proc: int = 1, chunk_mb: float = 256.0, vocab_size: Optional[int] = None
) -> dict[str, Any]:
    """Tokenize the corpus described by the data config ``cfg`` into ``out``; returns the index.

    A folder already prepared from the same inputs is left as it is (no-op); one prepared
    from other inputs (tokenizer, settings or source files) is refused with the differences.
    ``vocab_size`` (the model's) refuses a larger tokenizer before any work.
    """
    source, tokenizer = _check_prepare_inputs(cfg, num_proc, vocab_size)
    files, keys = _list_files(cfg, source)
    index: dict[str, Any] = {
        "format_version": FORMAT_VERSION,
        "dtype": token_dtype(tokenizer.vocab_size).name,
        "tokenizer": tokenizer_fingerprint(tokenizer),
        "source": _source_settings(cfg, source),
        "files": _file_records(files),
    }
    os.makedirs(out, exist_ok=True)
    index_path = os.path.join(out, INDEX_FILE)
    if os.path.isfile(index_path):
        old = read_index(out)
        diff = _differences(_fingerprint(old), _fingerprint(index))
        if not diff:
            logger.info(f"{out} is already prepared from these inputs; nothing to do")
            return old
        raise ConfigError(
            f"out={out!r} was prepared from other inputs: {'; '.join(diff)}. Prepared shards are never "
            "mixed; pass a new out= folder, or delete this one to prepare it again"
        )
    _clean(out)
    tmp = os.path.join(out, f"{_TMP_PREFIX}{os.getpid()}")
    os.makedirs(tmp)
    start = time.perf_counter()
    settings = {**index["source"], "path": cfg.path}
    queue = pool = None
    try:
        if num_proc > 1:
            ctx = mp.get_context("spawn")  # fork after Rust tokenizer threads can deadlock
            queue = ctx.Queue()
            pool = ctx.Pool(num_proc, initializer=_init_worker, initargs=(queue,))
        tasks = plan_tasks(cfg, source, files, keys, int(chunk_mb * 2**20), pool)
        progress = _Progress(sum(t.num_bytes for t in tasks))
        results = _run_all(tasks, settings, cfg.tokenizer, tmp, num_proc, progress, pool, queue)
        progress.maybe_print(force=True)
        dtype = token_dtype(tokenizer.vocab_size)
        index["splits"] = _finalize(out, tmp, results, settings, dtype)
    finally:
        if pool is not None:
            pool.terminate()
            pool.join()
        shutil.rmtree(tmp, ignore_errors=True)
    seconds = time.perf_counter() - start
    index["stats"] = {
        "input_bytes": progress.bytes,
        "seconds": round(seconds, 3),
        "num_proc": num_proc,
        "mb_per_s": round(progress.bytes / 1e6 / max(seconds, 1e-9), 2),
    }
    with open(index_path + ".tmp", "w", encoding="utf-8") as f:
        json.dump(index, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(index_path + ".tmp", index_path)
    s = index["splits"]
    logger.info(
        f"prepared {out}: train {s['train']['num_docs']:,} docs / {s['train']['num_tokens']:,} tokens, "
        f"validation {s['validation']['num_docs']:,} docs / {s['validation']['num_tokens']:,} tokens "
        f"({index['dtype']}), {progress.bytes / 1e6:,.1f} MB in {seconds:.1f}s = "
        f"{index['stats']['mb_per_s']} MB/s"
    )
    return index
