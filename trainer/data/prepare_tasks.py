"""The work of a preparation (``prepared.py``'s ``prepare`` drives it): the corpus listed in canonical
order and cut into tasks (groups of files, byte ranges of JSON Lines files aligned to line starts,
Parquet row groups; a hub dataset is one streamed task), and one task tokenized into one temporary
shard per split (``run_task``, in the calling process or a spawned pool worker that reports its
progress on a queue). Split from ``prepared.py`` (the folder's format, its reading side and the
driver)."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

import numpy as np

from models.errors import ConfigError
from trainer.data.documents import _builtin_files, _expand_path, builtin_root, is_validation
from trainer.data.tokenizer import build_tokenizer, encode_documents, token_dtype

if TYPE_CHECKING:
    from trainer.config import DataConfig

SPLITS = ("train", "validation")
_BATCH_DOCS = 1024  # documents per encode call: parallel in Rust for HF, bounded memory

# ------------------------------------------------------------------------------- planning


@dataclass
class Task:
    """One unit of preparation work; ``index`` orders the shards."""

    index: int
    kind: str  # files (one document per file) | jsonl | parquet | hub
    files: list[str]  # files: the group; jsonl/parquet: [file]
    keys: list[str]  # files: the split key of each file
    start: int = 0  # jsonl: byte range [start, end); parquet: row group
    end: int = 0
    row0: int = 0  # jsonl/parquet: global row index of the first row (the split key)
    num_bytes: int = 0


def _list_files(cfg: DataConfig, source: str) -> tuple[list[str], list[str]]:
    """(absolute files, their split keys or display names) in canonical order."""
    if source == "builtin":
        root = builtin_root()
        rel = _builtin_files(root)[: cfg.max_documents]
        return [os.path.join(root, r) for r in rel], rel
    if source == "hub":
        return [], []
    files = _expand_path(cfg.path, source)
    if source == "text":
        files = files[: cfg.max_documents]
    return files, [str(i) for i in range(len(files))]


def _jsonl_ranges(file: str, chunk_bytes: int) -> list[tuple[int, int]]:
    """Byte ranges of ``file`` of about ``chunk_bytes`` each, every one starting at a line start."""
    size = os.path.getsize(file)
    bounds = [0]
    with open(file, "rb") as f:
        while bounds[-1] + chunk_bytes < size:
            f.seek(bounds[-1] + chunk_bytes - 1)
            f.readline()  # to the end of the line holding that byte
            if f.tell() >= size:
                break
            bounds.append(f.tell())
    bounds.append(size)
    return list(zip(bounds[:-1], bounds[1:]))


def _iter_lines(file: str, start: int, end: int) -> Iterator[bytes]:
    """Non-blank lines of ``file`` starting in ``[start, end)``."""
    with open(file, "rb") as f:
        f.seek(start)
        pos = start
        while pos < end:
            line = f.readline()
            if not line:
                break
            pos += len(line)
            if line.strip():
                yield line


def _count_rows(args: tuple[str, int, int]) -> int:
    return sum(1 for _ in _iter_lines(*args))


def plan_tasks(
    cfg: DataConfig, source: str, files: list[str], keys: list[str], chunk_bytes: int, pool: Optional[Any]
) -> list[Task]:
    """Cut the corpus into tasks of about ``chunk_bytes`` of input each."""
    tasks: list[Task] = []
    if source == "hub":
        return [Task(0, "hub", [], [])]
    if source in ("builtin", "text"):
        group: list[int] = []
        size = 0
        for i, f in enumerate(files + [None]):  # type: ignore[list-item]
            if f is not None:
                group.append(i)
                size += os.path.getsize(f)
            if group and (f is None or size >= chunk_bytes):
                tasks.append(
                    Task(
                        len(tasks),
                        "files",
                        [files[j] for j in group],
                        [keys[j] for j in group],
                        num_bytes=size,
                    )
                )
                group, size = [], 0
        return tasks
    if source == "json":
        ranges = [(f, a, b) for f in files for a, b in _jsonl_ranges(f, chunk_bytes)]
        counts = pool.map(_count_rows, ranges) if pool is not None else [_count_rows(r) for r in ranges]
        row0 = 0
        for (f, a, b), n in zip(ranges, counts):
            tasks.append(Task(len(tasks), "jsonl", [f], [], start=a, end=b, row0=row0, num_bytes=b - a))
            row0 += n
        return tasks
    import pyarrow.parquet as pq

    row0 = 0
    for f in files:
        try:
            meta = pq.ParquetFile(f).metadata
        except Exception as err:
            raise ConfigError(
                f"data.path={cfg.path!r}: cannot read {f!r} as parquet ({err}); fix or remove it"
            ) from err
        for rg in range(meta.num_row_groups):
            group_meta = meta.row_group(rg)
            tasks.append(
                Task(
                    len(tasks), "parquet", [f], [], start=rg, row0=row0, num_bytes=group_meta.total_byte_size
                )
            )
            row0 += group_meta.num_rows
    return tasks


# ------------------------------------------------------------------------------- workers

_progress_queue: Optional[Any] = None  # a pool worker's progress queue, set once by _init_worker


def _init_worker(progress_queue: Any) -> None:
    global _progress_queue
    _progress_queue = progress_queue


def _task_documents(task: Task, settings: dict[str, Any]) -> Iterator[tuple[str, Optional[str], int]]:
    """(split key, text or None, input bytes) of every document of ``task`` in order."""
    cap, field = settings["max_documents"], settings["text_field"]
    where = f"data.path={settings['path']!r}"
    if task.kind == "files":
        for f, key in zip(task.files, task.keys):
            with open(f, encoding="utf-8", errors="replace") as fh:
                yield key, fh.read(), os.path.getsize(f)
        return
    if task.kind == "jsonl":
        for row, line in enumerate(_iter_lines(task.files[0], task.start, task.end), start=task.row0):
            if cap is not None and row >= cap:
                return
            try:
                obj = json.loads(line)
            except ValueError as err:
                raise ConfigError(
                    f"{where}: {task.files[0]!r} row {row} is not valid JSON Lines ({err}); fix or remove "
                    "that file"
                ) from err
            if not isinstance(obj, dict) or field not in obj:
                raise ConfigError(
                    f"data.text_field={field!r} is not a key of row {row} of {task.files[0]!r}; "
                    "set data.text_field to the key that holds the text"
                )
            yield str(row), obj[field], len(line)
        return
    if task.kind == "parquet":
        import pyarrow.parquet as pq

        pf = pq.ParquetFile(task.files[0])
        if field not in pf.schema_arrow.names:
            raise ConfigError(
                f"data.text_field={field!r} is not a column of {task.files[0]!r} (columns: "
                f"{pf.schema_arrow.names}); set data.text_field to the text column"
            )
        row = task.row0
        for record_batch in pf.iter_batches(row_groups=[task.start], columns=[field], batch_size=_BATCH_DOCS):
            for text in record_batch.column(0).to_pylist():
                if cap is not None and row >= cap:
                    return
                yield str(row), text, len(text.encode("utf-8")) if isinstance(text, str) else 0
                row += 1
        return
    import itertools

    import datasets

    stream = datasets.load_dataset(
        settings["path"], settings["name"], split=settings["split"], streaming=True
    )
    for row, example in enumerate(itertools.islice(stream, cap)):
        if field not in example:
            raise ConfigError(
                f"data.text_field={field!r} is not a column of hub dataset {settings['path']!r} "
                f"(columns: {sorted(example)}); set data.text_field to the text column"
            )
        text = example[field]
        yield str(row), text, len(text.encode("utf-8")) if isinstance(text, str) else 0


class _ShardWriter:
    """Appends documents of one split to ``<split>-t<task>.bin`` and records their starts."""

    def __init__(self, folder: str, split: str, task: int, dtype: np.dtype) -> None:
        self.tokens_path = os.path.join(folder, f"{split}-t{task:06d}.bin")
        self.docs_path = os.path.join(folder, f"{split}-t{task:06d}.docs.npy")
        self._file = open(self.tokens_path, "wb")
        self._starts: list[np.ndarray] = []
        self.num_tokens = 0
        self.num_docs = 0

    def write(self, flat: np.ndarray, lengths: np.ndarray) -> None:
        if not len(lengths):
            return
        self._starts.append(self.num_tokens + np.concatenate([[0], np.cumsum(lengths[:-1])]))
        self._file.write(flat.tobytes())
        self.num_tokens += int(flat.size)
        self.num_docs += len(lengths)

    def close(self) -> dict[str, Any]:
        self._file.close()
        starts = np.concatenate(self._starts) if self._starts else np.empty(0, dtype=np.int64)
        np.save(self.docs_path, starts.astype(np.int64))
        return {
            "tokens": self.tokens_path,
            "docs": self.docs_path,
            "num_tokens": self.num_tokens,
            "num_docs": self.num_docs,
        }


def run_task(
    task: Task,
    settings: dict[str, Any],
    tokenizer_spec: str,
    folder: str,
    report: Optional[Callable[[int, int, int], None]] = None,
) -> dict[str, Any]:
    """Tokenize one task into one temporary shard per split; returns the shards' counts.

    Progress (input bytes, documents, tokens) goes to ``report``, or in a pool worker to the
    queue the pool was started with.
    """
    tokenizer = build_tokenizer(tokenizer_spec)
    dtype = token_dtype(tokenizer.vocab_size)
    writers = {s: _ShardWriter(folder, s, task.index, dtype) for s in SPLITS}
    pending: dict[str, list[str]] = {s: [] for s in SPLITS}
    num_bytes = num_docs = 0

    def flush(split: str) -> None:
        nonlocal num_bytes, num_docs
        flat, lengths = encode_documents(tokenizer, pending[split], dtype)
        writers[split].write(flat, lengths)
        if report is not None:
            report(num_bytes, len(lengths), int(flat.size))
        elif _progress_queue is not None:
            _progress_queue.put((num_bytes, len(lengths), int(flat.size)))
        num_bytes = 0
        pending[split] = []

    for key, text, size in _task_documents(task, settings):
        num_bytes += size
        if text is None:  # null rows are skipped but keep their row index as key
            continue
        if not isinstance(text, str):
            raise ConfigError(
                f"data.text_field={settings['text_field']!r} holds {type(text).__name__} values (row {key} "
                "of "
                f"data.path={settings['path']!r}), not text; set data.text_field to the text column"
            )
        split = "validation" if is_validation(key, settings["val_fraction"]) else "train"
        pending[split].append(text)
        if len(pending[split]) >= _BATCH_DOCS:
            flush(split)
    for split in SPLITS:
        flush(split)
    return {s: w.close() for s, w in writers.items()}
