"""Every preset of ``configs/experiment/`` rehearsed at its intended world size, as one table.

    python -m benchmarks.rehearse_presets [--full] [--steps=N] [PRESET ...]

Each preset runs ``python -m trainer.rehearse +experiment=NAME --json --report-only`` on its default
ranks; a row gives the world size, the ranks rehearsed, the wall time, the peak memory per rank
(rehearsed / planned), the communication bytes per step per mesh axis (rehearsed / planned), the
step's FLOPs, the checkpoint bytes per rank and the worst checked term. Without ``--full`` the
large presets run with the suite's reductions (``SUITE``: fewer blocks, fewer microbatches; the
planner plans the same overrides), as ``tests/trainer/test_rehearse_presets.py`` does.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys
import time
from typing import Any

from trainer import rehearse
from trainer.config import CONFIG_DIR

# preset -> the overrides that keep its rehearsal within seconds per rank (the suite's sizes)
SUITE: dict[str, list[str]] = {
    "debug": ["model.n_layers=2", "training.global_batch_size=8"],
    "debug_cp": ["model.n_layers=2", "training.global_batch_size=4"],
    "debug_tp": ["model.n_layers=2", "training.global_batch_size=8"],
    "qwen3_debug": ["model.n_layers=2", "training.global_batch_size=8"],
    "deepseek_v3_debug": ["model.n_layers=2", "training.global_batch_size=8"],
    "moe_debug_ep": ["model.n_layers=1"],
    "38m_ddp": ["model.n_layers=2"],
    "7b_fsdp": ["model.n_layers=2"],
    "7b_hsdp": ["model.n_layers=2"],
    "70b_tp_fsdp": ["model.n_layers=1", "training.global_batch_size=8"],
    "llama3_8b_128k_cp": ["model.n_layers=1"],
    "qwen3_30b_a3b_ep": ["model.n_layers=1"],
    "qwen3_5_debug": ["training.global_batch_size=8"],  # all 4 blocks: 3 Gated DeltaNet + 1 attention
    "qwen3_5_35b_a3b_ep": ["model.n_layers=1"],  # one Gated DeltaNet block with its MoE
    "debug_pp": [],
    # pipeline presets: one block per virtual stage, the fewest microbatches the schedule allows (one per
    # pipeline rank); the first rank of the first stage and the last of the last (all four default
    # ranks: test_rehearse_pp.py and the README)
    "405b_4d": ["model.n_layers=32", "training.global_batch_size=128", "--ranks=0,1023"],
    "deepseek_v3_ep_pp": ["model.n_layers=16", "training.global_batch_size=2048", "--ranks=0,2047"],
}


def presets() -> list[str]:
    folder = os.path.join(CONFIG_DIR, "experiment")
    return sorted(f[:-5] for f in os.listdir(folder) if f.endswith(".yaml"))


def rehearse_preset(preset: str, overrides: list[str], steps: int = 1) -> tuple[int, dict[str, Any], float]:
    """(exit code, the JSON report, wall seconds) of one preset's rehearsal on its default ranks."""
    out, err = io.StringIO(), io.StringIO()
    start = time.perf_counter()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = rehearse.main(
            [f"+experiment={preset}", *overrides, f"--steps={steps}", "--json", "--report-only"]
        )
    text = out.getvalue()
    report = json.loads(text) if text.strip().startswith("{") else {"error": err.getvalue().strip()}
    return rc, report, time.perf_counter() - start


def _gb(x: float) -> str:
    return f"{x / 1e9:.2f}"


def table_row(preset: str, overrides: list[str], rc: int, report: dict[str, Any], wall: float) -> str:
    """One markdown row: the first rehearsed rank's figures, the worst checked ratio over all ranks."""
    if rc != 0 or not report.get("ranks"):
        why = report.get("error", "").splitlines()[-1:] or [f"exit {rc}"]
        return f"| {preset} | | | | | | | | refused or failed: {why[0][:120]} |"
    ranks = report["ranks"]
    rows = {r["what"]: r for r in ranks[0]["rows"]}
    peak = rows["peak: total"]
    comm: dict[str, list[float]] = {}
    for r in ranks[0]["rows"]:
        if r["kind"] == "comm" and r["what"].endswith(" bytes"):
            axis = r["what"].split()[1]
            slot = comm.setdefault(axis, [0.0, 0.0])
            slot[0] += r["rehearsed"]
            slot[1] += r["planned"]
    comm_text = ", ".join(f"{a} {_gb(v[0])}/{_gb(v[1])}" for a, v in sorted(comm.items()) if max(v) >= 1e6)
    flops = rows["FLOPs executed"]
    ckpt = rows.get("checkpoint bytes")
    checked = [r for rep in ranks for r in rep["rows"] if r["checked"]]
    worst = max(checked, key=lambda r: abs(r["ratio"] - 1))
    size = " ".join(overrides) or "full size"
    return (
        f"| {preset} ({size}) | {ranks[0]['world_size']} | {','.join(str(r['rank']) for r in ranks)} "
        f"| {wall:.0f} | {_gb(peak['rehearsed'])} / {_gb(peak['planned'])} ({peak['ratio']:.2f}) "
        f"| {comm_text} | {flops['rehearsed'] / 1e12:.2f} T ({flops['ratio']:.3f}) "
        f"| {_gb(ckpt['rehearsed']) if ckpt else '-'} | {worst['what']} {worst['ratio']:.3f} |"
    )


HEADER = (
    "| preset | world | ranks | wall s | peak GB/rank rehearsed / planned | comm GB/step per axis "
    "rehearsed/planned | FLOPs/rank/step (ratio) | checkpoint GB/rank | worst checked term |\n"
    "|---|---|---|---|---|---|---|---|---|"
)


def main(argv: list[str]) -> int:
    full = "--full" in argv
    steps = next((int(a.split("=", 1)[1]) for a in argv if a.startswith("--steps=")), 1)
    names = [a for a in argv if not a.startswith("--")] or presets()
    print(HEADER, flush=True)
    for name in names:
        overrides = [] if full else SUITE.get(name, [])
        rc, report, wall = rehearse_preset(name, overrides, steps)
        print(table_row(name, overrides, rc, report, wall), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
