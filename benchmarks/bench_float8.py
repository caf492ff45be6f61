"""Float8 convergence on the built-in corpus: each recipe (emulated on CPU) against high precision.

    python benchmarks/bench_float8.py [--steps 300] [--out DIR] [--only fp32,tensorwise,...]
        [--set KEY=VALUE ...]

Trains the debug model (``+experiment=debug``, one process; ``--set`` for a smaller run) for
``--steps`` steps with the same seed, data order and schedule in: fp32 (the reference), bf16
autocast, each float8 recipe (``tensorwise``, ``rowwise``, ``rowwise_with_gw_hp``, ``mxfp8``), and
two tensorwise runs whose weight amax is never updated: ``frozen_scale`` keeps the initial weights'
amax (what a missing scale precompute after the optimizer step does to FSDP's float8 all-gather;
weights that outgrow it saturate at e4m3's 448), ``broken_scale`` an amax buffer never written (zero:
every weight saturates). It prints one JSON object: per run the final train loss (mean of the last
20 steps), the validation loss (``training.eval_steps`` batches) at the end, their ratios to fp32,
the mean step time and the emulation cost per step relative to fp32; and ``flagged``: the runs
whose final train or validation loss is more than ``--tolerance`` (default 2%) above fp32's. The
check passes when ``broken_scale`` is flagged and no recipe is (``frozen_scale`` is reported either
way). Emulation proves numerics, not speed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if sys.path[0] != REPO:
    sys.path.insert(0, REPO)

import torch  # noqa: E402
from torch import nn  # noqa: E402

RUNS: dict[str, tuple[str, ...]] = {
    "fp32": (),
    "bf16": ("training.mixed_precision=bf16",),
    "tensorwise": ("training.float8.enable=true", "training.float8.recipe=tensorwise"),
    "rowwise": ("training.float8.enable=true", "training.float8.recipe=rowwise"),
    "rowwise_with_gw_hp": ("training.float8.enable=true", "training.float8.recipe=rowwise_with_gw_hp"),
    "mxfp8": ("training.float8.enable=true", "training.float8.recipe=mxfp8"),
    "frozen_scale": ("training.float8.enable=true", "training.float8.recipe=tensorwise"),
    "broken_scale": ("training.float8.enable=true", "training.float8.recipe=tensorwise"),
}
BROKEN = ("frozen_scale", "broken_scale")  # the deliberate bugs; broken_scale must be flagged


def freeze_weight_scales(model: nn.Module, *, measured: bool) -> int:
    """The deliberate bugs: every Float8Linear casts its weight with a scale whose amax is never
    updated: the weight's initial amax (``measured``: ``frozen_scale``), or the amax buffer's initial
    zero, never written (``broken_scale``: the scale is e4m3's max over torchao's epsilon, so every
    weight saturates). Returns how many linears were frozen."""
    from torchao.float8.float8_linear import Float8Linear, matmul_with_hp_or_float8_args
    from torchao.float8.float8_training_tensor import GemmInputRole, hp_tensor_and_scale_to_float8
    from torchao.float8.float8_utils import tensor_to_scale

    frozen = 0
    for module in model.modules():
        if not isinstance(module, Float8Linear):
            continue
        dtype = module.config.cast_config_weight.target_dtype
        amax_of = module.weight.detach() if measured else torch.zeros_like(module.weight.detach())
        scale = tensor_to_scale(amax_of, dtype).clone()

        def forward(x: torch.Tensor, m: Float8Linear = module, s: torch.Tensor = scale) -> torch.Tensor:
            w_t = hp_tensor_and_scale_to_float8(
                m.weight.t(),
                s,
                m.config.cast_config_weight.target_dtype,
                m.linear_mm_config,
                GemmInputRole.WEIGHT,
            )
            return matmul_with_hp_or_float8_args.apply(x, w_t, m.linear_mm_config, m.config)

        module.forward = forward  # type: ignore[method-assign]
        frozen += 1
    return frozen


def run(name: str, overrides: tuple[str, ...], steps: int, out: str, extra: list[str]) -> dict[str, Any]:
    from tests.configs import make_config
    from trainer.train import Trainer

    folder = os.path.join(out, name)
    cfg = make_config(
        "+experiment=debug",
        f"training.steps={steps}",
        f"training.eval_freq={steps}",
        "training.device=cpu",
        "checkpoint.enable=false",
        "metrics.log_freq=1",
        "metrics.tensorboard=false",
        f"job.dump_folder={folder}",
        *extra,
        *overrides,
    )
    trainer = Trainer(cfg)
    if name in BROKEN:
        assert freeze_weight_scales(trainer.model_parts[0], measured=name == "frozen_scale") > 0
    start = time.perf_counter()
    history = trainer.train()
    seconds = time.perf_counter() - start
    trainer.close()
    losses = [r["loss"] for r in history if "loss" in r]
    evals = [r["eval_loss"] for r in history if "eval_loss" in r]
    return {
        "final_train_loss": statistics.fmean(losses[-20:]),
        "val_loss": evals[-1] if evals else None,
        "first_loss": losses[0],
        "step_s": seconds / steps,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--out", default=os.path.join("outputs", "bench_float8"))
    parser.add_argument("--only", default=",".join(RUNS))
    parser.add_argument("--tolerance", type=float, default=0.02)
    parser.add_argument(
        "--set", nargs="*", default=[], help="Hydra overrides for every run (a smaller model)"
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    names = ["fp32", *[n for n in args.only.split(",") if n != "fp32"]]
    results = {n: run(n, RUNS[n], args.steps, args.out, args.set) for n in names}
    ref = results["fp32"]
    flagged = []
    for name, r in results.items():
        r["train_vs_fp32"] = r["final_train_loss"] / ref["final_train_loss"]
        r["val_vs_fp32"] = r["val_loss"] / ref["val_loss"] if r["val_loss"] and ref["val_loss"] else None
        r["step_time_vs_fp32"] = r["step_s"] / ref["step_s"]
        worst = max(r["train_vs_fp32"], r["val_vs_fp32"] or 0.0)
        if worst > 1 + args.tolerance:
            flagged.append(name)
    passed = ("broken_scale" not in results or "broken_scale" in flagged) and all(
        n in (*BROKEN, "bf16") for n in flagged
    )
    summary = {"steps": args.steps, "set": args.set, "runs": results, "flagged": flagged, "passed": passed}
    print(json.dumps(summary, indent=1))
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
