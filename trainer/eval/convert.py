"""Convert public benchmark files to our task JSONL, and write an lm-evaluation-harness task YAML for
one of our task files (so both tools score the same examples, offline).

    python -m trainer.eval.convert hellaswag hellaswag_val.jsonl tasks/hellaswag.jsonl
    python -m trainer.eval.convert arc ARC-Challenge-Test.jsonl tasks/arc_challenge.jsonl
    python -m trainer.eval.convert piqa valid.jsonl tasks/piqa.jsonl --labels valid-labels.lst
    python -m trainer.eval.convert lm-eval-yaml tasks/piqa.jsonl lm_eval_tasks/

Inputs are the sets' own JSONL files (as published, or ``datasets``' ``to_json``): HellaSwag rows
``{ctx_a, ctx_b, activity_label, endings, label}``, ARC rows ``{question: {stem, choices: [{text,
label}]}, answerKey}`` (the original files) or ``{question, choices: {text, label}, answerKey}``
(the HF dataset), PIQA rows ``{goal, sol1, sol2}`` with the labels in a separate file (or a
``label`` field). The prompts are lm-evaluation-harness's for these tasks (HellaSwag's text
cleaning, ``Question: ...\\nAnswer:``), with its ``target_delimiter`` ``" "`` as our
``delimiter``, so ``acc_norm`` counts the same characters.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from collections.abc import Iterator
from typing import Any, Optional

from models.errors import ConfigError
from trainer.eval.tasks import load_task

__all__ = ["convert", "write_lm_eval_task"]


def _rows(path: str) -> Iterator[tuple[int, dict[str, Any]]]:
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if line.strip():
                try:
                    yield number, json.loads(line)
                except json.JSONDecodeError as e:
                    raise ConfigError(f"{path}:{number}: not a JSON object ({e.msg}).") from e


def _hellaswag_text(text: str) -> str:
    """lm-evaluation-harness's HellaSwag ``preprocess``: WikiHow artifacts removed."""
    text = text.strip().replace(" [title]", ". ")
    text = re.sub(r"\[.*?\]", "", text)
    return text.replace("  ", " ")


def hellaswag(row: dict[str, Any]) -> dict[str, Any]:
    ctx = row["ctx_a"] + " " + row["ctx_b"].capitalize()
    return {
        "context": _hellaswag_text(row["activity_label"] + ": " + ctx),
        "choices": [_hellaswag_text(e) for e in row["endings"]],
        "gold": int(row["label"]),
        "delimiter": " ",
    }


def arc(row: dict[str, Any]) -> dict[str, Any]:
    question = row["question"]
    if isinstance(question, dict):  # the original ARC files
        stem, texts = question["stem"], [c["text"] for c in question["choices"]]
        labels = [c["label"] for c in question["choices"]]
    else:  # the Hugging Face dataset
        stem, texts, labels = question, list(row["choices"]["text"]), list(row["choices"]["label"])
    return {
        "context": f"Question: {stem}\nAnswer:",
        "choices": texts,
        "gold": labels.index(row["answerKey"]),
        "delimiter": " ",
    }


def piqa(row: dict[str, Any]) -> dict[str, Any]:
    return {
        "context": f"Question: {row['goal']}\nAnswer:",
        "choices": [row["sol1"], row["sol2"]],
        "gold": int(row["label"]),
        "delimiter": " ",
    }


CONVERTERS = {"hellaswag": hellaswag, "arc": arc, "piqa": piqa}


def convert(kind: str, src: str, dst: str, labels: Optional[str] = None) -> int:
    """Convert ``src`` (a ``kind`` file) into our JSONL ``dst``; return the number of examples."""
    if kind not in CONVERTERS:
        raise ConfigError(f"unknown set {kind!r}; choose one of {sorted(CONVERTERS)}.")
    if not os.path.isfile(src):
        raise ConfigError(f"input file {src!r} does not exist.")
    extra_labels = None
    if labels is not None:
        with open(labels, encoding="utf-8") as f:
            extra_labels = [line.strip() for line in f if line.strip()]
    count = 0
    os.makedirs(os.path.dirname(os.path.abspath(dst)), exist_ok=True)
    with open(dst, "w", encoding="utf-8") as out:
        for i, (number, row) in enumerate(_rows(src)):
            if extra_labels is not None:
                row = {**row, "label": extra_labels[i]}
            try:
                example = CONVERTERS[kind](row)
            except (KeyError, ValueError, TypeError) as e:
                raise ConfigError(f"{src}:{number}: not a {kind} row ({type(e).__name__}: {e}).") from e
            out.write(json.dumps(example, ensure_ascii=False) + "\n")
            count += 1
    load_task(dst)  # the result must be a valid task file
    return count


def write_lm_eval_task(task_file: str, out_dir: str, name: Optional[str] = None) -> str:
    """An lm-evaluation-harness task YAML (``--include_path out_dir``) scoring the multiple-choice task
    ``task_file`` exactly as we do: the same context, choices and delimiter; acc, acc_norm, acc_bytes.
    Returns the task's name (``meshwright_<stem>`` by default)."""
    task = load_task(task_file)
    if not all(ex.is_choice for ex in task.examples):
        raise ConfigError(f"{task_file}: lm-eval YAMLs are written for multiple-choice tasks only.")
    delimiters = {ex.delimiter for ex in task.examples}
    if len(delimiters) != 1:
        raise ConfigError(
            f"{task_file}: lm-eval takes one target_delimiter per task; the file uses {sorted(delimiters)}."
        )
    name = name or f"meshwright_{task.name}"
    os.makedirs(out_dir, exist_ok=True)
    lines = [
        f"task: {name}",
        "dataset_path: json",
        "dataset_kwargs:",
        "  data_files:",
        f"    test: {json.dumps(os.path.abspath(task.path))}",
        "test_split: test",
        "output_type: multiple_choice",
        "doc_to_text: context",
        "doc_to_choice: choices",
        "doc_to_target: gold",
        f"target_delimiter: {json.dumps(delimiters.pop())}",
        "metric_list:",
        *[
            f"  - metric: {m}\n    aggregation: mean\n    higher_is_better: true"
            for m in ("acc", "acc_norm", "acc_bytes")
        ],
    ]
    with open(os.path.join(out_dir, f"{name}.yaml"), "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")
    return name


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m trainer.eval.convert", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("kind", choices=[*sorted(CONVERTERS), "lm-eval-yaml"])
    parser.add_argument("src", help="the set's JSONL file (lm-eval-yaml: one of our task files)")
    parser.add_argument("dst", help="our task JSONL to write (lm-eval-yaml: the folder for the YAML)")
    parser.add_argument("--labels", help="PIQA: the file of labels, one per line")
    args = parser.parse_args(argv)
    try:
        if args.kind == "lm-eval-yaml":
            name = write_lm_eval_task(args.src, args.dst)
            print(
                f"wrote {os.path.join(args.dst, name + '.yaml')}: lm_eval --include_path {args.dst} --tasks "
                f"{name}"
            )
        else:
            print(f"wrote {convert(args.kind, args.src, args.dst, args.labels)} examples to {args.dst}")
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
