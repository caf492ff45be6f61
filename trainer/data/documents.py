"""Documents: read a corpus in canonical order and split it into train/validation.

Documents are read in a canonical sorted order and split by a hash of a stable key (the
path relative to the stdlib for the built-in corpus, the row or file index otherwise), so
every rank, every run and the offline preparation (``trainer.prepare_data``) compute the
same split without talking to each other.
"""

from __future__ import annotations

import itertools
import os
import sysconfig
import zlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Optional

from models.errors import ConfigError

if TYPE_CHECKING:
    from trainer.config import DataConfig

SPLITS = ("train", "validation")
SOURCES = ("builtin", "text", "json", "parquet", "hub")
# The preset is called jsonl.yaml, so accept the name users will naturally type.
_SOURCE_ALIASES = {"jsonl": "json"}
# Extensions picked up when data.path is a directory (a glob can select anything else).
EXTENSIONS = {"text": (".txt", ".text", ".md"), "json": (".jsonl", ".json"), "parquet": (".parquet",)}
_EXCLUDED_STDLIB_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})
_VAL_BUCKETS = 10_000


def is_validation(key: str, val_fraction: float) -> bool:
    """Whether the document with stable ``key`` is held out (hash of the key, no coordination)."""
    return zlib.crc32(key.encode("utf-8")) % _VAL_BUCKETS < val_fraction * _VAL_BUCKETS


# ----------------------------------------------------------------------------- documents


def builtin_root() -> str:
    """Directory of the built-in corpus: the Python standard library of this interpreter."""
    return sysconfig.get_paths()["stdlib"]


def _builtin_files(root: str) -> list[str]:
    """Relative POSIX paths of the stdlib ``.py`` files, sorted (the canonical order)."""
    rel_paths = []
    for dirpath, dirnames, filenames in os.walk(root):
        # Prune in place: third-party packages differ between machines, the stdlib does not.
        dirnames[:] = [d for d in dirnames if d not in _EXCLUDED_STDLIB_DIRS]
        rel_dir = os.path.relpath(dirpath, root)
        for name in filenames:
            if name.endswith(".py"):
                rel_paths.append(os.path.normpath(os.path.join(rel_dir, name)).replace(os.sep, "/"))
    return sorted(rel_paths)


def _expand_path(path: str, source: str) -> list[str]:
    """A file, a glob or a directory -> sorted list of readable files (checked before ``datasets``)."""
    exts = EXTENSIONS[source]
    if os.path.isdir(path):
        files = []
        for dirpath, dirnames, filenames in os.walk(path):
            dirnames[:] = [d for d in dirnames if not d.startswith(".")]  # .git, .cache, ...
            files += [os.path.join(dirpath, f) for f in filenames if f.lower().endswith(exts)]
        if not files:
            raise ConfigError(
                f"data.path={path!r} is a directory with no {'/'.join('*' + e for e in exts)} files "
                f"for data.source={source}; point data.path at the data files or use a glob"
            )
    elif os.path.isfile(path):
        files = [path]
    elif any(c in path for c in "*?["):
        import glob

        files = [f for f in glob.glob(path, recursive=True) if os.path.isfile(f)]
        if not files:
            raise ConfigError(f"data.path={path!r}: the glob matches no files; fix the pattern")
    else:
        raise ConfigError(
            f"data.path={path!r}: no such file or directory; pass an existing file, directory or glob"
        )
    for f in files:
        try:
            with open(f, "rb") as fh:
                fh.read(1)
        except OSError as err:
            raise ConfigError(
                f"data.path={path!r}: cannot read {f!r} ({err}); fix its permissions or remove it"
            ) from err
    return sorted(files)


def _root_cause(err: BaseException) -> BaseException:
    """``datasets`` wraps the parser's error; the innermost one says what is wrong."""
    for _ in range(20):  # bounded: exception chains can in principle be cyclic
        inner = err.__cause__ or err.__context__
        if inner is None:
            break
        err = inner
    return err


def _load_files(files: list[str], source: str, path: str) -> Any:
    """``datasets.load_dataset`` on local files; a bad file becomes a ConfigError naming it."""
    import datasets  # heavy import, only for non-builtin sources

    kwargs = {"sample_by": "document"} if source == "text" else {}  # one document per text file

    def load(fs: list[str]) -> Any:
        return datasets.load_dataset(source, data_files={"train": fs}, split="train", **kwargs)

    try:
        return load(files)
    except Exception as err:
        culprit = files[0]
        if len(files) > 1:  # error path only: find which file breaks by loading them one at a time
            for f in files:
                try:
                    load([f])
                except Exception:
                    culprit = f
                    break
        raise ConfigError(
            f"data.path={path!r}: cannot read {culprit!r} as data.source={source} "
            f"({_root_cause(err)}); fix or remove that file"
        ) from err


def _column(ds: Any, field: str, where: str) -> list[Optional[str]]:
    """All values of ``field`` as a Python list, with a clear error when the column is missing."""
    if field not in ds.column_names:
        raise ConfigError(
            f"data.text_field={field!r} is not a column of {where} (columns: {ds.column_names}); "
            "set data.text_field to the column that holds the text"
        )
    return ds.select_columns([field])[:][field]


def _read_hub(cfg: DataConfig) -> list[Optional[str]]:
    """A Hugging Face Hub dataset (needs network unless cached). Capped reads stream."""
    import datasets

    where = f"hub dataset data.path={cfg.path!r} (name={cfg.name!r}, split={cfg.split!r})"
    try:
        if cfg.max_documents is not None:
            # Streaming reads only the first rows instead of downloading the whole dataset.
            stream = datasets.load_dataset(cfg.path, cfg.name, split=cfg.split, streaming=True)
            rows = list(itertools.islice(stream, cfg.max_documents))
            return _column(datasets.Dataset.from_list(rows), cfg.text_field, where) if rows else []
        return _column(datasets.load_dataset(cfg.path, cfg.name, split=cfg.split), cfg.text_field, where)
    except ConfigError:
        raise
    except Exception as err:
        raise ConfigError(
            f"cannot load {where}: {_root_cause(err)}; check the name, config and split on the Hub "
            "and network access (or use a local source: data=jsonl data.path=...)"
        ) from err


def _open_corpus(cfg: DataConfig, source: str) -> tuple[list[str], Callable[[list[int]], list[str]]]:
    """Stable keys of all documents (canonical order, capped) and a function reading some of them.

    Keys decide the split, so the builtin corpus only reads the files of the requested split.
    """
    cap = cfg.max_documents
    if source == "builtin":
        root = builtin_root()
        rel_paths = _builtin_files(root)[:cap]

        def read(indices: list[int]) -> list[str]:
            texts: list[str] = []
            for i in indices:
                with open(os.path.join(root, rel_paths[i]), encoding="utf-8", errors="replace") as fh:
                    texts.append(fh.read())
            return texts

        return rel_paths, read
    if source == "hub":
        texts = _read_hub(cfg)
    else:
        ds = _load_files(_expand_path(cfg.path, source), source, cfg.path)
        if cap is not None:
            ds = ds.select(range(min(cap, len(ds))))
        texts = _column(ds, "text" if source == "text" else cfg.text_field, f"data.path={cfg.path!r}")
    for i, t in enumerate(texts):
        if t is not None and not isinstance(t, str):
            raise ConfigError(
                f"data.text_field={cfg.text_field!r} holds {type(t).__name__} values (row {i} of "
                f"data.path={cfg.path!r}), not text; set data.text_field to the text column"
            )
    # Null texts are dropped here, before the split, but keep their row index as key so that
    # the split of the other rows does not depend on them.
    kept = [i for i, t in enumerate(texts) if t is not None]
    return [str(i) for i in kept], lambda indices: [texts[kept[j]] for j in indices]


def _validate_cfg(cfg: DataConfig, split: str) -> str:
    """Check the data config fields this module reads; returns the canonical source name."""
    source = _SOURCE_ALIASES.get(cfg.source, cfg.source)
    if source not in SOURCES:
        raise ConfigError(f"data.source={cfg.source!r} is unknown; use one of {list(SOURCES)}")
    if split not in SPLITS:
        raise ConfigError(f"split={split!r} is unknown; use one of {list(SPLITS)}")
    if source == "builtin" and cfg.path is not None:
        raise ConfigError(
            f"data.path={cfg.path!r} is set but data.source=builtin reads the standard library; "
            "set data.source=text|json|parquet|hub (e.g. data=jsonl) or drop data.path"
        )
    if source != "builtin" and not cfg.path:
        raise ConfigError(f"data.path={cfg.path!r}: data.source={source} needs a path; pass data.path=...")
    if not 0.0 <= cfg.val_fraction < 1.0:
        raise ConfigError(
            f"data.val_fraction={cfg.val_fraction} must be in [0, 1); e.g. data.val_fraction=0.01"
        )
    if cfg.max_documents is not None and cfg.max_documents < 1:
        raise ConfigError(f"data.max_documents={cfg.max_documents} must be >= 1, or null to read everything")
    return source


def load_documents(cfg: DataConfig, split: str) -> list[str]:
    """The documents of ``split`` ("train" or "validation"), in canonical order.

    A document is held out iff ``crc32(key) % 10_000 < val_fraction * 10_000``; the key is
    the path relative to the stdlib (builtin) or the document index (other sources), so
    every rank and every run gets the same split. A corpus too small for the hash to pick
    any document gives its last training document to validation instead, so evaluation
    always has data when ``val_fraction > 0``. ``max_documents`` caps documents read,
    before the split. Rows whose text is null are skipped.
    """
    source = _validate_cfg(cfg, split)
    keys, read = _open_corpus(cfg, source)
    if not keys:
        raise ConfigError(f"data.source={source} data.path={cfg.path!r} has no documents; point it at data")
    is_val = [is_validation(k, cfg.val_fraction) for k in keys]
    train_idx = [i for i, v in enumerate(is_val) if not v]
    val_idx = [i for i, v in enumerate(is_val) if v]
    if cfg.val_fraction > 0 and not val_idx and train_idx:
        val_idx.append(train_idx.pop())
    if not train_idx:
        raise ConfigError(
            f"data.val_fraction={cfg.val_fraction} leaves no training documents out of {len(keys)} "
            f"(data.path={cfg.path!r}); add documents or lower data.val_fraction (0 disables validation)"
        )
    return read(train_idx if split == "train" else val_idx)
