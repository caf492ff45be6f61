"""``model.linear_kernel`` (``models/qwen3_5/kernels.py``) on CPU: which implementation the Gated
DeltaNet picks, and the refusals of a forced ``fla`` that cannot run, through the real code paths (the
trainer's start-up check, the core's dispatch). fla's numerics against our torch form need CUDA and
the package: ``benchmarks/gpu_check.py``'s ``delta_rule_fla`` part."""

from __future__ import annotations

import re

import pytest
import torch

from models.errors import ConfigError
from models.qwen3_5.delta_net import DeltaRuleCore
from models.qwen3_5.delta_rule import chunk_gated_delta_rule, short_conv
from models.qwen3_5.kernels import check_linear_kernel, fla_installed, uses_fla
from tests.configs import tiny_config

QWEN = ("model=qwen3_5_debug", "training.steps=1", "checkpoint.enable=false")


def test_dispatch_decision() -> None:
    cpu = torch.zeros(1)
    meta = torch.empty(1, device="meta")
    assert not uses_fla("torch", cpu) and not uses_fla("auto", cpu) and not uses_fla("auto", meta)
    with pytest.raises(ValueError, match="fla's kernels need CUDA"):
        uses_fla("fla", cpu)
    for kernel in ("auto", "torch"):  # these run anywhere
        check_linear_kernel(kernel, "cpu")
        check_linear_kernel(kernel, "cuda")


def test_auto_on_cpu_runs_the_torch_form() -> None:
    """The core with ``auto`` on CPU tensors returns exactly our convolutions + chunked rule."""
    g = torch.Generator().manual_seed(0)
    B, S, nk, nv, dk, dv, K = 2, 19, 1, 2, 8, 4, 4
    q, k = (torch.randn(B, S, nk * dk, generator=g) for _ in range(2))
    v = torch.randn(B, S, nv * dv, generator=g)
    decay = -torch.rand(B, S, nv, generator=g)
    beta = torch.rand(B, S, nv, generator=g)
    conv = [torch.randn(c, 1, K, generator=g) for c in (nk * dk, nk * dk, nv * dv)]
    positions = torch.tensor([list(range(7)) + list(range(12))] * B)  # a document starts at 7
    core = DeltaRuleCore("block_causal", chunk_size=8, kernel="auto")
    got = core(q, k, v, decay, beta, conv=conv, head_dims=(dk, dv), positions=positions)
    resets = positions == 0
    qc, kc, vc = (short_conv(t, w, resets=resets)[0] for t, w in zip((q, k, v), conv))
    want, _ = chunk_gated_delta_rule(
        qc.view(B, S, nk, dk),
        kc.view(B, S, nk, dk),
        vc.view(B, S, nv, dv),
        decay,
        beta,
        chunk_size=8,
        resets=resets,
    )
    assert torch.equal(got, want)


def test_forced_fla_refused_without_cuda(tmp_path) -> None:
    """A CPU run that forces fla stops at start-up (before any process group), naming the fixes."""
    from trainer.train import Trainer

    cfg = tiny_config(str(tmp_path), *QWEN, "training.device=cpu", "model.linear_kernel=fla")
    with pytest.raises(ConfigError, match=re.escape("model.linear_kernel=fla needs CUDA")):
        Trainer(cfg)


@pytest.mark.skipif(fla_installed(), reason="flash-linear-attention is installed here")
def test_forced_fla_refused_without_the_package() -> None:
    with pytest.raises(ConfigError, match=re.escape("pip install 'meshwright[fla]'")):
        check_linear_kernel("fla", "cuda")


def test_unknown_kernel_refused(tmp_path) -> None:
    with pytest.raises(
        ConfigError, match=re.escape("model.linear_kernel='triton' must be one of auto, torch")
    ):
        tiny_config(str(tmp_path), *QWEN, "model.linear_kernel=triton")
