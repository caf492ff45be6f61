"""Tensor parallel (+ sequence parallel, loss parallel) trains the same model as one process.

* The plan is inspected as data and after sharding: every Linear's local weight is the
  expected shard, local head counts are n_heads / tp and n_kv_heads / tp, the residual stream
  is sequence-sharded under SP, logits are a vocab-sharded DTensor under loss parallel, and
  the sharded forward, loss and gradients equal the single-process ones.
* Parity: the real Trainer runs 4 optimizer steps per layout (``PARITY_STEPS``; fp32, CPU, gloo);
  its per-step losses and pre-clip gradient norms must match the single-process run's at relative 1e-5
  and its final weights at 1e-5 absolute (``tests/parity.py``; measured: losses <= ~1e-7,
  grad norms <= ~2e-6, as TP and FSDP sum partial products and per-shard norms in another
  order than one process). Cases marked ``_noclip`` run with clipping off.
"""

from __future__ import annotations

import contextlib
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    loss_parallel,
)

from models.errors import ConfigError
from models.llama import LLAMA_SPEC, LlamaArgs, Transformer
from parallelisms.config import ParallelismConfig
from parallelisms.parallel_dims import ParallelDims
from parallelisms.tensor_parallel import ReplicateParallel, apply_tp, check_tp_fits_node
from parallelisms.tensor_parallel import tp_plan as _tp_plan
from parallelisms.validate import validate_model, validated_dims
from tests.configs import NO_CLIP, PARITY_STEPS, tiny_config
from tests.dist import run_distributed
from tests.parity import Case, GroupedRuns, assert_parallel_run

ARGS = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden_dim=128, vocab_size=512, max_seq_len=64)


def llama_tp_plan(model: torch.nn.Module, **kw: bool) -> dict:
    return _tp_plan(model, LLAMA_SPEC, **kw)


# --------------------------------------------------------------------------------------------
# The plan as data (no process group)
# --------------------------------------------------------------------------------------------


def test_plan_is_data_with_expected_styles() -> None:
    with torch.device("meta"):
        model = Transformer(LlamaArgs(**ARGS))
    plan = llama_tp_plan(model, sequence_parallel=True, loss_parallel=True)
    for i in ("0", "1"):
        for proj in ("attention.wq", "attention.wk", "attention.wv", "feed_forward.w1", "feed_forward.w3"):
            assert type(plan[f"layers.{i}.{proj}"]) is ColwiseParallel
        for proj in ("attention.wo", "feed_forward.w2"):
            style = plan[f"layers.{i}.{proj}"]
            assert type(style) is RowwiseParallel and style.output_layouts == (Shard(1),)  # reduce_scatter
        assert isinstance(plan[f"layers.{i}.attention"], PrepareModuleInput)
    emb, out = plan["tok_embeddings"], plan["output"]
    assert emb.input_layouts == (Replicate(),) and emb.output_layouts == (Shard(1),)
    assert (
        out.input_layouts == (Shard(1),) and out.output_layouts == (Shard(-1),) and not out.use_local_output
    )

    plain = llama_tp_plan(model, sequence_parallel=False, loss_parallel=False)
    assert plain["layers.0.attention.wo"].output_layouts == (Replicate(),)  # all_reduce
    assert isinstance(plain["norm"], ReplicateParallel)
    assert plain["output"].output_layouts == (Replicate(),) and plain["output"].use_local_output

    # A pipeline stage (no embedding, no head, some blocks) gets entries only for what it has.
    model.tok_embeddings, model.norm, model.output = None, None, None
    del model.layers["0"]
    keys = set(llama_tp_plan(model))
    assert not {"tok_embeddings", "norm", "output"} & keys
    assert all(k.startswith("layers.1.") for k in keys)


@pytest.mark.parametrize(
    "kw,needle",
    [
        ({"device_type": "cpu", "async_tp": True, "compile": True}, "needs CUDA"),
        ({"device_type": "cuda", "async_tp": True, "compile": False}, "training.compile=true"),
        (
            {"device_type": "cuda", "async_tp": True, "compile": True, "sequence_parallel": False},
            "sequence_parallel=true",
        ),
    ],
)
def test_async_tp_requirements(kw: dict, needle: str) -> None:
    cfg = ParallelismConfig(
        tp=2, async_tp=kw["async_tp"], sequence_parallel=kw.get("sequence_parallel", True)
    )
    with pytest.raises(ConfigError, match=needle):
        validated_dims(
            cfg,
            2,
            spec=LLAMA_SPEC,
            model_args=LlamaArgs(**ARGS),
            seq_len=32,
            global_batch_size=2,
            micro_batch_size=1,
            compile=kw["compile"],
            device_type=kw["device_type"],
        )


@pytest.mark.parametrize(
    "args,tp,needle",
    [
        (dict(ARGS, n_heads=4, n_kv_heads=4), 8, "n_heads=4"),
        (dict(ARGS, n_kv_heads=1), 2, "n_kv_heads=1"),
        (dict(ARGS, ffn_hidden_dim=129), 2, "FFN hidden size=129"),
        (dict(ARGS, vocab_size=513), 2, "vocab_size=513"),
    ],
)
def test_divisibility_errors(args: dict, tp: int, needle: str) -> None:
    dims = ParallelDims(tp=tp, world_size=tp)
    with pytest.raises(ConfigError, match=f"{needle}.*parallelism.tp={tp}"):
        validate_model(dims, LLAMA_SPEC, LlamaArgs(**args), seq_len=32, sequence_parallel=True)


def test_tp_larger_than_a_node_warns_on_gpu_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    with pytest.warns(UserWarning, match="parallelism.tp=16 exceeds the 8 GPUs of one node"):
        check_tp_fits_node(16, "cuda")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_tp_fits_node(8, "cuda")
        check_tp_fits_node(16, "cpu")


# --------------------------------------------------------------------------------------------
# The sharded model (2 gloo ranks)
# --------------------------------------------------------------------------------------------


def _record_shape(seen: dict, key: str):  # noqa: ANN202
    def hook(module: torch.nn.Module, inputs: tuple, output: torch.Tensor) -> None:
        seen[key] = tuple(output.shape)

    return hook


def _inspect(rank: int, world_size: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    from parallelisms.utils import copy_full_into

    tp = world_size
    mesh = init_device_mesh("cpu", (tp,), mesh_dim_names=("tp",))
    B, S = 2, 16
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, ARGS["vocab_size"], (B, S), generator=gen)
    labels = torch.randint(0, ARGS["vocab_size"], (B, S), generator=gen)
    report = {}
    for sp, lp, tie in (
        (True, True, False),
        (True, False, False),
        (False, True, False),
        (False, False, True),
    ):
        args = LlamaArgs(**ARGS, tie_embeddings=tie)
        ref = Transformer(args)
        ref.init_weights(seed=3)
        with torch.device("meta"):
            model = Transformer(args)
        apply_tp(model, LLAMA_SPEC, mesh, ParallelismConfig(tp=tp, sequence_parallel=sp, loss_parallel=lp))
        model.to_empty(device="cpu")
        model.init_weights(seed=3, copy_fn=copy_full_into)

        hd, H, Fh, V = args.head_dim, args.dim, args.hidden_dim, args.vocab_size
        expected = {
            "tok_embeddings": ((V // tp, H), Shard(0)),
            "output": ((V // tp, H), Shard(0)),
            "layers.0.attention.wq": ((args.n_heads // tp * hd, H), Shard(0)),
            "layers.0.attention.wk": ((args.kv_heads // tp * hd, H), Shard(0)),
            "layers.0.attention.wv": ((args.kv_heads // tp * hd, H), Shard(0)),
            "layers.0.attention.wo": ((H, args.n_heads // tp * hd), Shard(1)),
            "layers.0.feed_forward.w1": ((Fh // tp, H), Shard(0)),
            "layers.0.feed_forward.w3": ((Fh // tp, H), Shard(0)),
            "layers.0.feed_forward.w2": ((H, Fh // tp), Shard(1)),
            "layers.0.attention_norm": ((H,), Replicate()),
            "norm": ((H,), Replicate()),
        }
        for name, (shape, placement) in expected.items():
            w = model.get_submodule(name).weight
            assert isinstance(w, DTensor) and w.placements == (placement,), (name, w)
            assert tuple(w.to_local().shape) == shape, (name, w.to_local().shape, shape)
        every_param_is_dtensor = all(isinstance(p, DTensor) for p in model.parameters())
        assert every_param_is_dtensor
        if tie:
            assert model.output.weight is model.tok_embeddings.weight

        seen: dict[str, tuple[int, ...]] = {}
        attn = model.layers["0"].attention
        hooks = [
            attn.wq.register_forward_hook(_record_shape(seen, "q")),
            attn.wk.register_forward_hook(_record_shape(seen, "k")),
            model.layers["0"].register_forward_hook(_record_shape(seen, "block")),
        ]
        with loss_parallel() if lp else contextlib.nullcontext():
            logits = model(tokens)
            # Exactly the trainer's formula (trainer/step.py: token_loss_sum).
            loss = F.cross_entropy(
                logits.flatten(0, 1).float(), labels.flatten(0, 1), ignore_index=-100, reduction="sum"
            )
            loss = loss.full_tensor() if isinstance(loss, DTensor) else loss
            loss.backward()
        for h in hooks:
            h.remove()
        # Local heads: n_heads / tp query heads, n_kv_heads / tp kv heads, full sequence.
        assert seen["q"] == (B, S, args.n_heads // tp * hd) and seen["k"] == (B, S, args.kv_heads // tp * hd)
        # Residual stream between blocks: sequence-sharded under SP, full otherwise.
        assert seen["block"] == (B, S // tp if sp else S, H)
        if lp:
            assert isinstance(logits, DTensor) and logits.placements == (Shard(2),)
            assert tuple(logits.to_local().shape) == (B, S, V // tp)
            full_logits = logits.full_tensor()
        else:
            assert not isinstance(logits, DTensor) and tuple(logits.shape) == (B, S, V)
            full_logits = logits

        ref_logits = ref(tokens)
        ref_loss = F.cross_entropy(ref_logits.flatten(0, 1), labels.flatten(0, 1), reduction="sum")
        ref_loss.backward()
        torch.testing.assert_close(full_logits, ref_logits, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=0)
        ref_grads = dict(ref.named_parameters())
        for name, p in model.named_parameters():
            torch.testing.assert_close(p.grad.full_tensor(), ref_grads[name].grad, rtol=1e-4, atol=1e-6)
        report[f"sp={sp},lp={lp},tie={tie}"] = float(loss)
    return report


@pytest.mark.slow
def test_sharded_model_shapes_logits_and_gradients() -> None:
    results = run_distributed(_inspect, 2)
    assert results[0] == results[1] and len(results[0]) == 4


# --------------------------------------------------------------------------------------------
# Parity with the single-process Trainer
# --------------------------------------------------------------------------------------------


TP2 = "parallelism.tp=2"
LAYOUTS = {  # name -> (world, overrides); "_noclip" cases compare with the unclipped reference
    "tp2_sp_lp": (2, [TP2]),  # the defaults: sequence parallel and loss parallel on
    "tp2_sp_nolp_noclip": (2, [TP2, "parallelism.loss_parallel=false", NO_CLIP]),
    "tp2_nosp_lp": (2, [TP2, "parallelism.sequence_parallel=false"]),
    "tp2_nosp_nolp_noclip": (
        2,
        [TP2, "parallelism.sequence_parallel=false", "parallelism.loss_parallel=false", NO_CLIP],
    ),
    "tp2_ac_full": (2, [TP2, "training.activation_checkpoint=full"]),
    "tp2_x_fsdp2_noclip": (4, [TP2, "parallelism.dp_shard=2", NO_CLIP]),
    "tp2_x_ddp2_custom_noclip": (4, [TP2, "parallelism.dp_shard=1", "parallelism.dp_replicate=2", NO_CLIP]),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> GroupedRuns:
    """Every layout of one world size in one spawned group (see tests/parity.py)."""
    tmp = tmp_path_factory.mktemp("tp")
    return GroupedRuns(
        {n: Case(w, tiny_config(str(tmp / n), PARITY_STEPS, *ov)) for n, (w, ov) in LAYOUTS.items()}
    )


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_matches_single_process(layout: str, runs: GroupedRuns, tiny_reference: dict) -> None:
    ref = tiny_reference["noclip" if NO_CLIP in LAYOUTS[layout][1] else "clip"]
    assert_parallel_run(ref, runs.get(layout), label=layout)
