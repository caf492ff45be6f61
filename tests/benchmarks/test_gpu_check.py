"""benchmarks/gpu_check.py on a CPU machine: argument handling, the no-CUDA refusal, the dry-run
listing, the child-process protocol (a failing part, a part past its timeout), the summary and its
schema, the trainer overrides (composed by Hydra and planned by ``trainer.plan``), the metrics of a
real run, and the numerics checks torch runs on CPU (FlexAttention forward, grouped GEMM in fp32,
fused AdamW, KV-cache generation)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import torch

from benchmarks import gpu_check as gc
from benchmarks import gpu_probes
from tests.configs import REPO

SCRIPT = os.path.join(REPO, "benchmarks", "gpu_check.py")
CPU = torch.device("cpu")


def _script(*args: str, timeout: int = 120) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run(
        [sys.executable, SCRIPT, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout
    )


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--gpus", "0"], "--gpus=0 must be >= 1"),
        (["--micro-batch", "0"], "--micro-batch=0 must be >= 1"),
        (["--only", "train_1b_eager,bogus"], "unknown part(s) ['bogus']"),
        (["--only", ","], "unknown part(s) []"),
        (["--gpus", "two"], "invalid int value: 'two'"),
        (["--bogus"], "unrecognized arguments: --bogus"),
    ],
)
def test_bad_arguments_exit_2_naming_them(argv: list[str], message: str, capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        gc.parse_args(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_out_that_is_a_file_is_refused(tmp_path, capsys) -> None:
    (tmp_path / "f").write_text("x")
    with pytest.raises(SystemExit) as exc:
        gc.parse_args(["--out", str(tmp_path / "f")])
    assert exc.value.code == 2 and "is a file; pass a folder" in capsys.readouterr().err


def test_only_adds_the_reference_of_a_layout() -> None:
    args = gc.parse_args(["--only", "parity_ep2,train_1b_eager"])
    assert args.only == ["train_1b_eager", "parity_moe_reference", "parity_ep2"]
    assert os.path.isabs(args.out)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
def test_no_cuda_refusal_and_dry_run(tmp_path) -> None:
    """Without CUDA the command says so and exits 2, writing nothing; --dry-run lists every part
    and the exact trainer commands (here as for 2 GPUs) and exits 0."""
    out = tmp_path / "out"
    proc = _script("--quick", "--out", str(out))
    assert proc.returncode == 2, proc.stderr
    assert "no CUDA device here" in proc.stderr and "--dry-run" in proc.stderr
    assert "proves numerics, not speed" in proc.stderr
    assert proc.stdout == "" and not out.exists()

    proc = _script("--dry-run", "--gpus", "2", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    listing = proc.stdout
    print(listing)
    for name in (*gc.PART_NAMES, *gc.DERIVED):
        assert f"- {name}" in listing, name
    assert "skip" not in listing  # 2 GPUs: every part runs
    assert "python trainer/main.py model=1b training.seq_len=2048" in listing
    assert "training.compile=true" in listing and "profiling.memory_snapshot=true" in listing
    assert "--nproc_per_node=2 trainer/main.py" in listing and "parallelism.cp_impl=ring" in listing
    assert "parallelism.ep=2" in listing and "tolerances:" in listing and not out.exists()
    assert "training.float8.recipe=rowwise training.float8.experts=true" in listing  # the moe_experts part
    assert "training.float8.recipe=mxfp8 training.float8.experts=true" in listing

    one = gc.dry_run_listing(gc.parse_args(["--dry-run", "--gpus", "1"]), 1)
    assert "- parity_tp2: " in one and "skip (needs 2+ GPUs, 1 in use)" in one


def test_help_says_how_to_bring_hydra() -> None:
    proc = _script("--help")
    assert proc.returncode == 0
    assert "pip wheel -w wheels" in proc.stdout and "--no-index --find-links wheels" in proc.stdout


def _args(tmp_path, **kw) -> object:
    args = gc.parse_args(["--out", str(tmp_path)])
    args.gpus = 1
    for k, v in kw.items():
        setattr(args, k, v)
    for sub in ("parts", "logs", "runs"):
        os.makedirs(os.path.join(args.out, sub), exist_ok=True)
    return args


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks how a part fails where CUDA is missing")
def test_child_part_failure_and_timeout_are_reported(tmp_path) -> None:
    """A part runs in its own process: an exception there becomes a ``fail`` with the reason and
    the log; a part past its timeout is stopped and reported as timed out."""
    args = _args(tmp_path)
    part = next(p for p in gc.PARTS if p.name == "numerics_adamw")
    result = gc.run_part_child(part, args)
    print(result["reason"])
    assert result["status"] == "fail" and "CUDA" in result["reason"], result
    assert os.path.isfile(result["log"]) and result["wall_s"] > 0

    slow = gc.Part("generation_kv_cache", "", "probe", 1, timeout_s=1, quick_timeout_s=1)
    result = gc.run_part_child(slow, args)
    assert result["status"] == "fail" and result["reason"].startswith("timed out after 1 s"), result


def _results(eager_losses: list[float], compiled_losses: list[float], tp_losses: list[float]) -> dict:
    """Part results as the children write them, without running anything."""
    env = {"gpu_count": 2, "gpu_name": "NVIDIA H100 80GB HBM3", "matmul_bf16_tflops": 700.0}
    train = {
        "tokens_per_sec": 40000.0,
        "tflops": 330.0,
        "mfu_pct_datasheet": 33.4,
        "peak_memory_gib": 28.0,
        "planned_memory_gib": 30.1,
        "memory_over_plan": 0.93,
        "first_loss": 11.8,
        "last_loss": 5.0,
    }
    ref = [6.6, 5.9, 5.1, 4.4]
    norms = [3.4, 2.6, 2.1, 1.9]
    ok = {"status": "pass", "reason": None, "wall_s": 10.0}
    art = {
        "profile_trace": "/o/runs/train_1b_eager/profile/step-25/rank0.trace.json",
        "profile_trace_bytes": 9,
        "memory_snapshot": "/o/m.pickle",
        "memory_snapshot_bytes": 5,
        "top_ops": "/o/t.txt",
        "top_ops_bytes": 3,
    }
    return {
        "environment": {**ok, "numbers": env},
        "numerics_adamw": {**ok, "numbers": {"max_rel_err": 1e-7, "fused_vs_foreach": float("nan")}},
        "train_1b_eager": {**ok, "numbers": {**train, "losses": eager_losses}, "artifacts": art},
        "train_1b_compiled": {**ok, "numbers": {**train, "losses": compiled_losses}},
        "parity_reference": {**ok, "numbers": {"losses": ref, "grad_norms": norms}},
        "parity_fsdp": {**ok, "numbers": {"losses": [x * 1.001 for x in ref], "grad_norms": norms}},
        "parity_tp2": {**ok, "numbers": {"losses": tp_losses, "grad_norms": norms}},
        "parity_cp2_ring": {"status": "fail", "reason": "trainer exited with status 1", "wall_s": 3.0},
        "parity_ep2": {**ok, "numbers": {"losses": ref, "grad_norms": norms}},
    }


def test_summary_from_part_results_follows_the_schema(tmp_path) -> None:
    results = _results([11.8, 9.0, 5.0], [11.81, 9.02, 5.01], [6.6, 5.9, 5.9, 4.4])
    summary = gc.build_summary(
        results, quick=True, out=str(tmp_path), gpus=2, started_utc="2026-01-01T00:00:00Z", wall_s=100.0
    )
    gc.validate_summary(summary)
    json.dumps(summary, allow_nan=False)  # strict JSON: the NaN below became "nan"
    assert {p["name"]: p for p in summary["parts"]}["numerics_adamw"]["numbers"]["fused_vs_foreach"] == "nan"
    parts = {p["name"]: p for p in summary["parts"]}
    print(json.dumps({k: (v["status"], v["reason"]) for k, v in parts.items()}, indent=1))
    assert [p["name"] for p in summary["parts"]][:3] == ["environment", "numerics_adamw", "train_1b_eager"]
    assert parts["train_1b_eager"]["numbers"]["mfu_pct_measured_matmul"] == pytest.approx(100 * 330 / 700)
    assert parts["numerics_compile_vs_eager"]["status"] == "pass"
    assert parts["numerics_compile_vs_eager"]["numbers"]["max_rel"] == pytest.approx(0.02 / 9.0)
    assert parts["profiler_and_memory_snapshot"]["status"] == "pass"
    assert parts["parity_fsdp"]["status"] == "pass"
    assert parts["parity_fsdp"]["numbers"]["loss_vs_reference"]["max_rel"] == pytest.approx(1e-3)
    assert parts["parity_tp2"]["status"] == "fail" and "at step 3" in parts["parity_tp2"]["reason"]
    assert parts["parity_cp2_ring"]["status"] == "fail"  # its own failure stays
    assert (
        parts["parity_ep2"]["status"] == "fail"
        and "parity_moe_reference was not run" in parts["parity_ep2"]["reason"]
    )
    assert summary["counts"] == {"pass": 8, "fail": 3, "skip": 0} and summary["ok"] is False
    assert summary["environment"]["gpu_name"].startswith("NVIDIA") and summary["tolerances"] == gc.TOLERANCES

    diverged = gc.build_summary(
        _results([11.8, 9.0, 5.0], [11.8, 9.9, 5.0], [6.6, 5.9, 5.1, 4.4]),
        quick=False,
        out="o",
        gpus=2,
        started_utc="t",
        wall_s=1.0,
    )
    cmp = {p["name"]: p for p in diverged["parts"]}["numerics_compile_vs_eager"]
    assert cmp["status"] == "fail" and "at step 2" in cmp["reason"]


def test_schema_validator_names_what_is_wrong() -> None:
    good = gc.build_summary(
        {"environment": {"status": "pass", "reason": None, "numbers": {}, "wall_s": 1.0}},
        quick=False,
        out="o",
        gpus=1,
        started_utc="t",
        wall_s=1.0,
    )
    gc.validate_summary(good)
    assert good["ok"] is True and good["counts"] == {"pass": 1, "fail": 0, "skip": 0}
    cases = {
        "missing key 'tolerances'": lambda s: s.pop("tolerances"),
        "'gpus_used' is bool": lambda s: s.update(gpus_used=True),
        "status='broken'": lambda s: s["parts"][0].update(status="broken"),
        "is fail without a reason": lambda s: s["parts"][0].update(status="fail"),
        "is not a known part": lambda s: s["parts"][0].update(name="nope"),
        "counts": lambda s: s.update(counts={"pass": 2, "fail": 0, "skip": 0}),
        "ok does not match": lambda s: s.update(ok=False),
    }
    for message, breaks in cases.items():
        bad = json.loads(json.dumps(good))
        breaks(bad)
        with pytest.raises(ValueError, match="summary does not follow") as exc:
            gc.validate_summary(bad)
        assert message in str(exc.value), (message, str(exc.value))


def test_trainer_overrides_compose_and_plan() -> None:
    """Every command's overrides are real config keys (Hydra composes them); the 1B run's planned
    memory is what ``python -m trainer.plan`` says for that config."""
    from trainer.config import compose_dict

    for part in gc.PARTS:
        if part.kind == "train":
            compose_dict(*gc.train_overrides(part.name, "o", False, 4))
        elif part.kind == "parity":
            compose_dict(*gc.parity_overrides(part.name, "o", True, 4)[1])
        elif part.kind == "moe":
            for variant in gc.MOE_VARIANTS:
                compose_dict(*gc.moe_overrides(variant, "o", True))
    assert gc.parity_overrides("parity_fsdp", "o", True, 3)[0] == 3
    assert "training.global_batch_size=48" in gc.parity_overrides("parity_tp2", "o", True, 3)[1]  # lcm(16, 6)
    planned = gc.planned_memory_gib(gc.train_overrides("train_1b_eager", "o", True, 4))
    print(f"planned per-GPU memory, 1B bf16 seq 2048 micro 4: {planned:.2f} GiB")
    assert 30 < planned < 50  # the measured activation model: 40.8 GiB (the `34 H` rule gave 30.1)


def test_metrics_of_a_real_run(tmp_path) -> None:
    """read_metrics / summarize_training on the metrics.jsonl a real trainer/main.py run writes."""
    from tests.configs import TINY

    dump = tmp_path / "run"
    cmd = gc.trainer_command(1, [*TINY, "training.steps=4", "training.device=cpu", f"job.dump_folder={dump}"])
    proc = subprocess.run(
        cmd, cwd=REPO, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    records = gc.read_metrics(str(dump))
    s = gc.summarize_training(records, warmup=1, exclude=(3,))
    print({k: v for k, v in s.items() if k != "losses"})
    assert s["steps"] == 4 and s["timed_steps"] == [2, 4]
    assert s["tokens_per_sec"] > 0 and s["tflops"] > 0 and s["peak_memory_gib"] > 0
    assert s["mfu_pct_datasheet"] is None  # no datasheet peak for a CPU
    assert s["losses"] == [r["loss"] for r in records] and s["last_loss"] < s["first_loss"]
    with pytest.raises(gc.PartFailure, match="no training records"):
        gc.summarize_training(gc.read_metrics(str(tmp_path / "missing")), warmup=1)


def test_moe_experts_part_on_cpu(tmp_path, monkeypatch) -> None:
    """The ``moe_experts`` part with real trainer runs, on CPU: its shapes cut to the tiny MoE run (one
    layer, 4 steps, fp32) and MXFP8 experts emulated, so bf16 (here fp32) and mxfp8 run and are compared
    (tokens/s ratio, per-step loss difference within the tolerance); float8 rowwise is reported
    ``unsupported`` with the reason the part was given (on a GPU: ``moe_unsupported``)."""
    from tests.configs import TINY

    def tiny(variant: str, folder: str, quick: bool) -> list[str]:
        moe = ("model=moe_debug", "model.n_layers=1", "training.micro_batch_size=4", "training.steps=4")
        return [*TINY, *moe, "training.device=cpu", f"job.dump_folder={folder}", *gc.MOE_VARIANTS[variant]]

    monkeypatch.setattr(gc, "moe_overrides", tiny)
    monkeypatch.setattr(gc, "moe_steps", lambda quick: (4, 1))
    reason = "torchao's float8 grouped GEMM needs CUDA SM90/SM100"
    monkeypatch.setattr(
        gc, "moe_unsupported", lambda variant: reason if variant == "float8_rowwise" else None
    )
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    args = _args(tmp_path, quick=True, deadline=time.monotonic() + 300)
    numbers = gc.part_moe_experts(args)["numbers"]
    print(json.dumps({k: v.get("loss_vs_bf16", v) for k, v in numbers.items() if isinstance(v, dict)}))
    assert numbers["float8_rowwise"] == {"status": "unsupported", "reason": reason}
    assert numbers["bf16"]["status"] == "pass" and numbers["bf16"]["steps"] == 4
    mx = numbers["mxfp8"]
    assert mx["status"] == "pass" and mx["tokens_per_sec_vs_bf16"] > 0
    assert 0 < mx["loss_vs_bf16"]["max_rel"] <= gc.TOLERANCES["moe_experts_loss_rel"], mx["loss_vs_bf16"]


def test_numerics_checks_on_cpu(monkeypatch) -> None:
    """The numerics functions with device=cpu in fp32, where torch runs them: FlexAttention's
    forward (eager) vs SDPA with the dense block-causal mask, grouped GEMM vs padded experts
    (forward and backward), fused vs foreach AdamW, KV-cache generation."""
    flex = gpu_probes.check_flex_attention(
        CPU,
        dtype=torch.float32,
        batch=2,
        seq_len=256,
        n_heads=4,
        n_kv_heads=2,
        head_dim=32,
        backward=False,
        compiled=False,
    )
    assert flex["shape"]["documents_per_window"] >= 4 and flex["max_rel_err"] < 1e-5, flex

    calls = []
    grouped_mm = torch._grouped_mm
    monkeypatch.setattr(torch, "_grouped_mm", lambda *a, **k: calls.append(1) or grouped_mm(*a, **k))
    experts = gpu_probes.check_grouped_experts(CPU, dtype=torch.float32, dim=64, hidden_dim=128, tokens=256)
    assert calls and 0 in experts["counts"] and experts["max_rel_err"] < 1e-5, experts

    adamw = gpu_probes.check_adamw(CPU, steps=3)
    assert adamw["relative_update"] > 1e-4 and adamw["max_rel_err"] < 1e-5, adamw

    gen = gpu_probes.generation_speed(
        CPU, preset="debug", dtype=torch.float32, prompt_len=16, new_tokens=8, compare_tokens=4
    )
    assert gen["greedy_match_without_cache"] and gen["decode_tokens_per_s"] > 0, gen
    env = gpu_probes.environment()
    assert env["torch"] == torch.__version__ and env["missing_for_training"] == []
    print(
        json.dumps(
            {
                "flex": flex["max_rel_err"],
                "grouped": experts["max_rel_err"],
                "adamw": adamw,
                "generation_tok_s": gen["decode_tokens_per_s"],
            }
        )
    )


_WITHOUT_HYDRA = """
import json, sys
sys.modules["hydra"] = sys.modules["omegaconf"] = None  # as on a machine without them
from benchmarks import gpu_check as gc, gpu_probes as gp
import torch
args = gc.parse_args(["--out", sys.argv[1]])
args.gpus, args.deadline = 2, 0
failures = {}
for part in gc.PARTS:
    if part.kind != "probe":
        try:
            gc.run_part_kind(args, part)
        except gc.PartFailure as e:
            failures[part.name] = str(e)
adamw = gp.check_adamw(torch.device("cpu"), steps=2)["max_rel_err"]
print(json.dumps({"missing": gp.environment()["missing_for_training"], "failures": failures, "adamw": adamw}))
"""


def test_runs_without_hydra(tmp_path) -> None:
    """Where hydra-core and omegaconf are missing the script still imports, the probes run, and
    every training part fails at once with the reason (before any trainer command starts)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO)
    proc = subprocess.run(
        [sys.executable, "-c", _WITHOUT_HYDRA, str(tmp_path)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.splitlines()[-1])
    assert out["missing"] == ["hydra", "omegaconf"] and out["adamw"] < 1e-5
    expected = [p.name for p in gc.PARTS if p.kind != "probe"]
    assert sorted(out["failures"]) == sorted(expected)
    for reason in out["failures"].values():
        assert reason.startswith("hydra, omegaconf not installed") and "--help" in reason, reason
    assert not os.listdir(tmp_path)  # no run folder was started
