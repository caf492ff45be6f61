"""MoE experts in float8 rowwise (``training.float8.recipe=rowwise`` with ``experts=true``,
parallelisms/float8.py): torchao's float8 grouped GEMM (``_Float8GroupedMM``) over expert token
groups padded to 16 rows.

torchao's float8 grouped GEMM runs only as Triton kernels (scale-and-cast) and
``torch._scaled_grouped_mm`` (CUDA SM90/SM100); it has no emulation. These tests run torchao's own
autograd function and weight wrapper on CPU with exactly those CUDA-only pieces replaced by
pure-torch reference implementations (``reference_kernels``: absmax -> power-of-two scale ->
saturated float8 cast, as the kernels' docstrings define them; the scaled grouped GEMM as dequantize
then fp32 matmul per group, bf16 out). So they prove our wiring (conversion, padding, dtypes, the
trainer) and the recipe's numerics, not the real kernels: those run only on a GPU
(``benchmarks/gpu_check.py``'s ``moe_experts_float8`` part).

- the converted experts go through torchao's float8 grouped GEMM (the reference kernels are called,
  every group a multiple of 16 rows) and padding rows give zero outputs and zero input gradients;
- the MoE debug model trains with float8 experts; the losses differ from the run without float8 and
  from the run with float8 dense linears only by more than a floor and less than a ceiling;
- FSDP x2 and TP x2 match one process, and so does EP x2 (one process at micro-batch 8, as for MXFP8 in
  test_float8_experts.py; every rank's experts keep torchao's wrapper) and EP x2 x FSDP x2 (4 ranks,
  without clipping); a run resumed from a checkpoint repeats its steps bit for bit (the checkpoint holds
  plain tensors, not torchao's wrapper; float8 rowwise and MXFP8 experts); the EP x2 x FSDP x2 run's
  checkpoint resumes bitwise on its 4 ranks and reshards to one process with and without float8, and a
  run without float8 reshards into one with float8 experts (test_float8.py's checkpoint checks);
- without the kernels (CPU as it is) float8 experts are refused by name, and so are the recipes
  torchao has no grouped GEMM for.
"""

from __future__ import annotations

import json
import shutil
from collections import Counter
from typing import Optional

import pytest
import torch

from models.errors import ConfigError
from tests.configs import tiny_config
from tests.dist import run_distributed
from tests.parity import Case, assert_parity, run_cases
from tests.trainer.test_float8 import (  # the float8 checkpoint checks
    CKPT,
    MOE_LAYER,
    CkptKind,
    _assert_checkpoints,
    _ckpt_sources,
    _ckpt_targets,
    _ckpt_worker,
    _plan,
)
from tests.trainer.test_float8_experts import (  # the MXFP8 experts' run
    LAYERS,
    MOE,
    PARITY,
    STEPS,
    _expert_weight_types,
)
from trainer.config import TrainConfig

pytest.importorskip("torchao")

ROWWISE = ("training.float8.enable=true", "training.float8.recipe=rowwise")
EXPERTS = (*ROWWISE, "training.float8.experts=true")
GROUP = 16  # torchao's float8 grouped GEMM: token groups of 16k rows
PARITY_RTOL = 2e-5  # FSDP x2 / TP x2 / EP x2 against one process, losses and pre-clip grad norms: measured
# <= 1.5e-7 / 1.9e-6 (EP: 7.1e-8 / 2.1e-6 against micro-batch 8; 6.9e-4 / 5.9e-4 against two of 4);
# EP x2 x FSDP x2, without clipping: 7.5e-8 / 3.1e-6 (steps 1-5), its checkpoint's step 5 in one process
# 7.5e-8 / 1.6e-6
# Per-step loss relative to the reference run: floor on the largest difference (the experts' low-precision
# GEMMs are on; that they are float8 is what the call counts and REL_FLOOR show), ceiling on every step
# (the same model trains). Measured: 1.9e-2 from no float8, 1.8e-2 from float8 dense linears only.
FLOOR = 1e-4
CEILING = 3e-2
# One forward and backward of the experts against fp32, norm-relative (measured 6.3e-2 .. 6.9e-2): the
# floor is 4x what bf16 alone gives (the same experts with bf16 weights, inputs and outputs: measured
# 5.2e-3 .. 5.6e-3), so the operands really were cast to float8.
REL_FLOOR = 2e-2
REL_CEILING = 0.1
F8 = torch.float8_e4m3fn


# -- pure-torch reference kernels (CPU) for torchao's CUDA-only pieces ------------------------------


def _scale_cast(
    hp: torch.Tensor, dim: int, dtype: torch.dtype, pow2: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Scales from the absmax over ``dim`` (kept), then the saturated float8 cast (torchao's
    ``amax_to_scale`` / ``to_fp8_saturated``). An empty ``dim`` has amax 0 (the kernels' EPS floor)."""
    from torchao.float8.float8_utils import amax_to_scale, to_fp8_saturated

    x = hp.to(torch.float32)
    amax = x.abs().amax(dim, keepdim=True) if x.shape[dim] else x.sum(dim, keepdim=True)
    scale = amax_to_scale(amax, dtype, round_scales_to_power_of_2=pow2)
    return to_fp8_saturated(x * scale, dtype), scale


def _col_major(t: torch.Tensor) -> torch.Tensor:
    return t.transpose(-2, -1).contiguous().transpose(-2, -1)


def ref_rowwise_2d(
    hp: torch.Tensor, output_dtype: torch.dtype = F8, round_scales_to_power_of_2: bool = False
):
    """(M, K) -> row-major float8 and (M, 1) scales."""
    return _scale_cast(hp, -1, output_dtype, round_scales_to_power_of_2)


def ref_colwise_3d(
    hp: torch.Tensor, output_dtype: torch.dtype = F8, round_scales_to_power_of_2: bool = False
):
    """(E, K, N) column-major -> column-major float8 and (E, 1, N) scales (absmax over K)."""
    data, scale = _scale_cast(hp, -2, output_dtype, round_scales_to_power_of_2)
    return _col_major(data), scale


def ref_rowwise_3d_transpose_rhs(
    hp: torch.Tensor, output_dtype: torch.dtype = F8, round_scales_to_power_of_2: bool = False
):
    """(E, K, N) -> (E, N, K) column-major float8 and (E, K) scales (absmax over N)."""
    data, scale = _scale_cast(hp, -1, output_dtype, round_scales_to_power_of_2)
    return data.contiguous().transpose(-2, -1), scale.squeeze(-1)


def _per_group_colwise(hp: torch.Tensor, offs: torch.Tensor, dtype: torch.dtype, pow2: bool):
    data, scales, start = torch.empty_like(hp, dtype=dtype), [], 0
    for end in offs.tolist():
        data[start:end], s = _scale_cast(hp[start:end], 0, dtype, pow2)
        scales.append(s.reshape(-1))
        start = end
    return _col_major(data), torch.cat(scales)


def ref_per_group_colwise_scales_dual(
    hp1: torch.Tensor,
    hp2: torch.Tensor,
    offsets: torch.Tensor,
    output_dtype: torch.dtype = F8,
    round_scales_to_power_of_2: bool = False,
):
    """Two (M, N_i) tensors -> column-major float8 with per-group column scales, (N_i * groups,)."""
    return (
        *_per_group_colwise(hp1, offsets, output_dtype, round_scales_to_power_of_2),
        *_per_group_colwise(hp2, offsets, output_dtype, round_scales_to_power_of_2),
    )


class ReferenceScaledGroupedMM:
    """``torch._scaled_grouped_mm`` for float8 rowwise operands: dequantize, fp32 matmul per group, bf16
    out (its only output dtype). Records every call's kind and group sizes, and, for 2d x 3d calls
    (forward, grad-input), the input and output rows."""

    def __init__(self) -> None:
        self.calls: Counter[str] = Counter()
        self.group_sizes: list[int] = []
        self.rows: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.history: list[dict] = []  # a run's (set by _run)

    def __call__(
        self,
        a: torch.Tensor,
        b: torch.Tensor,
        scale_a: torch.Tensor,
        scale_b: torch.Tensor,
        offs: Optional[torch.Tensor] = None,
        bias: Optional[torch.Tensor] = None,
        scale_result: Optional[torch.Tensor] = None,
        out_dtype: Optional[torch.dtype] = None,
        use_fast_accum: bool = False,
    ) -> torch.Tensor:
        assert a.dtype == b.dtype == F8 and offs is not None and bias is None and scale_result is None
        assert out_dtype in (None, torch.bfloat16), out_dtype
        assert a.stride(-1) == 1 and b.stride(-2) == 1, "a row-major, b column-major"
        ends = offs.tolist()
        starts = [0, *ends[:-1]]
        self.group_sizes += [e - s for s, e in zip(starts, ends)]
        af, bf = a.to(torch.float32), b.to(torch.float32)
        if b.ndim == 3:  # (M, K) x (E, K, N): groups of rows; scales (M,), (E, N)
            self.calls["2d_3d"] += 1
            out = torch.zeros(a.shape[0], b.shape[-1])
            for g, (s, e) in enumerate(zip(starts, ends)):
                out[s:e] = (af[s:e] * scale_a[s:e, None]) @ (bf[g] * scale_b[g][None, :])
            self.rows.append((a, out))
        else:  # (M, K) x (K, N), groups along K: weight gradients (G, M, N); scales (G * M,), (G * N,)
            self.calls["2d_2d"] += 1
            m, n = a.shape[0], b.shape[1]
            out = torch.zeros(len(ends), m, n)
            for g, (s, e) in enumerate(zip(starts, ends)):
                sa, sb = scale_a[g * m : (g + 1) * m], scale_b[g * n : (g + 1) * n]
                out[g] = (af[:, s:e] * sa[:, None]) @ (bf[s:e] * sb[None, :])
        return out.to(torch.bfloat16)


def reference_patches(mm: ReferenceScaledGroupedMM) -> list[tuple[object, str, object]]:
    """torchao's float8 grouped GEMM made runnable on CPU: its Triton kernels and
    ``torch._scaled_grouped_mm`` replaced by the references above, and ``has_float8_grouped_mm`` true
    (so the run is not refused). Everything else -- the weight wrapper, ``_Float8GroupedMM``'s forward
    and backward, our conversion and padding -- is the real code."""
    import torchao.prototype.moe_training.fp8_grouped_mm as fp8_grouped_mm

    import parallelisms.float8 as float8

    return [
        (fp8_grouped_mm, "triton_fp8_rowwise_2d_scale_and_cast", ref_rowwise_2d),
        (fp8_grouped_mm, "triton_fp8_colwise_3d_scale_and_cast", ref_colwise_3d),
        (fp8_grouped_mm, "triton_fp8_rowwise_3d_transpose_rhs", ref_rowwise_3d_transpose_rhs),
        (fp8_grouped_mm, "triton_fp8_per_group_colwise_scales_dual", ref_per_group_colwise_scales_dual),
        (torch, "_scaled_grouped_mm", mm),
        (float8, "has_float8_grouped_mm", lambda device: True),
    ]


@pytest.fixture
def reference_kernels(monkeypatch: pytest.MonkeyPatch) -> ReferenceScaledGroupedMM:
    """The reference kernels in this process, for one test (``reference_patches``)."""
    mm = ReferenceScaledGroupedMM()
    for obj, name, value in reference_patches(mm):
        monkeypatch.setattr(obj, name, value)
    return mm


def _install_reference_kernels() -> ReferenceScaledGroupedMM:
    """In a spawned rank: the reference kernels for the rest of its process (it ends after its test)."""
    mm = ReferenceScaledGroupedMM()
    for obj, name, value in reference_patches(mm):
        setattr(obj, name, value)
    return mm


def _cases_with_reference_kernels(rank: int, world_size: int, cases: dict[str, Case]) -> dict[str, dict]:
    """Spawned-rank entry point: ``run_cases`` with the reference kernels installed; each case's
    ``calls`` is its count of scaled grouped GEMM calls on this rank."""
    mm = _install_reference_kernels()
    out = {}
    for name, case in cases.items():
        mm.calls.clear()
        out.update(run_cases(rank, world_size, {name: case}))
        out[name]["calls"] = dict(mm.calls)
    return out


def _ckpt_with_reference_kernels(rank: int, world_size: int, sources: dict, targets: dict) -> dict:
    """Spawned-rank entry point: test_float8.py's ``_ckpt_worker`` with the reference kernels installed;
    ``calls``: this rank's scaled grouped GEMM calls over all its runs."""
    mm = _install_reference_kernels()
    out = _ckpt_worker(rank, world_size, sources, targets)
    out["calls"] = dict(mm.calls)
    return out


# -- tests ------------------------------------------------------------------------------------------


def _converted_experts(tmp: str):
    """The moe_debug model's (one layer) experts, converted by ``convert_to_low_precision``."""
    from models import get_spec
    from parallelisms.float8 import convert_to_low_precision

    cfg = tiny_config(tmp, *MOE, *EXPERTS)
    spec = get_spec(cfg.model.family)
    plan = _plan(tmp, 1, "model=moe_debug", f"model.n_layers={LAYERS}", *EXPERTS[1:])
    assert plan is not None and plan.experts == ["layers.0.moe.experts"], plan
    torch.manual_seed(0)
    model = spec.build(cfg.model)
    experts = model.get_submodule("layers.0.moe.experts")
    for p in experts.parameters():
        torch.nn.init.normal_(p, std=0.05)
    reference = {k: v.detach().clone() for k, v in experts.state_dict().items()}
    convert_to_low_precision(model, plan, spec)
    return experts, reference


def test_experts_run_torchao_float8_grouped_gemm_padded_to_16(
    tmp_path, reference_kernels: ReferenceScaledGroupedMM
) -> None:
    """One forward and backward of converted experts (groups of 5, 0, 17, 1, ... rows): torchao's grouped
    GEMM runs (3 forward and 3 grad-input 2d x 3d calls, 3 weight-gradient 2d x 2d calls), every group a
    multiple of 16 rows; the padding rows' outputs and input gradients are exactly zero; output and
    gradients are within [REL_FLOOR, REL_CEILING] of the fp32 experts (the padded bmm path)."""
    from torchao.prototype.moe_training.tensor import Float8TrainingWeightWrapperTensor

    from models.moe.model import GroupedExperts

    experts, reference = _converted_experts(str(tmp_path))
    assert isinstance(experts, GroupedExperts) and experts.group_multiple == GROUP
    assert all(isinstance(p.data, Float8TrainingWeightWrapperTensor) for p in experts.parameters())
    num, dim = experts.w1.shape[0], experts.w1.shape[2]
    counts = torch.tensor([5, 0, 17, 1, 16, 0, 3, 2][:num])
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(int(counts.sum()), dim, generator=gen)
    dy = torch.randn(int(counts.sum()), dim, generator=gen)

    xa = x.clone().requires_grad_()
    out = experts(xa, counts)
    out.backward(dy.to(out.dtype))
    assert out.dtype == torch.bfloat16  # torch._scaled_grouped_mm's only output dtype
    assert reference_kernels.calls == {"2d_3d": 6, "2d_2d": 3}, reference_kernels.calls
    assert reference_kernels.group_sizes and all(g % GROUP == 0 for g in reference_kernels.group_sizes)
    padded = int(((counts + GROUP - 1) // GROUP * GROUP).sum())
    total = reference_kernels.rows[0][0].shape[0]
    assert total % GROUP == 0 and total >= padded
    for a, y in reference_kernels.rows:  # padding rows: zero in, zero out (forward and grad-input)
        pad = (a.to(torch.float32) == 0).all(dim=1)
        assert int(pad.sum()) >= total - int(counts.sum()), int(pad.sum())
        assert torch.equal(y[pad], torch.zeros_like(y[pad]))

    hp = GroupedExperts(num, dim, experts.w1.shape[1], grouped_mm="off")
    hp.load_state_dict(reference)
    xb = x.clone().requires_grad_()
    ref = hp(xb, counts)
    ref.backward(dy)
    errors = {"out": (out.float(), ref), "dx": (xa.grad, xb.grad)}
    errors.update({n: (getattr(experts, n).grad, getattr(hp, n).grad) for n in ("w1", "w2", "w3")})
    for name, (got, want) in errors.items():
        assert got is not None and want is not None
        rel = float((got.detach().float() - want.detach()).norm() / want.detach().norm())
        print(f"float8 experts vs fp32, {name}: norm-relative {rel:.2e}")
        assert REL_FLOOR < rel < REL_CEILING, f"{name}: {rel:.1e}"


def _history(cfg: TrainConfig, until_step: Optional[int] = None) -> list[dict]:
    """One in-process run's history (to ``until_step`` if given)."""
    from trainer.train import Trainer

    trainer = Trainer(cfg)
    try:
        return trainer.train(until_step)
    finally:
        trainer.close()


def _run(cfg: TrainConfig, kernels: Optional[ReferenceScaledGroupedMM] = None) -> list[float]:
    """One in-process run; its history kept on ``kernels`` (when given); its per-step losses."""
    history = _history(cfg)
    if kernels is not None:
        kernels.history = history
    return [r["loss"] for r in history if "loss" in r]


def test_float8_experts_train_near_high_precision(
    tmp_path, reference_kernels: ReferenceScaledGroupedMM
) -> None:
    """moe_debug (one layer, 12 steps) in one process with float8 rowwise experts (and dense linears,
    emulated): the header names the converted experts, every expert GEMM went through torchao's float8
    grouped GEMM with 16-row groups, and the losses are within [FLOOR, CEILING] of the run without
    float8 and of the run with float8 dense linears only."""
    off = _run(tiny_config(str(tmp_path / "off"), *MOE))
    dense = _run(tiny_config(str(tmp_path / "dense"), *MOE, *ROWWISE))
    assert not reference_kernels.calls
    got = _run(tiny_config(str(tmp_path / "experts"), *MOE, *EXPERTS))
    with open(tmp_path / "experts" / "metrics.jsonl", encoding="utf-8") as f:
        f8 = json.loads(f.readline())["header"]["float8"]
    assert f8["recipe"] == "rowwise" and f8["experts"] == ["layers.0.moe.experts"], f8
    calls = reference_kernels.calls
    assert calls["2d_2d"] > 0 and calls["2d_3d"] >= 2 * calls["2d_2d"], calls  # 3 per backward, + forwards
    assert all(g % GROUP == 0 for g in reference_kernels.group_sizes)
    assert len(got) == STEPS and got[-1] < got[0] - 1.0, got
    for ref_name, ref in (("no float8", off), ("float8 dense linears only", dense)):
        rel = [abs(a - b) / abs(a) for a, b in zip(ref, got, strict=True)]
        print(
            f"float8 experts vs {ref_name}: final loss {got[-1]:.4f} vs {ref[-1]:.4f}; max per-step "
            f"relative difference {max(rel):.2e}, final {rel[-1]:.2e}"
        )
        assert max(rel) > FLOOR, f"within {max(rel):.1e} of {ref_name}: the experts are not in float8"
        assert max(rel) < CEILING, f"{max(rel):.1e} away from {ref_name}"


def _parity_case(tmp_path, name: str, world: int, *overrides: str, setup=None) -> Case:
    """A 4-step float8-experts parity run. torch's GEMM everywhere (training.cpu_gemm=torch): TP's DTensor
    linears run it, and oneDNN's other fp32 summation order in the reference moved a value across an e4m3
    rounding boundary (1.3e-4, step 4)."""
    cfg = tiny_config(str(tmp_path / name), *MOE, *PARITY, *EXPERTS, "training.cpu_gemm=torch", *overrides)
    return Case(world, cfg, setup=setup, params=False)


def test_fsdp_and_tp_parity_within_float8_experts(
    tmp_path, reference_kernels: ReferenceScaledGroupedMM
) -> None:
    """FSDP x2 (the experts sharded on dim 0, all-gathered through torchao's wrapper) and TP x2 (the
    experts replicated DTensors around the wrapper) against one process, all with float8 experts (reference
    kernels in every rank): losses and pre-clip grad norms within PARITY_RTOL, and every rank's experts went
    through the float8 grouped GEMM (3 weight-gradient GEMMs per backward)."""

    single = _parity_case(tmp_path, "single", 1)
    losses = _run(single.cfg, reference_kernels)
    layouts = {
        "fsdp": _parity_case(tmp_path, "fsdp", 2, "parallelism.dp_shard=2"),
        "tp": _parity_case(tmp_path, "tp", 2, "parallelism.tp=2"),
    }
    per_rank = run_distributed(_cases_with_reference_kernels, 2, layouts, timeout=600)
    assert len(losses) == 4 and reference_kernels.calls["2d_2d"] > 0
    for name in layouts:
        calls = [r[name]["calls"] for r in per_rank]
        assert all(c.get("2d_2d", 0) > 0 and c["2d_3d"] >= 2 * c["2d_2d"] for c in calls), (name, calls)
        history = per_rank[0][name]["history"]
        worst = assert_parity(reference_kernels.history, history, rtol=PARITY_RTOL, label=name)
        print(f"float8 experts, {name} x2 against one process: worst relative {worst}")


def test_ep_parity_within_float8_experts(tmp_path, reference_kernels: ReferenceScaledGroupedMM) -> None:
    """EP x2 (each rank owns 4 of the 8 experts, dispatch by all_to_all; micro-batch 4 a rank) against one
    process with the same tokens per expert GEMM (micro-batch 8: EP hands an expert both ranks' tokens in
    one GEMM, whose weight gradient torchao rounds to bf16 once; test_float8_experts.py's MXFP8 EP test),
    all with float8 experts (reference kernels in every rank): losses and pre-clip grad norms within
    PARITY_RTOL; every rank's local expert weights still carry torchao's wrapper and went through the
    float8 grouped GEMM."""
    single = _parity_case(tmp_path, "single_mb8", 1, "training.micro_batch_size=8")
    _run(single.cfg, reference_kernels)
    assert reference_kernels.calls["2d_2d"] > 0, reference_kernels.calls
    ep = _parity_case(
        tmp_path, "ep", 2, "parallelism.dp_shard=2", "parallelism.ep=2", setup=_expert_weight_types
    )
    per_rank = [r["ep"] for r in run_distributed(_cases_with_reference_kernels, 2, {"ep": ep}, timeout=600)]
    assert [r["observed"] for r in per_rank] == [["Float8TrainingWeightWrapperTensor"]] * 2, per_rank
    calls = [r["calls"] for r in per_rank]
    assert all(c.get("2d_2d", 0) > 0 and c["2d_3d"] >= 2 * c["2d_2d"] for c in calls), calls
    worst = assert_parity(reference_kernels.history, per_rank[0]["history"], rtol=PARITY_RTOL, label="ep")
    print(f"float8 experts, EP x2 against one process (micro-batch 8): worst relative {worst}")


# EP x2 x FSDP x2 (4 ranks, the experts FSDP-sharded over the other half): 2 sequences a rank, so an ep
# group's expert GEMM holds 4, as one process's micro-batch of 4 (MOE_LAYER); without clipping (CKPT: see
# test_float8_experts.py's EP x2 x FSDP x2 test for why). torch's GEMM everywhere (as _parity_case). Run
# as test_float8.py's checkpoint source: 5 steps writing step 4, resumed from it; a run without float8.
EP_FSDP_EXPERTS = (*EXPERTS, "training.cpu_gemm=torch")
EP_FSDP: CkptKind = (
    MOE_LAYER,
    EP_FSDP_EXPERTS,
    ("parallelism.dp_shard=4", "parallelism.ep=2", "training.micro_batch_size=2"),
    EP_FSDP_EXPERTS,
    (),
)


@pytest.fixture(scope="module")
def ep_fsdp(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The file's one 4-rank launch (reference kernels on every rank): the EP x2 x FSDP x2 float8-experts
    run (5 steps, checkpoint at 4), the same run resumed from step 4, and the run without float8.
    Rank 0's ``_ckpt_worker`` result, every rank's ``calls``, and the folder."""
    tmp = str(tmp_path_factory.mktemp("ep_fsdp"))
    per_rank = run_distributed(_ckpt_with_reference_kernels, 4, _ckpt_sources(tmp, EP_FSDP), {}, timeout=600)
    return {"tmp": tmp, "out": per_rank[0], "calls": [r["calls"] for r in per_rank]}


def test_ep_fsdp_parity_within_float8_experts(
    tmp_path, ep_fsdp: dict, reference_kernels: ReferenceScaledGroupedMM
) -> None:
    """EP x2 x FSDP x2 (4 ranks) against one process with the same 4-sequence micro-batches, both with
    float8 rowwise experts (reference kernels) and without clipping: losses and pre-clip grad norms of
    steps 1-5 within PARITY_RTOL (measured 7.5e-8 and 3.1e-6). Every rank ran the float8 grouped GEMM
    in every step of its float8 runs: 3 forward, 3 grad-input and 3 weight-gradient GEMMs per step (one
    layer, one micro-batch), 5 steps and the resumed step 5 (the run without float8 makes none)."""
    model, _, _, f8, single = EP_FSDP
    ref = _history(tiny_config(str(tmp_path / "single"), *model, *CKPT, *f8, *single), until_step=5)
    assert reference_kernels.calls["2d_2d"] > 0, reference_kernels.calls
    assert ep_fsdp["calls"] == [{"2d_3d": 6 * 6, "2d_2d": 3 * 6}] * 4, ep_fsdp["calls"]
    worst = assert_parity(ref, ep_fsdp["out"]["f8 history"], rtol=PARITY_RTOL, label="ep_fsdp")
    print(f"float8 experts, EP x2 x FSDP x2 against one process: worst relative {worst}")


def test_ep_fsdp_checkpoint_within_float8_experts(
    ep_fsdp: dict, reference_kernels: ReferenceScaledGroupedMM
) -> None:
    """The EP x2 x FSDP x2 float8-experts run's step-4 checkpoint (test_float8.py's checks): fp32 plain
    tensors, no torchao class pickled; resumed on its 4 ranks, step 5 bit for bit; loaded into one process
    (float8 experts, high precision; and the run without float8 into one with float8 experts) every tensor
    bitwise, the float8 one's step 5 within test_float8.py's RTOL (2e-5) of the 4-rank run's (measured:
    loss 7.5e-8, grad norm 1.6e-6; the same weights without float8: loss 3.5e-5 away)."""
    out = dict(ep_fsdp["out"])
    out.update(_ckpt_worker(0, 1, {}, _ckpt_targets(ep_fsdp["tmp"], EP_FSDP)))
    assert reference_kernels.calls["2d_2d"] > 0, reference_kernels.calls  # float8 -> float8, none -> float8
    _assert_checkpoints(out, "float8 rowwise experts, EP x2 x FSDP x2")


@pytest.mark.parametrize("recipe", ["rowwise", "mxfp8"])
def test_resume_with_wrapped_experts_is_exact(
    tmp_path, reference_kernels: ReferenceScaledGroupedMM, recipe: str
) -> None:
    """Checkpoints of runs whose experts carry torchao's weight wrapper (float8 rowwise, MXFP8) hold plain
    tensors (``parallelisms.utils.plain_tensor``): 8 steps with a checkpoint every 4, then the step-8
    checkpoint removed and the run restarted resumes from step 4 (DCP loads with ``weights_only``,
    which refuses torchao's classes) and repeats steps 5-8 bit for bit."""
    cfg = tiny_config(
        str(tmp_path / "run"),
        *MOE,
        *EXPERTS,
        f"training.float8.recipe={recipe}",
        "training.steps=8",
        "checkpoint.enable=true",
        "checkpoint.interval=4",
    )
    first = [r for r in _history(cfg) if "loss" in r]
    assert reference_kernels.calls["2d_2d"] > 0 or recipe == "mxfp8", reference_kernels.calls
    shutil.rmtree(tmp_path / "run" / "checkpoints" / "step-8")
    again = [r for r in _history(cfg) if "loss" in r]
    assert [r["step"] for r in again][-4:] == [5, 6, 7, 8], again
    for a, b in zip(first[4:], again[-4:], strict=True):
        assert (a["loss"], a["grad_norm"]) == (b["loss"], b["grad_norm"]), (a, b)


@pytest.mark.parametrize(
    ("recipe", "words"),
    [
        ("rowwise", "runs only on CUDA SM90/SM100"),
        ("tensorwise", "scales rowwise only"),
        ("rowwise_with_gw_hp", "scales rowwise only"),
    ],
)
def test_float8_experts_refused_on_cpu(tmp_path, recipe: str, words: str) -> None:
    """Without the kernels (CPU as it is), and for the recipes torchao has no grouped GEMM for: one
    ConfigError naming the value and the fix, from the plan (before any process group)."""
    with pytest.raises(ConfigError) as err:
        _plan(
            str(tmp_path),
            1,
            "model=moe_debug",
            f"training.float8.recipe={recipe}",
            "training.float8.experts=true",
        )
    msg = str(err.value)
    assert f"training.float8.experts=true on cpu with training.float8.recipe={recipe}" in msg, msg
    assert words in msg and "training.float8.experts=false" in msg and "\n" not in msg, msg


def test_float8_experts_refusals_with_the_kernels(
    tmp_path, reference_kernels: ReferenceScaledGroupedMM
) -> None:
    """Even where the grouped GEMM runs: tensorwise is refused (no tensorwise grouped GEMM), and so are
    expert matrices not multiples of 16; rowwise plans the experts."""
    plan = _plan(str(tmp_path), 1, "model=moe_debug", *EXPERTS[1:])
    assert plan is not None and plan.experts == ["layers.0.moe.experts", "layers.1.moe.experts"], plan
    with pytest.raises(ConfigError, match="scales rowwise only"):
        _plan(str(tmp_path), 1, "model=moe_debug", "training.float8.experts=true")  # tensorwise (default)
    with pytest.raises(ConfigError, match=r"layers.0.moe.experts's expert matrices .* not multiples of 16"):
        _plan(str(tmp_path), 1, "model=moe_debug", *EXPERTS[1:], "model.moe_hidden_dim=40")


def test_has_float8_grouped_mm_off_cuda() -> None:
    from parallelisms.float8 import has_float8_grouped_mm

    assert not has_float8_grouped_mm(torch.device("cpu"))
