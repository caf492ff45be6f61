"""Downstream tasks read from local JSONL files (nothing is downloaded), and their scoring requests.

One JSON object per line, one of two kinds (a file may mix them):

- multiple choice: ``{"context": str, "choices": [str, ...], "gold": int}`` and optionally
  ``"delimiter": str`` (default ``""``). Each choice is scored as the continuation
  ``delimiter + choice`` of ``context``: its summed log-likelihood. ``acc``: the gold choice has
  the highest sum; ``acc_norm``: the highest sum per character of the choice; ``acc_bytes``: per
  UTF-8 byte of the choice (lm-evaluation-harness's ``acc``, ``acc_norm`` and ``acc_bytes``; the
  delimiter plays its ``target_delimiter`` and is not counted in the lengths).
- generation: ``{"context": str, "target": str}`` (optionally ``"delimiter"``). ``exact_match``:
  greedy decoding of ``len(target tokens)`` tokens after the context gives exactly the target's
  tokens. That holds iff at every target position the argmax of the logits, given the context and
  the target's earlier tokens, is the target token (a greedy decode follows the same path), so
  it is scored in one teacher-forced forward, like a log-likelihood.

A task is a file ``<name>.jsonl`` (its name is the file's stem) or the name of a task shipped in
``trainer/eval/data/`` (``SHIPPED_TASKS``). Token requests follow lm-evaluation-harness exactly:
trailing whitespace of the context moves to the continuation; ``[bos] + context + continuation``
is encoded whole and split after the context's tokens; a request longer than the model's context
keeps its last ``max_len + 1`` tokens.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Optional

from models.errors import ConfigError
from trainer.data.tokenizer import Tokenizer

__all__ = ["SHIPPED_TASKS", "Example", "Request", "Task", "build_requests", "load_task", "resolve_task"]

DATA_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")
SHIPPED_TASKS = ("next_line", "complete_word")


@dataclass(frozen=True)
class Example:
    """One task example: choices + gold (multiple choice) or a target (generation)."""

    context: str
    choices: Optional[tuple[str, ...]] = None
    gold: Optional[int] = None
    target: Optional[str] = None
    delimiter: str = ""

    @property
    def is_choice(self) -> bool:
        return self.choices is not None


@dataclass(frozen=True)
class Task:
    name: str
    path: str
    examples: tuple[Example, ...]


@dataclass(frozen=True)
class Request:
    """One scored continuation: model inputs and how many of its last positions are the target."""

    example: int  # index of the example in its task
    choice: int  # index of the choice (0 for a generation example)
    tokens: tuple[
        int, ...
    ]  # context + continuation tokens (BOS first unless truncated) = inputs + last target
    num_targets: int  # the continuation's token count: the last ``num_targets`` positions are scored


def resolve_task(spec: str) -> str:
    """The JSONL file of ``spec``: a shipped task name or a path to a ``.jsonl`` file."""
    if spec in SHIPPED_TASKS:
        return os.path.join(DATA_DIR, f"{spec}.jsonl")
    if os.path.isfile(spec):
        return spec
    raise ConfigError(
        f"eval.tasks entry {spec!r} is neither a shipped task {list(SHIPPED_TASKS)} nor an existing file; "
        "pass a task name or the path to a JSONL task file (see the README's Evaluation section)."
    )


def _example(row: Any, where: str) -> Example:
    if not isinstance(row, dict) or not isinstance(row.get("context"), str):
        raise ConfigError(f"{where}: expected an object with a string 'context'; got {str(row)[:80]!r}.")
    delimiter = row.get("delimiter", "")
    if not isinstance(delimiter, str):
        raise ConfigError(f"{where}: 'delimiter' must be a string, got {delimiter!r}.")
    if "choices" in row:
        choices, gold = row["choices"], row.get("gold")
        if not (
            isinstance(choices, list) and len(choices) >= 2 and all(isinstance(c, str) and c for c in choices)
        ):
            raise ConfigError(f"{where}: 'choices' must be a list of >= 2 non-empty strings.")
        if not (isinstance(gold, int) and not isinstance(gold, bool) and 0 <= gold < len(choices)):
            raise ConfigError(
                f"{where}: 'gold' must be the index of the right choice (0..{len(choices) - 1}), got "
                f"{gold!r}."
            )
        return Example(row["context"], choices=tuple(choices), gold=gold, delimiter=delimiter)
    target = row.get("target")
    if not (isinstance(target, str) and target):
        raise ConfigError(
            f"{where}: a line needs 'choices' + 'gold' (multiple choice) or a non-empty string 'target' "
            "(generation)."
        )
    return Example(row["context"], target=target, delimiter=delimiter)


def load_task(spec: str, limit: Optional[int] = None) -> Task:
    """Read and check a task file (``ConfigError`` naming the file and line); ``limit``: first N examples."""
    path = resolve_task(spec)
    examples: list[Example] = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{number}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ConfigError(f"{where}: not a JSON object ({e.msg}); one JSON object per line.") from e
            examples.append(_example(row, where))
            if limit is not None and len(examples) >= limit:
                break
    if not examples:
        raise ConfigError(f"task file {path} holds no examples.")
    name = os.path.splitext(os.path.basename(path))[0]
    return Task(name=name, path=path, examples=tuple(examples))


def encode_pair(tokenizer: Tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """(context tokens with BOS first, continuation tokens), as lm-evaluation-harness's ``_encode_pair``
    with ``add_bos_token=True``: trailing whitespace of the context moves to the continuation, and the
    whole is encoded once and split after the context's tokens."""
    stripped = context.rstrip()
    if len(stripped) < len(context):
        continuation = context[len(stripped) :] + continuation
        context = stripped
    whole = [tokenizer.bos_id, *tokenizer.encode(context + continuation)]
    context_ids = [tokenizer.bos_id, *tokenizer.encode(context)]
    return context_ids, whole[len(context_ids) :]


def build_requests(task: Task, tokenizer: Tokenizer, max_len: int) -> list[Request]:
    """Every (example, choice) continuation of ``task`` as token requests of at most ``max_len`` inputs."""
    requests: list[Request] = []
    for i, ex in enumerate(task.examples):
        continuations = ex.choices if ex.is_choice else (ex.target,)
        for j, cont in enumerate(continuations):
            context_ids, cont_ids = encode_pair(tokenizer, ex.context, ex.delimiter + cont)
            if not cont_ids:
                raise ConfigError(f"{task.path}: example {i} choice {j} encodes to no tokens.")
            tokens = (context_ids + cont_ids)[-(max_len + 1) :]
            requests.append(Request(i, j, tuple(tokens), min(len(cont_ids), len(tokens) - 1)))
    return requests
