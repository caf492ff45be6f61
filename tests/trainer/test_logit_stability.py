"""z-loss (``training.z_loss_weight``) and logit soft-capping (``model.logit_softcap``).

Against an independent formula (autograd of a plain PyTorch expression): the loss function's value and
gradient, the capped head of every family, and the z-loss of vocab-sharded logits (loss parallel).
Then every layout equals one process with both on (1 process vs FSDP x2, TP x2 with loss parallel,
custom DDP x2, PP x2 and CP x2).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import DeviceMesh, Shard, distribute_tensor
from torch.distributed.tensor.parallel import loss_parallel

from models import get_spec
from models.errors import ConfigError
from tests.configs import PARITY_STEPS, make_config, tiny_config
from tests.dist import run_distributed
from tests.parity import Case, GroupedRuns, assert_parallel_run
from trainer.step import TokenLoss, log_z_squared_sum, token_loss_sum

WEIGHT = 1e-2
CAP = 2.0  # the tiny run's logits reach ~3-4 after a few steps: the cap bites
ON = (f"training.z_loss_weight={WEIGHT}", f"model.logit_softcap={CAP}")


def _plain_objective(logits: torch.Tensor, labels: torch.Tensor, weight: float) -> torch.Tensor:
    """Summed cross-entropy + weight * sum of logsumexp^2 over the target tokens, in plain PyTorch."""
    mask = labels != -100
    ce = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum")
    return ce + weight * (torch.logsumexp(logits, dim=-1)[mask] ** 2).sum()


def test_z_loss_value_and_gradient_match_plain_autograd() -> None:
    """The returned value is the cross-entropy bitwise (the logged loss); the gradient is that of
    CE + weight * log Z^2; the z-loss sum is recorded apart."""
    torch.manual_seed(0)
    logits = (3 * torch.randn(3, 7, 50)).requires_grad_()
    labels = torch.randint(0, 50, (3, 7))
    labels[0, :2] = -100
    loss_fn = TokenLoss(z_loss_weight=WEIGHT)
    out = loss_fn(logits, labels)
    (grad,) = torch.autograd.grad(out, logits)
    ref = _plain_objective(logits, labels, WEIGHT)
    (ref_grad,) = torch.autograd.grad(ref, logits)
    assert torch.equal(out.detach(), token_loss_sum(logits, labels).detach())
    torch.testing.assert_close(grad, ref_grad, rtol=1e-6, atol=1e-7)
    (z,) = loss_fn.z_sums
    torch.testing.assert_close(z, WEIGHT * (torch.logsumexp(logits, -1)[labels != -100] ** 2).sum())
    with torch.no_grad():  # evaluation: no z-loss work, nothing recorded
        loss_fn(logits, labels)
    assert len(loss_fn.z_sums) == 1
    off = TokenLoss()(logits, labels)  # weight 0: the plain loss, nothing recorded
    assert torch.equal(off, token_loss_sum(logits, labels))


@pytest.mark.parametrize("family", ["llama", "qwen3", "moe", "deepseek_v3"])
def test_softcap_in_every_family(family: str) -> None:
    """Each family's logits with ``logit_softcap`` equal cap * tanh(uncapped logits / cap), with the
    gradient of that expression (DeepSeek-V3 with its MTP head, which shares the output head)."""
    preset = {
        "llama": "debug",
        "qwen3": "qwen3_debug",
        "moe": "moe_debug",
        "deepseek_v3": "deepseek_v3_debug",
    }
    spec = get_spec(family)
    extra = {"mtp_depth": 1} if family == "deepseek_v3" else {}
    base = dataclasses.replace(
        make_config(f"model={preset[family]}").model, n_layers=2, max_seq_len=64, **extra
    )
    tokens = torch.randint(0, base.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    weight = None
    outs = {}
    for cap in (None, "half"):
        if cap == "half":  # half the largest uncapped logit: the cap bites
            cap = float(outs[None][0].detach().abs().max()) / 2
        model = spec.build(dataclasses.replace(base, logit_softcap=cap))
        model.init_weights(seed=0)
        inputs: list[torch.Tensor] = []  # what the head saw: (B, S, H) per call
        model.output.register_forward_hook(lambda m, i, o, seen=inputs: seen.append(i[0].detach()))
        logits = model(tokens)  # (B, S, V)
        if weight is None:
            weight = torch.randn(logits.shape, generator=torch.Generator().manual_seed(2))
        (logits * weight).sum().backward()
        outs[cap] = (logits, model.output.weight.grad, inputs)
    raw, (capped, grad, inputs) = outs[None][0], outs[cap]
    raw_leaf = raw.detach().requires_grad_()
    ref = cap * torch.tanh(raw_leaf / cap)
    torch.testing.assert_close(capped, ref, rtol=1e-6, atol=1e-6)
    assert float(capped.detach().abs().max()) < cap < float(raw.detach().abs().max())
    # the head's gradient through the cap: (d objective / d uncapped logits)^T h, from plain autograd
    (d_raw,) = torch.autograd.grad((ref * weight).sum(), raw_leaf)  # (B, S, V)
    # (DeepSeek-V3's MTP calls the head again, Qwen3 ties it to the embedding: their gradients add up)
    if len(inputs) == 1 and not spec.ties_embeddings(base):
        (h,) = inputs
        torch.testing.assert_close(grad, d_raw.flatten(0, 1).T @ h.flatten(0, 1), rtol=1e-5, atol=1e-6)
    assert len(inputs) == (2 if family == "deepseek_v3" else 1)


def test_bad_values() -> None:
    with pytest.raises(ConfigError, match="z_loss_weight"):
        make_config("training.z_loss_weight=-1")
    with pytest.raises(ConfigError, match="logit_softcap"):
        make_config("model.logit_softcap=0")


def _sharded_z_loss(rank: int, world: int) -> list[float]:
    """log_z_squared_sum and its gradient of logits sharded on the vocabulary (loss parallel)."""
    mesh = DeviceMesh("cpu", list(range(world)))
    torch.manual_seed(0)
    full = 4 * torch.randn(2, 5, 16)
    labels = torch.randint(0, 16, (2, 5))
    labels[1, 3] = -100
    sharded = distribute_tensor(full, mesh, [Shard(2)]).requires_grad_()
    with loss_parallel():
        z = log_z_squared_sum(sharded, labels)
        z.backward()
    leaf = full.clone().requires_grad_()
    ref = (torch.logsumexp(leaf, -1)[labels != -100] ** 2).sum()
    ref.backward()
    torch.testing.assert_close(z, ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(sharded.grad.full_tensor(), leaf.grad, rtol=1e-6, atol=1e-6)
    return [float(z)]


def test_z_loss_on_vocab_sharded_logits() -> None:
    """Under loss parallel the z-loss (value and gradient) equals the unsharded formula."""
    assert len(run_distributed(_sharded_z_loss, 2)) == 2


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> GroupedRuns:
    tmp = tmp_path_factory.mktemp("zcap")
    layouts = {
        "one": (1, ()),
        "fsdp_x2": (2, ("parallelism.dp_shard=2",)),
        "tp_x2": (2, ("parallelism.tp=2", "parallelism.dp_shard=1")),  # loss parallel (the default)
        "ddp_x2": (2, ("parallelism.dp_replicate=2", "parallelism.dp_shard=1")),  # the custom bucketed DDP
        "pp_x2": (2, ("parallelism.pp=2", "parallelism.dp_shard=1")),  # the loss on the last stage
        "cp_x2": (2, ("parallelism.cp=2", "parallelism.dp_shard=1")),
    }
    return GroupedRuns(
        {
            name: Case(world, tiny_config(str(tmp / name), PARITY_STEPS, *ON, *overrides))
            for name, (world, overrides) in layouts.items()
        }
    )


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["fsdp_x2", "tp_x2", "ddp_x2", "pp_x2", "cp_x2"])
def test_layouts_equal_one_process(runs: GroupedRuns, layout: str) -> None:
    """Losses, pre-clip grad norms, final weights (tests/parity.py tolerances) and the logged z_loss."""
    ref, got = runs.get("one"), runs.get(layout)
    assert_parallel_run(ref, got, label=layout)
    z_ref = [r["z_loss"] for r in ref["history"] if "z_loss" in r]
    z_got = [r["z_loss"] for r in got["history"] if "z_loss" in r]
    assert len(z_ref) == 4 and all(z > 0 for z in z_ref)
    torch.testing.assert_close(z_got, z_ref, rtol=1e-5, atol=0)
