"""Evaluate a finished run: a ``step-N`` checkpoint or a Hugging Face folder, under any layout.

    python -m trainer.evaluate outputs/debug/checkpoints/step-300 eval.tasks=[next_line,complete_word]
    python -m trainer.evaluate hf/debug eval.tasks=[tasks/piqa.jsonl] eval.limit=500
    torchrun --nproc_per_node=4 -m trainer.evaluate outputs/debug/checkpoints/step-300 \\
        eval.tasks=[next_line] parallelism.dp_shard=2 parallelism.tp=2 training.eval_freq=1

The model (and the tokenizer) come from the folder; every other key is a training override
(``eval.*``, ``parallelism.*``, ``training.micro_batch_size`` ...). The weights are loaded
sharded, as ``checkpoint.initial_load_path`` / ``initial_load_hf`` would start a run, and the
tasks are scored by the trainer's own scorer (``Trainer.evaluate_tasks``); with
``training.eval_freq > 0`` the validation loss (``training.eval_steps`` batches) is measured too
(without it, the built-in corpus's training loader, which nothing reads, is capped at 64 files).
Rank 0 prints one line per task and writes ``<job.dump_folder>/eval_results.json`` (default
``outputs/evaluate``): the metrics and every example's log-likelihoods. Bad input exits 2.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import asdict
from typing import Any

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from models.errors import ConfigError
from trainer.checkpoint.hf import CONFIG_FILE, MESHWRIGHT_FILE, read_hf_config
from trainer.checkpoint.storage import MARKER, read_marker
from trainer.config import TrainConfig, compose_dict, config_error, to_train_config

USAGE = (
    "usage: python -m trainer.evaluate <checkpoint step-N folder | Hugging Face folder> "
    "eval.tasks=[...] [key=value ...]"
)
# What an evaluation is, unless the command line says otherwise.
DEFAULTS = ("job.name=evaluate", "checkpoint.enable=false", "metrics.tensorboard=false")


def _source(path: str) -> tuple[dict[str, Any], str, dict[str, Any]]:
    """(model args, tokenizer, checkpoint overrides) of a step-N or HF folder; ``ConfigError`` otherwise."""
    if not os.path.isdir(path):
        what = "is a file, not a folder" if os.path.exists(path) else "does not exist"
        raise ConfigError(f"{path} {what}; pass a checkpoint step-N folder or a Hugging Face folder.")
    if os.path.isfile(os.path.join(path, MARKER)):
        info = read_marker(path)
        if "model" not in info:
            raise ConfigError(f"{path} records no model config; it was not written by meshwright's trainer.")
        return info["model"], info.get("tokenizer", "byte"), {"initial_load_path": os.path.abspath(path)}
    if os.path.isfile(os.path.join(path, CONFIG_FILE)):
        _, args = read_hf_config(path)
        tokenizer = None
        if os.path.isfile(os.path.join(path, MESHWRIGHT_FILE)):
            with open(os.path.join(path, MESHWRIGHT_FILE), encoding="utf-8") as f:
                tokenizer = json.load(f).get("tokenizer")
        if tokenizer not in (None, "byte"):
            tokenizer = os.path.join(path, tokenizer)
        elif tokenizer is None and os.path.isfile(os.path.join(path, "tokenizer.json")):
            tokenizer = os.path.join(path, "tokenizer.json")
        if tokenizer is None:
            raise ConfigError(f"{path} holds no tokenizer (no tokenizer.json or meshwright.json); add one.")
        return asdict(args), tokenizer, {"initial_load_hf": os.path.abspath(path)}
    raise ConfigError(
        f"{path} is neither a meshwright checkpoint (no {MARKER}) nor a Hugging Face folder (no "
        f"{CONFIG_FILE}); "
        "pass e.g. outputs/debug/checkpoints/step-300."
    )


def build_config(path: str, overrides: list[str]) -> TrainConfig:
    """The run config of evaluating ``path``: its model and tokenizer, the defaults, then ``overrides``."""
    bad = [
        o
        for o in overrides
        if o.lstrip("+~").split("=", 1)[0].split(".")[0] in ("model", "data.tokenizer")
        or o.lstrip("+~").startswith(("data.tokenizer", "checkpoint.initial_load"))
    ]
    if bad:
        raise ConfigError(
            f"{bad[0]!r}: the model, its tokenizer and weights come from {path}; drop that override."
        )
    model, tokenizer, load = _source(path)
    dcfg = OmegaConf.to_container(compose_dict(*DEFAULTS, *overrides), resolve=False)
    assert isinstance(dcfg, dict)  # a composed config is a mapping
    if (
        not dcfg["training"]["eval_freq"]
        and dcfg["data"]["source"] == "builtin"
        and not any(o.lstrip("+~").startswith("data.max_documents") for o in overrides)
    ):
        # No validation loss asked for: the training loader the Trainer builds reads a few files only.
        dcfg["data"]["max_documents"] = 64
    dcfg["model"] = model
    dcfg["data"]["tokenizer"] = tokenizer
    dcfg["checkpoint"].update(load)
    try:
        cfg = to_train_config(dcfg)
    except OmegaConfBaseException as e:
        raise config_error(e) from e
    if not cfg.eval.tasks and cfg.training.eval_freq == 0:
        raise ConfigError(
            "nothing to evaluate: pass eval.tasks=[...] (and/or training.eval_freq=1 for the validation "
            "loss)."
        )
    return cfg


def evaluate(cfg: TrainConfig) -> dict[str, Any]:
    """Build the trainer on the loaded weights, score the tasks (and validation); the results."""
    from trainer.train import Trainer

    trainer = Trainer(cfg)
    try:
        results: dict[str, Any] = {
            "source": cfg.checkpoint.initial_load_path or cfg.checkpoint.initial_load_hf
        }
        if trainer.task_evaluator is not None:
            scored = trainer.evaluate_tasks()
            results["tasks"] = {name: r.metrics for name, r in scored.items()}
            results["samples"] = {name: r.details for name, r in scored.items()}
        if trainer.val_loader is not None:
            loss, tokens = trainer.evaluate()
            results["validation"] = {"loss": loss, "tokens": tokens}
            for name, (loader, steps) in trainer.named_val_loaders.items():
                loss, tokens = trainer.evaluate(loader, steps)
                results.setdefault("validation_sets", {})[name] = {"loss": loss, "tokens": tokens}
        if trainer.rank == 0:
            os.makedirs(cfg.job.dump_folder, exist_ok=True)
            with open(os.path.join(cfg.job.dump_folder, "eval_results.json"), "w", encoding="utf-8") as f:
                json.dump(results, f, indent=1)
        return results
    finally:
        trainer.close()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ("-h", "--help"):
        print(USAGE + "\n\n" + __doc__)
        return 0
    if not argv or argv[0].startswith("-") or "=" in argv[0]:
        print(f"error: the first argument is the folder to evaluate; {USAGE}", file=sys.stderr)
        return 2
    rank = os.environ.get("RANK", "0")
    try:
        cfg = build_config(argv[0], argv[1:])
        results = evaluate(cfg)
    except ConfigError as e:
        print(f"[rank{rank}] error: {e}", file=sys.stderr, flush=True)
        return 2
    if rank == "0":
        for name, metrics in results.get("tasks", {}).items():
            print(
                f"{name}: "
                + "  ".join(f"{k} {v:.4f}" if k != "examples" else f"{k} {v}" for k, v in metrics.items())
            )
        if "validation" in results:
            for name, v in {
                "validation": results["validation"],
                **results.get("validation_sets", {}),
            }.items():
                print(f"{name}: loss {v['loss']:.4f}  tokens {v['tokens']}")
        print(f"wrote {os.path.join(cfg.job.dump_folder, 'eval_results.json')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
