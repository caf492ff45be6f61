"""MoE experts in MXFP8 (``training.float8.experts=true``, parallelisms/float8.py): the stacked
experts' weights carry torchao's MXFP8 training wrapper, which intercepts ``torch._grouped_mm``;
the experts then always take the grouped-GEMM path with every expert's token group padded to 32
rows (``GroupedExperts.pad_token_groups``). On CPU the grouped GEMM runs in torchao's emulation.

- the padded dispatch returns exactly the unpadded one's rows in high precision (bf16: the padding
  rows are zeros, and each output row depends only on its own input row);
- the MoE debug model trains with MXFP8 experts; the header counts the converted experts; the losses
  differ from the run without float8 and from the run with MXFP8 dense linears only (the experts
  really run in MXFP8) by more than a floor and less than a ceiling;
- FSDP x2 and EP x2 match one process within the recipe; EP x2 against one process that runs the
  same tokens per expert GEMM (micro-batch 8 = EP's two ranks of 4), the experts' weights still
  wrapped on every rank;
- float8 (non-MX) experts are refused by name (no emulation of torchao's float8 grouped GEMM).
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from models.moe.experts import GroupedExperts
from tests.configs import NO_CLIP, tiny_config
from tests.parity import Case, GroupedRuns, assert_parity
from tests.trainer.test_float8 import _plan

pytest.importorskip("torchao")

LAYERS = 1
STEPS = 12
MOE = (
    "model=moe_debug",
    f"model.n_layers={LAYERS}",
    "training.micro_batch_size=4",
    f"training.steps={STEPS}",
)
MX = ("training.float8.enable=true", "training.float8.recipe=mxfp8")
EXPERTS = (*MX, "training.float8.experts=true")
PARITY = ("training.steps=4",)  # later overrides win over MOE's steps
RTOL = 2e-5  # FSDP x2 / EP x2 against one process, losses and pre-clip grad norms: measured 0 and 1.9e-6
# / 7.1e-8 and 2.1e-6. EP's reference takes micro-batch 8: an expert's weight gradient is one grouped
# GEMM over the tokens it receives, rounded to bf16 (torchao's output dtype) once per micro-batch; EP
# hands each expert both ranks' tokens in one GEMM, like one process with micro-batch 8, while one
# process with two accumulated micro-batches of 4 rounds twice (measured 6.9e-4 loss by step 4).
# Per-step loss relative to the reference run. Floor on the largest difference: the low-precision
# matmuls are really on; ceiling on every step: the same model trains.
FLOOR = 1e-4
CEILING = 3e-2


def _losses(run: dict) -> list[float]:
    return [r["loss"] for r in run["history"] if "loss" in r]


def _expert_weight_types(trainer) -> list[str]:
    """Setup hook: the classes of this rank's local expert weights (a module-level function: pickled)."""
    return sorted(
        {
            type(p.to_local() if hasattr(p, "to_local") else p).__name__
            for part in trainer.model_parts
            for name, p in part.named_parameters()
            if ".experts." in name
        }
    )


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> GroupedRuns:
    tmp = tmp_path_factory.mktemp("float8_experts")

    def case(name: str, *overrides: str) -> Case:
        return Case(1, tiny_config(str(tmp / name), *MOE, *overrides), params=False)

    def pair(name: str, *overrides: str, setup=None) -> Case:
        cfg = tiny_config(str(tmp / name), *MOE, *PARITY, *EXPERTS, "parallelism.dp_shard=2", *overrides)
        return Case(2, cfg, setup=setup, params=False)

    return GroupedRuns(
        {
            "fsdp": pair("fsdp"),
            "ep": pair("ep", "parallelism.ep=2", setup=_expert_weight_types),
            "single": case("single", *PARITY, *EXPERTS),
            "single_mb8": case("single_mb8", *PARITY, *EXPERTS, "training.micro_batch_size=8"),
            # EP x2 inside FSDP x4 (the experts FSDP-sharded over the other half): 2 sequences a rank,
            # an ep group's expert GEMM holds 4, as one process's micro-batch of 4; without clipping
            "ep_fsdp": Case(
                4,
                tiny_config(
                    str(tmp / "ep_fsdp"),
                    *MOE,
                    *PARITY,
                    *EXPERTS,
                    NO_CLIP,
                    "parallelism.dp_shard=4",
                    "parallelism.ep=2",
                    "training.micro_batch_size=2",
                ),
                setup=_expert_weight_types,
                params=False,
            ),
            "single_no_clip": case("single_no_clip", *PARITY, *EXPERTS, NO_CLIP),
            "off": case("off"),
            "dense": case("dense", *MX),
            "experts": case("experts", *EXPERTS),
        }
    )


def test_padded_groups_equal_unpadded() -> None:
    """bf16 grouped GEMM over groups padded to 32 rows (one empty group, one of a single row): the
    same output rows and input gradient bit for bit; weight gradients equal to bf16 rounding."""
    torch.manual_seed(0)
    counts = torch.tensor([5, 0, 17, 1])
    plain = GroupedExperts(4, 64, 96, grouped_mm="on").to(torch.bfloat16)
    for p in plain.parameters():
        torch.nn.init.normal_(p, std=0.1)
    padded = GroupedExperts(4, 64, 96, grouped_mm="on").to(torch.bfloat16)
    padded.load_state_dict(plain.state_dict())
    padded.pad_token_groups(32)
    x = torch.randn(int(counts.sum()), 64, dtype=torch.bfloat16)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    ya, yb = plain(xa, counts), padded(xb, counts)
    assert torch.equal(ya, yb)
    g = torch.randn_like(ya)
    ya.backward(g)
    yb.backward(g)
    assert xa.grad is not None and xb.grad is not None and torch.equal(xa.grad, xb.grad)
    for name in ("w1", "w2", "w3"):
        a, b = getattr(plain, name).grad, getattr(padded, name).grad
        torch.testing.assert_close(a, b, rtol=1e-2, atol=1e-3)


def test_mxfp8_experts_train_near_high_precision(runs: GroupedRuns) -> None:
    off, dense, got = runs.get("off"), runs.get("dense"), runs.get("experts")
    with open(
        os.path.join(runs.cases["experts"].cfg.job.dump_folder, "metrics.jsonl"), encoding="utf-8"
    ) as f:
        f8 = json.loads(f.readline())["header"]["float8"]
    assert f8["recipe"] == "mxfp8" and f8["emulate"] is True, f8
    assert f8["experts_converted"] == LAYERS and f8["experts"] == ["layers.0.moe.experts"], f8
    losses = _losses(got)
    assert len(losses) == STEPS and losses[-1] < losses[0] - 1.0, losses
    for ref_name, ref in (("no float8", _losses(off)), ("MXFP8 dense linears only", _losses(dense))):
        rel = [abs(a - b) / abs(a) for a, b in zip(ref, losses, strict=True)]
        print(
            f"MXFP8 experts vs {ref_name}: final loss {losses[-1]:.4f} vs {ref[-1]:.4f}; max per-step "
            f"relative difference {max(rel):.2e}, final {rel[-1]:.2e}"
        )
        assert max(rel) > FLOOR, f"within {max(rel):.1e} of {ref_name}: the experts are not in MXFP8"
        assert max(rel) < CEILING, f"{max(rel):.1e} away from {ref_name}"


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_float8_experts_refused_by_name(tmp_path, recipe: str) -> None:
    from models.errors import ConfigError

    with pytest.raises(
        ConfigError, match=f"training.float8.experts=true on cpu with training.float8.recipe={recipe}"
    ):
        _plan(
            str(tmp_path),
            1,
            "model=moe_debug",
            f"training.float8.recipe={recipe}",
            "training.float8.experts=true",
        )


def test_mxfp8_experts_plan_counts_experts(tmp_path) -> None:
    plan = _plan(str(tmp_path), 1, "model=moe_debug", *MX[1:], "training.float8.experts=true")
    assert plan is not None and plan.experts == ["layers.0.moe.experts", "layers.1.moe.experts"], plan


def test_fsdp_parity_within_mxfp8_experts(runs: GroupedRuns) -> None:
    """FSDP x2 (the experts sharded on dim 0 and all-gathered through torchao's wrapper) against one
    process, both with MXFP8 experts: losses and pre-clip grad norms within RTOL."""
    worst = assert_parity(runs.get("single")["history"], runs.get("fsdp")["history"], rtol=RTOL, label="fsdp")
    print(f"MXFP8 experts, FSDP x2 against one process: worst relative {worst}")


def test_ep_parity_within_mxfp8_experts(runs: GroupedRuns) -> None:
    """EP x2 (each rank owns 4 of the 8 experts, dispatch by all_to_all) against one process with the
    same tokens per expert GEMM (micro-batch 8), both with MXFP8 experts: losses and pre-clip grad
    norms within RTOL; every rank's local expert weights still carry torchao's MXFP8 wrapper (before
    the fix, expert parallel's sharding dropped it and the experts ran in high precision: 5.8e-3 loss
    by step 4)."""
    ep = runs.get("ep")
    assert ep["observed"] == [["MXFP8TrainingWeightWrapperTensor"]] * 2, ep["observed"]
    worst = assert_parity(runs.get("single_mb8")["history"], ep["history"], rtol=RTOL, label="ep")
    accumulated = max(
        abs(a - b) / abs(a) for a, b in zip(_losses(runs.get("single")), _losses(ep), strict=True)
    )
    print(
        f"MXFP8 experts, EP x2 against one process (micro-batch 8): worst relative {worst}; against one "
        f"process accumulating two micro-batches of 4: loss {accumulated:.1e}"
    )


def test_ep_fsdp_parity_within_mxfp8_experts(runs: GroupedRuns) -> None:
    """EP x2 x FSDP x2 on 4 ranks against one process with the same 4-sequence micro-batches, both
    with MXFP8 experts and without clipping: losses and pre-clip grad norms within RTOL. (With
    clipping, the clip coefficient carries the grad norm's fp32 reduction-order difference, ~1e-6,
    into every weight: measured, one expert weight element of 400k then rounds to the neighbouring
    e4m3 value in the next forward, and AdamW's first steps turn that hidden unit's changed gradient
    into a 1.3e-4 loss difference by step 4; without clipping the experts' weights stay bitwise.)"""
    got = runs.get("ep_fsdp")
    assert got["observed"] == [["MXFP8TrainingWeightWrapperTensor"]] * 4, got["observed"]
    worst = assert_parity(runs.get("single_no_clip")["history"], got["history"], rtol=RTOL, label="ep_fsdp")
    print(f"MXFP8 experts, EP x2 x FSDP x2 against one process: worst relative {worst}")
