"""``python -m trainer.evaluate`` for a finished run: one process on the DCP checkpoint against
torchrun on 2 ranks (FSDP, weights read sharded from the job's HF folder) give the same scores;
bad input exits 2 with a message naming the value. The converter turns rows of HellaSwag, ARC and
PIQA (their published field layouts) into task files with lm-evaluation-harness's prompts."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from tests.configs import REPO
from trainer.evaluate import main as evaluate_main


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    return {**env, "OMP_NUM_THREADS": "1", "PYTHONPATH": REPO}


@pytest.mark.slow
def test_evaluate_one_process_and_torchrun_fsdp_agree(debug_run, tmp_path) -> None:
    tasks = [
        "eval.tasks=[next_line,complete_word]",
        "eval.limit=8",
        "data.max_documents=300",
        "training.seq_len=64",
        "training.eval_freq=1",
    ]
    assert evaluate_main([debug_run.checkpoint, *tasks, f"job.dump_folder={tmp_path / 'one'}"]) == 0
    proc = subprocess.run(
        [
            "torchrun",
            "--standalone",
            "--nproc_per_node=2",
            "-m",
            "trainer.evaluate",
            debug_run.hf_from_run,
            *tasks,
            "parallelism.dp_shard=2",
            "training.micro_batch_size=2",
            f"job.dump_folder={tmp_path / 'fsdp'}",
        ],
        cwd=REPO,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "next_line: acc" in proc.stdout and "complete_word: exact_match" in proc.stdout
    one = json.load(open(tmp_path / "one" / "eval_results.json"))
    fsdp = json.load(open(tmp_path / "fsdp" / "eval_results.json"))
    assert one["tasks"] == fsdp["tasks"]
    worst = 0.0
    for name, details in one["samples"].items():
        for a, b in zip(details, fsdp["samples"][name]):
            for x, y in zip(
                a.get("loglikelihoods", [a.get("loglikelihood")]),
                b.get("loglikelihoods", [b.get("loglikelihood")]),
            ):
                worst = max(worst, abs(x - y) / abs(x))
    val_rel = abs(one["validation"]["loss"] - fsdp["validation"]["loss"]) / one["validation"]["loss"]
    print(
        f"trainer.evaluate 1 process (DCP) vs torchrun FSDP x 2 (HF folder): log-likelihoods {worst:.1e}, "
        f"validation loss {val_rel:.1e} relative; {one['tasks']}"
    )
    assert worst <= 1e-5 and val_rel <= 1e-5 and one["validation"]["tokens"] == fsdp["validation"]["tokens"]


def _bad_task(tmp_path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_evaluate_bad_input_exits_2(debug_run, tmp_path, capsys) -> None:
    ckpt = debug_run.checkpoint
    bad_gold = {"context": "a", "choices": ["b", "c"], "gold": 2}
    cases = [
        ([], "usage"),
        ([str(tmp_path / "nope"), "eval.tasks=[next_line]"], "does not exist"),
        ([str(tmp_path), "eval.tasks=[next_line]"], "neither a meshwright checkpoint"),
        ([ckpt, "model.dim=8"], "'model.dim=8': the model"),
        ([ckpt], "nothing to evaluate"),
        ([ckpt, "eval.tasks=[no_such_task]"], "eval.tasks entry 'no_such_task'"),
        (
            [ckpt, f"eval.tasks=[{_bad_task(tmp_path, 'bad.jsonl', '{not json')}]"],
            "bad.jsonl:1: not a JSON object",
        ),
        (
            [
                ckpt,
                f"eval.tasks=[{_bad_task(tmp_path, 'gold.jsonl', json.dumps(bad_gold))}]",
            ],
            "'gold' must be the index",
        ),
        ([ckpt, "eval.tasks=[next_line]", "eval.batch_size=0"], "eval.batch_size=0"),
        (
            [ckpt, "eval.tasks=[next_line]", "+eval.validation.x={source:json}"],
            "eval.validation.x.source=json needs a path",
        ),
        ([ckpt, "eval.tasks=[next_line]", "+eval.validation.x={sorce:builtin}"], "eval.validation.x"),
        ([ckpt, "eval.tasks=[next_line]", "eval.nope=1"], "nope"),
    ]
    for argv, needle in cases:
        assert evaluate_main(argv) == 2, argv
        err = capsys.readouterr().err
        assert needle in err, (argv, err)
        if argv:
            assert len(err.strip().splitlines()) == 1, err


def test_convert_public_sets(tmp_path) -> None:
    from trainer.eval.convert import main as convert_main
    from trainer.eval.tasks import load_task

    rows = {
        "hellaswag": {
            "ctx_a": "A man is sitting on a roof.",
            "ctx_b": "he",
            "activity_label": "Roof shingle removal",
            "endings": [
                "is using wrap to wrap a pair of skis.",
                "is ripping level tiles off. [title] Go.",
                "is holding a rubik's cube.",
                "starts pulling up roofing on a roof.",
            ],
            "label": "3",
        },
        "arc": {
            "question": {
                "stem": "Which gas do plants take in?",
                "choices": [{"text": "oxygen", "label": "A"}, {"text": "carbon dioxide", "label": "B"}],
            },
            "answerKey": "B",
        },
        "piqa": {"goal": "To open a jar,", "sol1": "twist the lid.", "sol2": "paint the lid.", "label": 0},
    }
    for kind, row in rows.items():
        src = tmp_path / f"{kind}_in.jsonl"
        src.write_text(json.dumps(row) + "\n")
        assert convert_main([kind, str(src), str(tmp_path / f"{kind}.jsonl")]) == 0
        (ex,) = load_task(str(tmp_path / f"{kind}.jsonl")).examples
        assert ex.delimiter == " "
        if kind == "hellaswag":
            assert ex.context == "Roof shingle removal: A man is sitting on a roof. He" and ex.gold == 3
            assert ex.choices[1] == "is ripping level tiles off.. Go."
        elif kind == "arc":
            assert ex.context == "Question: Which gas do plants take in?\nAnswer:" and ex.gold == 1
        else:
            assert ex.choices == ("twist the lid.", "paint the lid.") and ex.gold == 0
    assert convert_main(["piqa", str(tmp_path / "arc_in.jsonl"), str(tmp_path / "x.jsonl")]) == 2
    assert convert_main(["lm-eval-yaml", str(tmp_path / "piqa.jsonl"), str(tmp_path / "yaml")]) == 0
    assert 'target_delimiter: " "' in (tmp_path / "yaml" / "meshwright_piqa.yaml").read_text()
