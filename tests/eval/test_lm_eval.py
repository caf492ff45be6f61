"""Agreement with lm-evaluation-harness: ``lm_eval --model hf`` on our HF export (the folder the
running job wrote) and our in-loop scorer (``python -m trainer.evaluate`` on the DCP checkpoint of
the same step, i.e. ``Trainer.evaluate_tasks``) give the same per-example log-likelihoods, greedy
flags and acc / acc_norm / acc_bytes on a shipped task. The reference is lm-eval's own samples
file, written by the run in this test; everything is offline."""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("lm_eval", reason="lm-evaluation-harness (the dev extra) is not installed")

NUM_EXAMPLES = 16


@pytest.mark.slow
def test_lm_eval_harness_agrees_with_our_scorer(debug_run, tmp_path) -> None:
    from trainer.eval.convert import write_lm_eval_task
    from trainer.eval.tasks import resolve_task
    from trainer.evaluate import main as evaluate_main

    with open(resolve_task("next_line"), encoding="utf-8") as f:
        lines = f.readlines()[:NUM_EXAMPLES]
    task_file = tmp_path / "next_line.jsonl"
    task_file.write_text("".join(lines), encoding="utf-8")
    name = write_lm_eval_task(str(task_file), str(tmp_path / "lm_tasks"))

    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "HF_HOME": str(tmp_path / "hf_home"),
        "TOKENIZERS_PARALLELISM": "false",
    }
    subprocess.run(
        [
            sys.executable,
            "-m",
            "lm_eval",
            "--model",
            "hf",
            "--model_args",
            f"pretrained={debug_run.hf_from_run},add_bos_token=True,dtype=float32",
            "--tasks",
            name,
            "--include_path",
            str(tmp_path / "lm_tasks"),
            "--device",
            "cpu",
            "--batch_size",
            "8",
            "--log_samples",
            "--output_path",
            str(tmp_path / "lm_out"),
        ],
        check=True,
        env=env,
        cwd=tmp_path,
        capture_output=True,
        timeout=900,
    )
    (samples_file,) = glob.glob(str(tmp_path / "lm_out" / "*" / f"samples_{name}_*.jsonl"))
    theirs = sorted((json.loads(line) for line in open(samples_file)), key=lambda s: s["doc_id"])

    out = tmp_path / "ours"
    assert (
        evaluate_main(
            [
                debug_run.checkpoint,
                f"eval.tasks=[{task_file}]",
                "data.max_documents=40",
                f"job.dump_folder={out}",
            ]
        )
        == 0
    )
    ours = json.load(open(out / "eval_results.json"))
    details = ours["samples"]["next_line"]
    assert len(theirs) == len(details) == NUM_EXAMPLES
    worst = 0.0
    for sample in theirs:
        mine = details[sample["doc_id"]]
        lls = [float(ll) for ll, _ in sample["filtered_resps"]]
        worst = max(worst, *(abs(a - b) for a, b in zip(lls, mine["loglikelihoods"])))
        assert [g == "True" or g is True for _, g in sample["filtered_resps"]] == mine["is_greedy"]
        for metric in ("acc", "acc_norm", "acc_bytes"):
            assert sample[metric] == mine[metric], (sample["doc_id"], metric)
    aggregated = json.load(open(glob.glob(str(tmp_path / "lm_out" / "*" / "results_*.json"))[0]))["results"][
        name
    ]
    for metric in ("acc", "acc_norm", "acc_bytes"):
        assert aggregated[f"{metric},none"] == pytest.approx(ours["tasks"]["next_line"][metric], abs=1e-12)
    print(
        f"lm-eval vs ours on {NUM_EXAMPLES} examples x 4 choices: max |d loglik| {worst:.2e}; "
        f"acc {ours['tasks']['next_line']['acc']:.3f} acc_norm {ours['tasks']['next_line']['acc_norm']:.3f} "
        f"acc_bytes {ours['tasks']['next_line']['acc_bytes']:.3f} (equal)"
    )
    assert worst <= 1e-4
