"""The user-facing commands, run for real: ./launch.sh and torchrun with bad configs."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.configs import REPO

pytestmark = pytest.mark.slow


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = "1"
    env.pop("RANK", None)
    env.pop("WORLD_SIZE", None)
    return env


def _torchrun(nproc: int, *args: str, timeout: int = 240) -> subprocess.CompletedProcess:
    cmd = ["torchrun", "--standalone", f"--nproc_per_node={nproc}", "trainer/main.py", *args]
    return subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=timeout)


def test_launch_default_trains_and_leaves_run_folder(tmp_path) -> None:
    """./launch.sh (2 CPU ranks) trains with falling loss and writes config, metrics and TB events
    (8 steps: the loss falls from ~6.7 to ~4.3 by step 8 even inside the preset's 20-step warmup)."""
    dump = tmp_path / "run"
    env = _env() | {"NPROC": "2"}
    proc = subprocess.run(
        [
            "./launch.sh",
            "+experiment=debug",
            "training.steps=8",
            "metrics.log_freq=2",
            "training.eval_freq=4",
            "data.max_documents=300",
            f"job.dump_folder={dump}",
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert (dump / "config.yaml").is_file()
    assert (dump / "checkpoints" / "step-8" / "checkpoint.json").is_file(), (
        "the run must end with a checkpoint"
    )
    records = [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if "loss" in r]
    evals = [r for r in records if "eval_loss" in r]
    assert [r["step"] for r in train] == [1, 2, 4, 6, 8]
    assert len(evals) == 2
    for key in ("loss", "grad_norm", "lr", "tokens_per_sec", "tflops", "mfu", "memory_gib"):
        assert key in train[0]
    assert train[-1]["loss"] < train[0]["loss"] - 1.0, [r["loss"] for r in train]

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(dump / "tb"))
    acc.Reload()
    tb_loss = [(e.step, e.value) for e in acc.Scalars("loss")]
    assert [s for s, _ in tb_loss] == [r["step"] for r in train]
    assert all(abs(v - r["loss"]) < 1e-4 * max(1.0, abs(v)) for (_, v), r in zip(tb_loss, train))
    assert "eval_loss" in acc.Tags()["scalars"]


BAD_CONFIGS = [
    (("parallelism.tp=3",), "parallelism", "3"),
    (("training.global_batch_size=10",), "global_batch_size=10", "multiple of"),
    (("data=text", "data.path=/nonexistent/corpus"), "/nonexistent/corpus", ""),
    (("parallelism.dp_replicate=4", "parallelism.dp_shard=1"), "world size is 2", ""),
]


@pytest.mark.parametrize("overrides,needle,fix", BAD_CONFIGS)
def test_bad_config_fails_on_every_rank_before_collectives(tmp_path, overrides, needle, fix) -> None:
    dump = tmp_path / "run"
    proc = _torchrun(2, "+experiment=debug", f"job.dump_folder={dump}", *overrides)
    assert proc.returncode != 0
    for rank in (0, 1):
        lines = [ln for ln in proc.stderr.splitlines() if ln.startswith(f"[rank{rank}] config error:")]
        assert lines, proc.stderr[-3000:]
        assert needle in lines[0] and fix in lines[0], lines[0]
    assert not dump.exists(), "a failed config must leave no output behind"


# Bad arguments of every command (`grep -l '__name__ == "__main__"' trainer/*.py`): each exits with
# status 2 and a message naming the bad value, without a traceback. The cases of every command run
# in one process through each command's ``main(argv)``; one case per command also runs as the real
# command. Placeholders: {file} an existing file, {dir} an empty folder, {tmp} a fresh path.
SWEEP: dict[str, list[tuple[list[str], str]]] = {
    "trainer.main": [
        (["+experiment=nope"], "experiment=nope"),
        (["+experiment=debug", "model=no_such_model"], "model=no_such_model"),
        (["+experiment=debug", "training.no_such_key=1"], "no_such_key"),
        (["+experiment=debug", "+training.added_key=1"], "added_key"),  # '+' adds no key to a schema
        (["+experiment=debug", "training.steps=abc"], "training.steps=abc"),
        (["+experiment=debug", "training.steps=0"], "training.steps=0"),
        (["+experiment=debug", "training.seq_len=4096"], "training.seq_len=4096"),
        (["+experiment=debug", "optimizer.lr=-1"], "optimizer.lr=-1"),
        (["+experiment=debug", "job.dump_folder={file}"], "{file}"),
        (["+experiment=debug", "job.dump_folder=${{oops}}"], "oops"),
        (["experiment=debug"], "+experiment=debug"),
        (["+experiment=debug", "training.steps=[1"], "[1"),
        (["+experiment=debug", "--bogus"], "--bogus"),
    ],
    "trainer.plan": [
        (["+experiment=nope"], "experiment=nope"),
        (["+experiment=debug", "cluster=nope"], "cluster='nope'"),
        (["+experiment=debug", "cluster=cpu", "cluster.nodes=0"], "cluster.nodes=0"),
        (["+experiment=debug", "cluster.no_key=1"], "no_key"),
        (["+experiment=debug", "cluster.mfu=abc"], "cluster.mfu=abc"),
        (["+experiment=debug", "cluster.mfu=2"], "cluster.mfu=2"),
        (["+experiment=debug", "cluster=cpu", "cluster.nodes=1", "parallelism.tp=3"], "parallelism.tp=3"),
        (["+experiment=debug", "training.micro_batch_size=-2"], "micro_batch_size=-2"),
        (["+experiment=debug", "--jsn"], "--jsn"),
        (["--run={tmp}"], "{tmp}"),
    ],
    "trainer.prepare_data": [
        (["data=builtin", "out={file}"], "{file}"),
        (["data=builtin", "out={file}/shards"], "{file}/shards"),
        (["data=builtin"], "out=DIR"),
        (["data=builtin", "out={tmp}", "num_proc=0"], "num_proc=0"),
        (["data=builtin", "out={tmp}", "num_proc=abc"], "num_proc=abc"),
        (["data=builtin", "out={tmp}", "chunk_mb=-5"], "chunk_mb=-5"),
        (["data=nope", "out={tmp}"], "data=nope"),
        (["data=builtin", "data.no_key=1", "out={tmp}"], "no_key"),
        (["data=builtin", "data.val_fraction=2", "out={tmp}"], "data.val_fraction=2"),
        (["data=text", "data.path={tmp}/corpus", "out={tmp}"], "{tmp}/corpus"),
        (["data=builtin", "model.vocab_size=100", "out={tmp}"], "vocab_size=100"),
    ],
    "trainer.generate": [
        (["{tmp}"], "{tmp}"),
        (["{file}"], "{file}"),
        (["{dir}"], "{dir}"),
        (["{dir}", "--temperature", "-1"], "--temperature=-1"),
        (["{dir}", "--temperature", "nan"], "--temperature=nan"),
        (["{dir}", "--top-k", "-5"], "--top-k=-5"),
        (["{dir}", "--top-k", "abc"], "'abc'"),
        (["{dir}", "--max-new-tokens", "0"], "--max-new-tokens=0"),
        (["{dir}", "--num-samples", "0"], "--num-samples=0"),
        (["{dir}", "--device", "tpu"], "tpu"),
        ([], "path"),
    ],
    "trainer.export_hf": [
        (["{tmp}", "{tmp}-hf"], "{tmp}"),
        (["{file}", "{tmp}-hf"], "{file}"),
        (["{dir}", "{tmp}-hf"], "{dir}"),
        (["{dir}", "{file}"], "{file}"),
        (["{dir}", "{tmp}-hf", "--dtype", "float8"], "'float8'"),
        (["{dir}", "{tmp}-hf", "--max-shard-size", "abc"], "'abc'"),
        (["{dir}", "{tmp}-hf", "--max-shard-size", "0"], "'0'"),
    ],
}
# The case of each command that also runs as `python -m trainer.X`, and the one run as `python
# trainer/main.py`.
REAL = {
    "trainer.main": 0,
    "trainer.plan": 0,
    "trainer.prepare_data": 0,
    "trainer.generate": 3,
    "trainer.export_hf": 0,
}
SCRIPT_CASE = 1

# One process for every command's cases (an interpreter importing torch costs seconds on 2 cores).
_DRIVER = """
import contextlib, io, json, sys
results = {}
for cli, argvs in json.loads(sys.argv[1]).items():
    mod = __import__(cli, fromlist=["main"])
    results[cli] = []
    for argv in argvs:
        err = io.StringIO()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            try:
                code = mod.main(argv)
            except SystemExit as e:
                code = e.code
            except BaseException:
                import traceback; traceback.print_exc(file=err); code = "exception"
        results[cli].append({"code": code, "stderr": err.getvalue()})
print(json.dumps(results))
"""


def _fill(text: str, paths: dict[str, str]) -> str:
    return text.format(**paths)


def _start(cmd: list[str], cwd: str) -> subprocess.Popen:
    env = _env() | {"PYTHONPATH": str(REPO)}  # the drivers run elsewhere; the checkout need not be installed
    return subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.fixture(scope="module")
def sweep(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """All cases at once: ``results[(command, i)]`` (in-process, through ``main(argv)``),
    ``results["real:" + command]`` (``python -m command``) and ``results["script"]``
    (``python trainer/main.py``), each ``{"code", "stderr"}``; ``paths`` fill the placeholders."""
    tmp = tmp_path_factory.mktemp("sweep")
    paths = {"file": str(tmp / "a_file"), "dir": str(tmp / "empty"), "tmp": str(tmp / "missing")}
    (tmp / "a_file").write_text("not a folder")
    (tmp / "empty").mkdir()
    argvs = {cli: [[_fill(a, paths) for a in argv] for argv, _ in cases] for cli, cases in SWEEP.items()}
    procs = {"driver": _start([sys.executable, "-c", _DRIVER, json.dumps(argvs)], str(tmp))}
    for cli in SWEEP:
        procs[f"real:{cli}"] = _start([sys.executable, "-m", cli, *argvs[cli][REAL[cli]]], str(REPO))
    procs["script"] = _start(
        [sys.executable, "trainer/main.py", *argvs["trainer.main"][SCRIPT_CASE]], str(REPO)
    )
    results = {}
    for name, proc in procs.items():
        out, err = proc.communicate(timeout=240)
        if name == "driver":
            assert proc.returncode == 0, err[-3000:]
            for cli, per_case in json.loads(out.splitlines()[-1]).items():
                results.update({(cli, i): r for i, r in enumerate(per_case)})
        else:
            results[name] = {"code": proc.returncode, "stderr": err}
    return {"results": results, "paths": paths}


def _check(result: dict, needle: str) -> None:
    err = result["stderr"]
    assert result["code"] == 2, f"exit {result['code']}: {err[-3000:]}"
    assert "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert lines and needle in lines[-1], f"{needle!r} not in the last line of:\n{err}"
    if "usage:" not in err:  # argparse prints its usage, then one error line
        assert len(lines) == 1, f"one line expected:\n{err}"


@pytest.mark.parametrize("cli,index", [(cli, i) for cli, cases in SWEEP.items() for i in range(len(cases))])
def test_bad_argument_exits_2_with_one_line_naming_it(sweep, cli: str, index: int) -> None:
    argv, needle = SWEEP[cli][index]
    result = sweep["results"][(cli, index)]
    print(f"{cli} {' '.join(argv)}\n  -> {result['stderr'].strip().splitlines()[-1:]}")
    _check(result, _fill(needle, sweep["paths"]))


@pytest.mark.parametrize("name", ["script", *(f"real:{cli}" for cli in REAL)])
def test_bad_argument_of_the_real_command(sweep, name: str) -> None:
    cli = name.removeprefix("real:") if name != "script" else "trainer.main"
    needle = SWEEP[cli][REAL[cli] if name != "script" else SCRIPT_CASE][1]
    _check(sweep["results"][name], _fill(needle, sweep["paths"]))


def test_unknown_preset_line_lists_the_presets(sweep) -> None:
    """``model=no_such_model`` (through ``main(argv)`` and as ``python trainer/main.py``): the one
    line names the available presets, not the schemas. (The rank prefix under torchrun is checked
    on 2 ranks by test_bad_config_fails_on_every_rank_before_collectives.)"""
    for result in (sweep["results"][("trainer.main", SCRIPT_CASE)], sweep["results"]["script"]):
        (line,) = result["stderr"].strip().splitlines()
        assert line.startswith("[rank0] config error:"), line
        assert "model=no_such_model" in line and "available options: 1b, 38m, debug" in line, line
        assert "base_model" not in line, "the schemas are not presets"


def test_launch_two_nodes_without_slurm_matches_one_node(tmp_path) -> None:
    """NNODES=2 NODE_RANK=0|1 RDZV_ENDPOINT=localhost:PORT in two processes, as on two machines,
    gives the losses of one node with the same number of ranks (the one-node run: the same config
    on 2 ranks of the test harness, bitwise the same Trainer as under torchrun, 3 interpreters fewer)."""
    from tests.configs import TINY, tiny_config
    from tests.dist import free_port
    from tests.parity import Case, gather_cases

    deterministic = "training.deterministic=true"
    run = (*TINY, deterministic)
    endpoint = f"localhost:{free_port()}"
    nodes = [
        subprocess.Popen(
            ["./launch.sh", *run, f"job.dump_folder={tmp_path / 'two_nodes'}"],
            cwd=REPO,
            env=_env()
            | {
                "NNODES": "2",
                "NODE_RANK": str(r),
                "NPROC": "1",
                "RDZV_ENDPOINT": endpoint,
                "RDZV_ID": f"test-{os.getpid()}",
            },
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in (0, 1)
    ]
    one_node = tiny_config(str(tmp_path / "one_node"), deterministic)
    gather_cases({"one_node": Case(2, one_node, params=False)}, world=2)
    for node in nodes:
        out, _ = node.communicate(timeout=300)
        assert node.returncode == 0, out[-3000:]

    def losses(name: str) -> list[tuple[int, float]]:
        lines = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
        return [(r["step"], r["loss"]) for r in map(json.loads, lines) if "loss" in r]

    assert [s for s, _ in losses("one_node")] == list(range(1, 9))
    assert losses("two_nodes") == losses("one_node")
