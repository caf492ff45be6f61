"""Build the shipped example tasks from the built-in corpus's VALIDATION documents (held out from
training): ``python -m trainer.eval.build_example_tasks [out_dir]`` (default: trainer/eval/data).

- ``next_line`` (multiple choice, 4 choices): three consecutive lines of a file; which line really
  follows them -- the true one, or a line drawn from another validation file?
- ``complete_word`` (greedy exact match): code up to the first two characters of an identifier that
  already occurred in the preceding lines; the target is the rest of that identifier.

Deterministic (seeded); the committed files were built from CPython 3.11's standard library, and
another Python version's corpus builds slightly different ones.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import sys

from trainer.config import DataConfig
from trainer.data.documents import load_documents
from trainer.eval.tasks import DATA_DIR

NUM_EXAMPLES = 200
_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]{5,}")


def _usable(line: str) -> bool:
    return 8 <= len(line.strip()) and len(line) <= 100 and not line.lstrip().startswith("#")


def next_line_examples(docs: list[str], rng: random.Random) -> list[dict]:
    pool = [(d, line) for d, doc in enumerate(docs) for line in doc.splitlines() if _usable(line)]
    sites = [
        (d, i)
        for d, doc in enumerate(docs)
        for i, line in enumerate(doc.splitlines())
        if i >= 3 and _usable(line) and all(len(x) <= 100 for x in doc.splitlines()[i - 3 : i])
    ]
    out = []
    for d, i in rng.sample(sites, NUM_EXAMPLES):
        lines = docs[d].splitlines()
        true = lines[i]
        others: list[str] = []
        while len(others) < 3:
            od, line = rng.choice(pool)
            if od != d and line.strip() != true.strip() and line not in others:
                others.append(line)
        gold = rng.randrange(4)
        choices = [*others[:gold], true, *others[gold:]]
        out.append({"context": "\n".join(lines[i - 3 : i]) + "\n", "choices": choices, "gold": gold})
    return out


def complete_word_examples(docs: list[str], rng: random.Random) -> list[dict]:
    sites = []
    for doc in docs:
        lines = doc.splitlines()
        for i in range(4, len(lines)):
            before = "\n".join(lines[max(0, i - 8) : i]) + "\n"
            if len(before) > 500 or len(lines[i]) > 100:
                continue
            for m in _IDENT.finditer(lines[i]):
                if m.group() in before:  # seen in the context: the model can copy it
                    sites.append((before + lines[i][: m.start() + 2], m.group()[2:]))
                    break
    return [{"context": c, "target": t} for c, t in rng.sample(sites, NUM_EXAMPLES)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m trainer.eval.build_example_tasks", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("out_dir", nargs="?", default=DATA_DIR)
    args = parser.parse_args(argv)
    docs = load_documents(DataConfig(), "validation")
    os.makedirs(args.out_dir, exist_ok=True)
    for name, build in (("next_line", next_line_examples), ("complete_word", complete_word_examples)):
        rows = build(docs, random.Random(f"meshwright-{name}"))
        path = os.path.join(args.out_dir, f"{name}.jsonl")
        with open(path, "w", encoding="utf-8") as f:
            f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
        print(f"wrote {len(rows)} examples to {path} ({os.path.getsize(path) / 1024:.0f} KiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
