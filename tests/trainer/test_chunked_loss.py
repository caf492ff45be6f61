"""The chunked loss (``training.loss_chunk_size``): the output head, soft-cap, cross-entropy and z-loss run
a few positions of the sequence at a time, recomputed in backward, so the (B, S, V) logits never exist.

Against the unchunked loss of the same model (the full logits, ``TokenLoss``): the value and every
parameter's gradient in one process for each family with z-loss and soft-capping on (DeepSeek-V3 with
its MTP head), a chunk size that does not divide the sequence, and ignored targets; then whole runs with
the option on (1 process, FSDP x2, TP x2 with loss parallel with and without sequence parallel, PP x2,
CP x2) against one process with it off; validation and task scoring.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from models import get_spec
from models.common import OutputHead
from models.errors import ConfigError
from tests.configs import PARITY_STEPS, make_config, tiny_config
from tests.parity import Case, GroupedRuns, assert_parallel_run
from trainer.step import TokenLoss, chunked_loss_sums, log_z_squared_sum, token_loss_sum

WEIGHT = 1e-2
CAP = 2.0
PRESETS = {
    "llama": "debug",
    "qwen3": "qwen3_debug",
    "moe": "moe_debug",
    "deepseek_v3": "deepseek_v3_debug",
    "qwen3_5": "qwen3_5_debug",
    "qwen3_5_moe": "qwen3_5_moe_debug",
}
# fp32, one process: only the order of the sums differs (chunk by chunk vs whole)
RTOL, ATOL = 1e-5, 1e-6


def _loss_and_grads(model: torch.nn.Module, tokens: torch.Tensor, labels: torch.Tensor, chunk: int):
    head = next(m for m in model.modules() if isinstance(m, OutputHead))
    head.deferred = chunk > 0
    loss_fn = TokenLoss(WEIGHT, chunk_size=chunk, head=head if chunk else None)
    if hasattr(model, "mtp_loss_fn"):  # DeepSeek-V3's MTP head: the same chunking, no z-loss
        model.mtp_loss_fn = TokenLoss(chunk_size=chunk, head=head) if chunk else token_loss_sum
        model.mtp_grad_scale = 1.0
    model.zero_grad(set_to_none=True)
    out = model(tokens)
    assert out.shape[-1] == (model.args.dim if chunk else model.args.vocab_size)
    loss = loss_fn(out, labels)
    loss.backward()
    (z,) = loss_fn.z_sums
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), z, grads


@pytest.mark.parametrize("family", list(PRESETS))
def test_chunked_equals_whole_logits(family: str) -> None:
    """Loss, z-loss and every gradient of the chunked path equal the whole-logits path (rtol 1e-5)."""
    spec = get_spec(family)
    extra = {"mtp_depth": 1} if family == "deepseek_v3" else {}
    args = dataclasses.replace(
        make_config(f"model={PRESETS[family]}").model, n_layers=2, max_seq_len=64, logit_softcap=CAP, **extra
    )
    model = spec.build(args)
    model.init_weights(seed=0)
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, args.vocab_size, (2, 16), generator=gen)
    labels = torch.randint(0, args.vocab_size, (2, 16), generator=gen)
    labels[0, :3] = -100
    ref_loss, ref_z, ref_grads = _loss_and_grads(model, tokens, labels, 0)
    loss, z, grads = _loss_and_grads(model, tokens, labels, 5)  # 16 = 5 + 5 + 5 + 1
    torch.testing.assert_close(loss, ref_loss, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(z, ref_z, rtol=RTOL, atol=ATOL)
    assert grads.keys() == ref_grads.keys()
    assert "output.weight" in grads or spec.ties_embeddings(args)
    for name, g in grads.items():
        torch.testing.assert_close(g, ref_grads[name], rtol=RTOL, atol=ATOL, msg=name)


def test_chunked_sums_match_formulas_without_grad() -> None:
    """Without gradients (evaluation) the chunks run plainly; chunk sizes 1, 7 and above S agree."""
    torch.manual_seed(0)
    head = OutputHead(8, 40, softcap=CAP)
    hidden, labels = torch.randn(3, 9, 8), torch.randint(0, 40, (3, 9))
    labels[2, 4:] = -100
    logits = head(hidden)
    ref = torch.stack([token_loss_sum(logits, labels), log_z_squared_sum(logits, labels)])
    with torch.no_grad():
        for chunk in (1, 7, 64):
            got = chunked_loss_sums(head, hidden, labels, chunk, z_loss=True)
            torch.testing.assert_close(got, ref.detach(), rtol=RTOL, atol=ATOL)


def test_bad_values() -> None:
    with pytest.raises(ConfigError, match="loss_chunk_size"):
        make_config("training.loss_chunk_size=-1")


def test_mup_refused_by_name() -> None:
    args = dataclasses.replace(make_config("model=debug").model, n_layers=1)
    args = dataclasses.replace(args, mup=dataclasses.replace(args.mup, enable=True))
    model = get_spec("llama").build(args)
    model.output.deferred = True
    with pytest.raises(ConfigError, match="loss_chunk_size.*mup"):
        model(torch.zeros(1, 4, dtype=torch.long))


CHUNK = ("training.loss_chunk_size=5", f"training.z_loss_weight={WEIGHT}", f"model.logit_softcap={CAP}")


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> GroupedRuns:
    tmp = tmp_path_factory.mktemp("closs")
    layouts = {
        "one": (1, CHUNK[1:]),
        "one_chunked": (1, CHUNK),
        "fsdp_x2": (2, (*CHUNK, "parallelism.dp_shard=2")),
        "tp_x2": (2, (*CHUNK, "parallelism.tp=2", "parallelism.dp_shard=1")),  # loss parallel + SP
        "tp_x2_no_sp": (
            2,
            (*CHUNK, "parallelism.tp=2", "parallelism.dp_shard=1", "parallelism.sequence_parallel=false"),
        ),
        "pp_x2": (2, (*CHUNK, "parallelism.pp=2", "parallelism.dp_shard=1")),
        "cp_x2": (2, (*CHUNK, "parallelism.cp=2", "parallelism.dp_shard=1")),
    }
    return GroupedRuns(
        {
            name: Case(world, tiny_config(str(tmp / name), PARITY_STEPS, *overrides))
            for name, (world, overrides) in layouts.items()
        }
    )


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["one_chunked", "fsdp_x2", "tp_x2", "tp_x2_no_sp", "pp_x2", "cp_x2"])
def test_layouts_equal_one_process(runs: GroupedRuns, layout: str) -> None:
    """Chunked runs against one process unchunked: losses, pre-clip grad norms, final weights
    (tests/parity.py tolerances) and the logged z_loss (rtol 1e-5)."""
    ref, got = runs.get("one"), runs.get(layout)
    assert_parallel_run(ref, got, label=layout)
    z_ref = [r["z_loss"] for r in ref["history"] if "z_loss" in r]
    z_got = [r["z_loss"] for r in got["history"] if "z_loss" in r]
    assert len(z_ref) == len(z_got) > 0
    torch.testing.assert_close(z_got, z_ref, rtol=1e-5, atol=0)


@pytest.mark.slow
def test_evaluation_and_tasks_unchanged(tmp_path) -> None:  # noqa: ANN001
    """Validation (the chunked loss without gradients) and task scoring (which switches the head back
    to whole logits for its forwards) equal the unchunked run's, one process (rtol 1e-5)."""
    from tests.eval.test_eval_parity import _evaluate, _loglik_rows

    extra = (
        "training.eval_freq=1",
        "training.eval_steps=2",
        "eval.tasks=[next_line,complete_word]",
        "eval.limit=6",
        "eval.batch_size=3",
    )
    ref = _evaluate(tiny_config(str(tmp_path / "off"), *extra))
    got = _evaluate(tiny_config(str(tmp_path / "on"), *extra, "training.loss_chunk_size=5"))
    torch.testing.assert_close(got["validation"], ref["validation"], rtol=RTOL, atol=0)
    torch.testing.assert_close(_loglik_rows(got), _loglik_rows(ref), rtol=RTOL, atol=0)
    assert got["tasks"] == ref["tasks"]
