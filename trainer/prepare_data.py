"""Tokenize a corpus once into flat token shards: ``python -m trainer.prepare_data``.

::

    python -m trainer.prepare_data data=jsonl data.path=/data/web data.tokenizer=tok.json out=/data/web_tok
    num_proc=8
    python -m trainer.prepare_data data=hub data.path=roneneldan/TinyStories out=/data/tinystories
    python -m trainer.prepare_data data=builtin out=/data/stdlib          # the built-in corpus
    torchrun ... trainer/main.py data=tokens data.path=/data/web_tok data.tokenizer=tok.json

Arguments are Hydra overrides of the training config (``data=<preset>``, ``data.*``; a
``model=<preset>`` or ``model.vocab_size=N`` refuses a tokenizer larger than that model's
vocabulary before any work) plus:

* ``out=DIR`` (required): the prepared folder;
* ``num_proc=N`` (default 1): worker processes tokenizing in parallel;
* ``chunk_mb=M`` (default 256): input megabytes per task, i.e. per output shard.

Re-running with the same inputs does nothing; a changed tokenizer, setting or source file
is refused with the differences listed. Progress (documents, tokens, MB/s, ETA) goes to
stderr. Exit code 2 on bad input.

Argument parsing only: the preparation and its checks are ``trainer/data/prepared.py``.
"""

from __future__ import annotations

import logging
import sys
from typing import Any, Optional

from models.errors import ConfigError
from trainer.data.prepared import check_out_folder, prepare

_OWN_KEYS = {"out": str, "num_proc": int, "chunk_mb": float}
_TYPE_NAMES = {str: "a path", int: "an integer", float: "a number"}


def parse_args(argv: list[str]) -> tuple[dict[str, Any], list[str]]:
    """Split ``argv`` into this tool's own ``key=value`` arguments and Hydra overrides."""
    own: dict[str, Any] = {"out": None, "num_proc": 1, "chunk_mb": 256.0}
    overrides = []
    for arg in argv:
        key, sep, value = arg.partition("=")
        if sep and key in _OWN_KEYS:
            try:
                own[key] = _OWN_KEYS[key](value)
            except ValueError as err:
                raise ConfigError(f"{arg}: {key} must be {_TYPE_NAMES[_OWN_KEYS[key]]}") from err
        elif arg in ("-h", "--help"):
            print(__doc__)
            sys.exit(0)
        else:
            overrides.append(arg)
    _check_own(own)
    return own, overrides


def _check_own(own: dict[str, Any]) -> None:
    """``out`` is given and names a folder that can be created; ``num_proc`` and ``chunk_mb`` are positive."""
    out = own["out"]
    if not out:
        raise ConfigError("out=DIR is required: the folder to write the prepared shards into")
    if own["num_proc"] < 1:
        raise ConfigError(f"num_proc={own['num_proc']} must be >= 1 (worker processes).")
    if not 0 < own["chunk_mb"] < float("inf"):
        raise ConfigError(f"chunk_mb={own['chunk_mb']} must be a number > 0 (input megabytes per shard).")
    check_out_folder(out)


def compose(overrides: list[str]) -> tuple[Any, Optional[int]]:
    """(data config, model vocab size if a model was named) from Hydra overrides."""
    from trainer.config import compose_config

    cfg = compose_config(*overrides)  # ConfigError (one line) on an unknown preset or key, a wrong type
    named_model = any(o.lstrip("+~").startswith(("model", "experiment")) for o in overrides)
    return cfg.data, cfg.model.vocab_size if named_model else None


def main(argv: Optional[list[str]] = None) -> int:
    """Run the preparation; returns the exit code."""
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    try:
        own, overrides = parse_args(sys.argv[1:] if argv is None else argv)
        data, vocab_size = compose(overrides)
        prepare(data, own["out"], num_proc=own["num_proc"], chunk_mb=own["chunk_mb"], vocab_size=vocab_size)
    except ConfigError as err:
        print(f"config error: {err}", file=sys.stderr, flush=True)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
