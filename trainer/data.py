"""Documents -> one flat token stream -> fixed windows -> deterministic, resumable batches.

The order of samples is a pure function of ``(data, seq_len, seed, global sample index)``:

* documents are read in a canonical sorted order and split into train/validation by a hash
  of a stable key, so every rank computes the same split without talking to the others;
* each split is packed as ``[bos] doc [eos] [bos] doc [eos] ...`` into one 1-D tensor, and
  window ``k`` is ``flat[k*S : k*S + S + 1]`` (inputs = ``[:-1]``, labels = ``[1:]``);
* global sample ``g`` is window ``perm_e[g % N]`` of epoch ``e = g // N`` (``N`` windows,
  ``perm_e`` a ``randperm`` seeded with ``seed + e``);
* global step ``t`` consumes samples ``[t*G, (t+1)*G)``; data-parallel rank ``r`` takes the
  ``r``-th contiguous slice of ``G / dp_size`` of them.

So the loader state is one integer (global samples seen), and a run can resume with a
different data-parallel degree without repeating or skipping a sample.
"""

from __future__ import annotations

import itertools
import os
import sysconfig
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
import torch

from models.errors import ConfigError
from trainer.tokenizer import Tokenizer

SPLITS = ("train", "validation")
SOURCES = ("builtin", "text", "json", "parquet", "hub")
# The preset is called jsonl.yaml, so accept the name users will naturally type.
_SOURCE_ALIASES = {"jsonl": "json"}
# Extensions picked up when data.path is a directory (a glob can select anything else).
EXTENSIONS = {"text": (".txt", ".text", ".md"), "json": (".jsonl", ".json"), "parquet": (".parquet",)}
_EXCLUDED_STDLIB_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})
_VAL_BUCKETS = 10_000
_ENCODE_CHUNK = 1024  # documents per encode_batch call: parallel in Rust, bounded memory

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


def _read_hub(cfg: Any) -> list[Optional[str]]:
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


def _open_corpus(cfg: Any, source: str) -> tuple[list[str], Callable[[list[int]], list[str]]]:
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


def _validate_cfg(cfg: Any, split: str) -> str:
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


def load_documents(cfg: Any, split: str) -> list[str]:
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
    threshold = cfg.val_fraction * _VAL_BUCKETS
    is_val = [zlib.crc32(k.encode("utf-8")) % _VAL_BUCKETS < threshold for k in keys]
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


# ------------------------------------------------------------------------------- packing


def tokenize_documents(docs: Sequence[str], tokenizer: Tokenizer) -> torch.Tensor:
    """``[bos] + encode(doc) + [eos]`` for every doc, concatenated into one 1-D tensor.

    The dtype is int16 when the vocabulary fits (the byte tokenizer: half the memory of
    int32 for the ~31M-token built-in corpus, held by every rank), int32 otherwise.
    """
    dtype = torch.int16 if tokenizer.vocab_size <= torch.iinfo(torch.int16).max + 1 else torch.int32
    bos = torch.tensor([tokenizer.bos_id], dtype=dtype)
    eos = torch.tensor([tokenizer.eos_id], dtype=dtype)
    encode_to_tensor = getattr(tokenizer, "encode_to_tensor", None)
    if encode_to_tensor is not None:  # byte tokenizer: no Python int lists at all
        parts: list[torch.Tensor] = []
        for doc in docs:
            parts += [bos, encode_to_tensor(doc), eos]
        return torch.cat(parts).to(dtype) if parts else torch.empty(0, dtype=dtype)
    encode_batch = getattr(tokenizer, "encode_batch", None)
    chunks: list[torch.Tensor] = []
    for start in range(0, len(docs), _ENCODE_CHUNK):
        batch = list(docs[start : start + _ENCODE_CHUNK])
        ids = encode_batch(batch) if encode_batch is not None else [tokenizer.encode(d) for d in batch]
        stream = itertools.chain.from_iterable(
            itertools.chain((tokenizer.bos_id,), x, (tokenizer.eos_id,)) for x in ids
        )
        count = sum(len(x) + 2 for x in ids)
        chunks.append(torch.from_numpy(np.fromiter(stream, dtype=np.int64, count=count)).to(dtype))
    return torch.cat(chunks) if chunks else torch.empty(0, dtype=dtype)


@dataclass
class Batch:
    """One local batch: next-token prediction pairs."""

    inputs: torch.Tensor  # (b, S) int64
    labels: torch.Tensor  # (b, S) int64


class TokenWindows:
    """One split's flat token stream cut into ``num_windows`` windows of ``seq_len + 1`` tokens.

    Consecutive windows overlap by one token, so every token except the first is a label once.
    """

    def __init__(self, tokens: torch.Tensor, seq_len: int) -> None:
        if tokens.dim() != 1 or tokens.is_floating_point():
            raise ConfigError(
                f"tokens must be a 1-D integer tensor, got shape {tuple(tokens.shape)} {tokens.dtype}"
            )
        if seq_len < 1:
            raise ConfigError(f"training.seq_len={seq_len} must be >= 1")
        self.tokens = tokens
        self.seq_len = seq_len
        self.num_tokens = tokens.numel()
        self.num_windows = max(self.num_tokens - 1, 0) // seq_len
        # A strided view, no copy: row k = tokens[k*S : k*S + S + 1].
        self._rows = (
            tokens.unfold(0, seq_len + 1, seq_len) if self.num_windows else tokens.new_empty(0, seq_len + 1)
        )

    def window(self, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, labels) of window ``k``, each (S,) int64."""
        if not 0 <= k < self.num_windows:
            raise IndexError(f"window {k} out of range [0, {self.num_windows})")
        row = self._rows[k].long()
        return row[:-1], row[1:]

    def gather(self, indices: torch.Tensor) -> Batch:
        """Windows ``indices`` stacked into a :class:`Batch` of shape (len(indices), S)."""
        rows = self._rows[indices].long()  # (b, S+1)
        return Batch(inputs=rows[:, :-1].contiguous(), labels=rows[:, 1:].contiguous())


# ------------------------------------------------------------------------------- loading


def _check_enough_windows(windows: TokenWindows, global_batch_size: int, what: str) -> None:
    if windows.num_windows < global_batch_size:
        raise ConfigError(
            f"{what} has {windows.num_tokens} tokens = {windows.num_windows} windows of seq_len="
            f"{windows.seq_len}, fewer than training.global_batch_size={global_batch_size} needs for one "
            "batch; add data, or lower training.seq_len / training.global_batch_size"
        )


class DataLoader:
    """Per data-parallel rank view of the global sample order; state = global samples seen."""

    def __init__(
        self,
        windows: TokenWindows,
        *,
        global_batch_size: int,
        dp_rank: int,
        dp_size: int,
        seed: int,
        shuffle: bool,
    ) -> None:
        if dp_size < 1 or not 0 <= dp_rank < dp_size:
            raise ConfigError(f"dp_rank={dp_rank} must be in [0, dp_size={dp_size}) and dp_size >= 1")
        if global_batch_size < 1 or global_batch_size % dp_size:
            raise ConfigError(
                f"training.global_batch_size={global_batch_size} must be a positive multiple of the "
                f"data-parallel degree {dp_size}; change one of them"
            )
        _check_enough_windows(windows, global_batch_size, "the data")
        self.windows = windows
        self.global_batch_size = global_batch_size
        self.local_batch_size = global_batch_size // dp_size
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.seed = seed
        self.shuffle = shuffle
        self.samples_seen = 0  # global, across all dp ranks
        self._perm_cache: dict[int, torch.Tensor] = {}

    @property
    def epoch(self) -> int:
        """Epoch of the next sample (for logging)."""
        return self.samples_seen // self.windows.num_windows

    def _permutation(self, epoch: int) -> torch.Tensor:
        if epoch not in self._perm_cache:
            n = self.windows.num_windows
            if self.shuffle:
                perm = torch.randperm(n, generator=torch.Generator().manual_seed(self.seed + epoch))
            else:
                perm = torch.arange(n)
            # A batch spans at most two epochs; keep only the newest to bound memory.
            self._perm_cache = {e: p for e, p in self._perm_cache.items() if e == epoch - 1}
            self._perm_cache[epoch] = perm
        return self._perm_cache[epoch]

    def window_indices(self, global_samples: torch.Tensor) -> torch.Tensor:
        """Window index of each global sample index (epoch-wise permutation)."""
        n = self.windows.num_windows
        epochs, positions = global_samples // n, global_samples % n
        out = torch.empty_like(global_samples)
        for epoch in epochs.unique().tolist():
            mask = epochs == epoch
            out[mask] = self._permutation(int(epoch))[positions[mask]]
        return out

    def next_batch(self) -> Batch:
        """This rank's ``global_batch_size // dp_size`` rows of the next global step."""
        start = self.samples_seen + self.dp_rank * self.local_batch_size
        samples = torch.arange(start, start + self.local_batch_size)
        self.samples_seen += self.global_batch_size
        return self.windows.gather(self.window_indices(samples))

    def reset(self) -> None:
        """Back to global sample 0 (validation restarts before each evaluation)."""
        self.samples_seen = 0

    def state_dict(self) -> dict[str, Any]:
        """Position plus what identifies the sample order, to catch resuming on other data."""
        return {
            "samples_seen": self.samples_seen,
            "global_batch_size": self.global_batch_size,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "num_windows": self.windows.num_windows,
        }

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """Resume at the saved global sample; works for any dp_size since the state is global."""
        missing = {"samples_seen", "global_batch_size", "seed", "shuffle", "num_windows"} - set(sd)
        if missing:
            raise ConfigError(
                f"data loader state is missing {sorted(missing)}; the checkpoint is not from this trainer"
            )
        # These define the sample order; resuming with other values would silently change the data.
        current = {"num_windows": self.windows.num_windows, "seed": self.seed, "shuffle": self.shuffle}
        for key, value in current.items():
            if type(value)(sd[key]) != value:
                raise ConfigError(
                    f"checkpoint data loader has {key}={sd[key]}, this run has {key}={value} (data, "
                    "tokenizer, training.seq_len, training.seed or data.shuffle changed); resume with "
                    "the same settings or start a new run in a fresh job.dump_folder"
                )
        samples_seen = int(sd["samples_seen"])
        if samples_seen % self.global_batch_size:
            raise ConfigError(
                f"checkpoint has seen {samples_seen} samples (global_batch_size={sd['global_batch_size']}), "
                f"not a multiple of the new training.global_batch_size={self.global_batch_size}; "
                "pick a global batch size that divides it or keep the old one"
            )
        self.samples_seen = samples_seen


def build_dataloader(
    cfg: Any,
    tokenizer: Tokenizer,
    *,
    split: str,
    seq_len: int,
    global_batch_size: int,
    dp_rank: int,
    dp_size: int,
    seed: int,
) -> DataLoader:
    """Read, tokenize and window ``split``; shuffle only the training split (if data.shuffle)."""
    docs = load_documents(cfg, split)
    if not docs:  # validation with val_fraction=0 (train emptiness is caught in load_documents)
        raise ConfigError(
            f"the {split} split is empty (data.val_fraction={cfg.val_fraction}); "
            "set data.val_fraction>0 or disable evaluation (training.eval_freq=0)"
        )
    windows = TokenWindows(tokenize_documents(docs, tokenizer), seq_len)
    _check_enough_windows(windows, global_batch_size, f"the {split} split ({len(docs)} documents)")
    return DataLoader(
        windows,
        global_batch_size=global_batch_size,
        dp_rank=dp_rank,
        dp_size=dp_size,
        seed=seed,
        shuffle=bool(cfg.shuffle) and split == "train",
    )
