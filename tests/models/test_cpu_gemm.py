"""``training.cpu_gemm``: fp32 CPU linears through oneDNN (models/cpu_gemm.py) against ``F.linear``.

The two kernels sum in different orders, so they agree to fp32 rounding, not bitwise: the bound is
1e-5 of the largest magnitude (measured: ~1e-7 relative on these shapes)."""

from __future__ import annotations

import os
import re
import tempfile
from collections import Counter
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from models import cpu_gemm
from models.common import OutputHead
from models.cpu_gemm import OneDNNLinear, linear, use_onednn_linears

pytestmark = pytest.mark.skipif(not cpu_gemm.onednn_available(), reason="this torch build has no oneDNN")

_ONEDNN = torch.ops.mkldnn._linear_pointwise.default


class _Ops(TorchDispatchMode):
    """Counts the aten / mkldnn ops dispatched inside it."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: Counter = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.calls[func] += 1
        return func(*args, **(kwargs or {}))


def _close(ref: torch.Tensor, got: torch.Tensor) -> None:
    assert got.dtype == ref.dtype and got.shape == ref.shape
    assert (got - ref).abs().max().item() <= 1e-5 * ref.abs().max().item(), (got - ref).abs().max()


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("strided", [False, True])
def test_onednn_linear_equals_f_linear_in_value_and_gradients(bias: bool, strided: bool) -> None:
    """Output, input gradient, weight and bias gradients of the three oneDNN GEMMs against torch's
    own linear (contiguous and transposed activations); one GEMM forward, two backward."""
    torch.manual_seed(0)
    ref = nn.Linear(96, 80, bias=bias)
    got = nn.Linear(96, 80, bias=bias)
    got.load_state_dict(ref.state_dict())
    assert use_onednn_linears(got) == 1 and type(got) is OneDNNLinear and isinstance(got, nn.Linear)
    assert list(got.state_dict()) == list(ref.state_dict())
    base = torch.randn(6, 4, 96)
    x_ref = (base.transpose(0, 1) if strided else base).detach().requires_grad_()
    x_got = x_ref.detach().clone().requires_grad_() if not strided else base.transpose(0, 1).requires_grad_()
    grad = torch.randn(*x_ref.shape[:-1], 80)
    y_ref = ref(x_ref)
    y_ref.backward(grad)
    with _Ops() as ops:
        y_got = got(x_got)
        y_got.backward(grad)
    assert ops.calls[_ONEDNN] == 3 and ops.calls[torch.ops.aten.mm.default] == 0, ops.calls
    assert not y_got._is_view()  # as F.linear's: FSDP2 warns on (and in-place ops break) returned views
    _close(y_ref.detach(), y_got.detach())
    _close(x_ref.grad, x_got.grad)
    _close(ref.weight.grad, got.weight.grad)
    if bias:
        _close(ref.bias.grad, got.bias.grad)
    with torch.no_grad():  # weights are read on every call (an optimizer's in-place update is seen)
        ref.weight.mul_(-2.0)
        got.weight.mul_(-2.0)
        _close(ref(x_ref), got(x_got))


def test_torchs_linear_where_onednn_would_not_compute_the_same() -> None:
    """bf16 autocast (torch's own bf16 path), other dtypes, tensor subclasses (DTensor, float8 weights)
    and fake tensors (the rehearsal) take F.linear: no oneDNN call, F.linear's result."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    torch.manual_seed(0)
    w, x = torch.randn(16, 32), torch.randn(4, 32)

    class Wrapped(torch.Tensor):  # any tensor subclass: DTensor, torchao's weight wrappers
        pass

    with _Ops() as ops:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert linear(x, w, onednn=True).dtype == torch.bfloat16
        assert torch.equal(linear(x.double(), w.double(), onednn=True), F.linear(x.double(), w.double()))
        sub = w.as_subclass(Wrapped)
        assert torch.equal(linear(x, sub, onednn=True).as_subclass(torch.Tensor), F.linear(x, w))
    assert ops.calls[_ONEDNN] == 0, ops.calls
    with FakeTensorMode() as mode:
        fake = linear(mode.from_tensor(x), mode.from_tensor(w), onednn=True)
    assert fake.shape == (4, 16)
    assert torch.equal(linear(x, w, onednn=False), F.linear(x, w))


def test_use_onednn_linears_switches_plain_linears_and_the_heads_only() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), OutputHead(8, 16))
    head = model[2]
    assert use_onednn_linears(model) == 2
    assert type(model[0]) is OneDNNLinear and type(head) is OutputHead and head.onednn
    x = torch.randn(2, 8)
    with _Ops() as ops:
        model(x)
    assert ops.calls[_ONEDNN] == 2


def test_cpu_gemm_runs_the_trainer_like_torchs_and_refuses_where_missing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Through the Trainer: ``auto`` (oneDNN on the CPU) trains the tiny model to torch's losses and
    grad norms within 1e-5; a forced ``onednn`` without oneDNN is a ConfigError naming the fix."""
    from models.errors import ConfigError
    from tests.configs import tiny_config
    from tests.parity import assert_parity
    from trainer.train import Trainer

    histories = {}
    with tempfile.TemporaryDirectory() as tmp:
        for choice in ("torch", "auto"):
            trainer = Trainer(
                tiny_config(os.path.join(tmp, choice), f"training.cpu_gemm={choice}", "training.steps=4")
            )
            try:
                linears = [m for m in trainer.model.modules() if type(m) is OneDNNLinear]
                assert bool(linears) == (choice == "auto")
                histories[choice] = trainer.train()
            finally:
                trainer.close()
        worst = assert_parity(histories["torch"], histories["auto"], rtol=1e-5, label="cpu_gemm")
        print("cpu_gemm auto vs torch:", worst)
        monkeypatch.setattr(cpu_gemm, "onednn_available", lambda: False)
        msg = re.escape("training.cpu_gemm=onednn: this torch build has no oneDNN CPU linear")
        with pytest.raises(ConfigError, match=msg):
            Trainer(tiny_config(os.path.join(tmp, "forced"), "training.cpu_gemm=onednn"))
