"""Data: documents -> tokens -> windows -> deterministic, resumable, per-rank batches.

* :mod:`~trainer.data.documents` reads raw corpora in canonical order and splits them;
* :mod:`~trainer.data.prepared` tokenizes a corpus once into flat token shards
  (``python -m trainer.prepare_data``) and opens them; :mod:`~trainer.data.prepare_tasks` holds the
  preparation's tasks and the workers that tokenize them;
* :mod:`~trainer.data.windows` cuts a token store into windows and maps global sample
  indices to windows (epoch permutations, weighted mixtures);
* :mod:`~trainer.data.loader` is the per-rank loader (state: global samples seen);
* :mod:`~trainer.data.stream` tokenizes and packs streamed corpora on the fly;
* :mod:`~trainer.data.build` is ``build_dataloader``: the loader for every source (it imports
  ``loader`` and ``stream``; neither imports it);
* :mod:`~trainer.data.tokenizer` is the tokenizer (byte-level or a ``tokenizer.json``);
* :mod:`~trainer.data.prefetch` runs batch preparation in a background thread.
"""

import importlib
from typing import Any

# Imported on first use (PEP 562): preparation workers load only what they need, never torch.
_EXPORTS = {
    "SOURCES": "documents",
    "SPLITS": "documents",
    "_builtin_files": "documents",
    "builtin_root": "documents",
    "is_validation": "documents",
    "load_documents": "documents",
    "DataLoader": "loader",
    "build_dataloader": "build",
    "tokenize_documents": "loader",
    "tokenize_with_starts": "loader",
    "Batch": "windows",
    "DocWindows": "windows",
    "Mixture": "windows",
    "PackedWindows": "windows",
    "SampleOrder": "windows",
    "TokenWindows": "windows",
    "feistel_permutation": "windows",
    "mixture_pattern": "windows",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'trainer.data' has no attribute {name!r}")
    return getattr(importlib.import_module(f"trainer.data.{_EXPORTS[name]}"), name)
