"""Task scores and named validation sets in the loop reach metrics.jsonl and TensorBoard."""

from __future__ import annotations

import json
import os


def test_tasks_and_named_validation_are_logged(debug_run) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    records = [json.loads(line) for line in open(os.path.join(debug_run.folder, "metrics.jsonl"))]
    (tasks,) = [r for r in records if "tasks" in r]
    (named,) = [r for r in records if "validation" in r]
    (default,) = [r for r in records if "eval_loss" in r]
    assert tasks["step"] == named["step"] == default["step"] == 30 and tasks["tasks_time_s"] > 0
    assert set(tasks["tasks"]["next_line"]) == {"acc", "acc_norm", "acc_bytes", "examples"}
    assert set(tasks["tasks"]["complete_word"]) == {"exact_match", "examples"}
    assert tasks["tasks"]["next_line"]["examples"] == 6
    stdlib = named["validation"]["stdlib"]
    # The builtin set with the run's val_fraction and eval_steps is the run's own validation split.
    assert (stdlib["loss"], stdlib["tokens"]) == (default["eval_loss"], default["eval_tokens"])
    events = EventAccumulator(os.path.join(debug_run.folder, "tb"))
    events.Reload()
    scalars = set(events.Tags()["scalars"])
    assert {
        "tasks/next_line/acc_norm",
        "tasks/complete_word/exact_match",
        "validation/stdlib/loss",
        "validation/stdlib/perplexity",
        "eval_loss",
    } <= scalars
    (acc_norm,) = events.Scalars("tasks/next_line/acc_norm")
    assert acc_norm.step == 30 and abs(acc_norm.value - tasks["tasks"]["next_line"]["acc_norm"]) < 1e-6
