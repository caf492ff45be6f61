"""Pipeline parallel trains the same model as one process (fp32, CPU, gloo).

The harness below mirrors the Trainer's step exactly (global-token loss normalisation scaled
by dp_cp, AdamW + warmup schedule, global grad-norm clipping, the dp-sharded loader), once
without PP (the single-process reference) and once with ``parallelize_pipeline`` and
``Pipeline.step``, for 4 optimizer steps (``PARITY_STEPS``). Per-step losses, pre-clip grad norms
and eval losses (``forward_loss_sum``, mid-run and at the end) must match the reference to
relative 1e-5 (``tests/parity.py``), and a DCP checkpoint of the stages must load into one plain
model with the reference's weights.
Cases named ``*_noclip`` run with clipping off against the unclipped reference.
Measured (printed with ``-s``): losses bitwise equal for pure PP (the pipeline microbatches
are the reference's accumulation microbatches) and <= 1.4e-7 with TP / DDP; grad norms
<= 1.2e-7, and <= 1.7e-6 with FSDP / TP, whose sharded norm sums in another order (the same
without PP); weights <= 1.1e-6 absolute.

To keep the suite fast on 2 cores, all 2-rank schedule cases run in ONE spawned group (one
after another on the same process group) and the reference once.
"""

from __future__ import annotations

import os

import pytest
import torch

from models.common import IGNORE_INDEX
from models.errors import ConfigError
from models.llama import LLAMA_SPEC, LlamaArgs, Transformer
from parallelisms.config import ParallelismConfig
from parallelisms.pipeline_parallel import SCHEDULES, _build_part, stage_ids_of_rank, stages_per_rank
from parallelisms.pipeline_parallel import stage_module_names as _stage_module_names
from parallelisms.validate import validate_pp as _validate_pp
from parallelisms.validate import validated_dims
from tests.configs import NO_CLIP, PARITY_STEPS, tiny_config
from tests.dist import run_distributed
from tests.parity import PARAM_ATOL, assert_parity, history_from
from trainer.config import TrainConfig

EVAL_BATCH = 4  # validation sequences per eval batch over all dp ranks (same for every layout)
EVAL_BATCHES = 2
EVAL_EVERY = 2  # evaluations after steps 2 and 4: mid-run too (the training after it must be unaffected)


def stage_module_names(n_layers: int, num_stages: int, layers_per_stage: int | None) -> list[list[str]]:
    return _stage_module_names(LLAMA_SPEC, n_layers, num_stages, layers_per_stage)


def validate_pp(args: LlamaArgs, cfg: ParallelismConfig, **kw: object) -> None:
    _validate_pp(LLAMA_SPEC, args, cfg, **kw)


# --------------------------------------------------------------------------------------------
# Harness (runs inside a spawned rank)
# --------------------------------------------------------------------------------------------


def _train(cfg: TrainConfig, world_size: int, name: str) -> dict:
    """The optimizer steps the way the Trainer takes them; returns per-step losses, grad norms
    and the eval losses after every ``EVAL_EVERY`` steps (identical on every rank)."""
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch import nn
    from torch.distributed.tensor import DTensor

    from parallelisms.parallelize import PartOptions, parallelize, parallelize_pipeline
    from parallelisms.utils import clip_grad_norm_, copy_full_into
    from trainer.data import build_dataloader
    from trainer.data.tokenizer import build_tokenizer
    from trainer.optim import build_lr_scheduler, build_optimizer
    from trainer.step import StepContext, token_loss_sum

    t, p = cfg.training, cfg.parallelism
    dims = validated_dims(
        p,
        world_size,
        spec=LLAMA_SPEC,
        model_args=cfg.model,
        seq_len=t.seq_len,
        global_batch_size=t.global_batch_size,
        micro_batch_size=t.micro_batch_size,
        compile=t.compile,
    )
    local_batch = dims.local_batch_size(t.global_batch_size)
    dims.build_mesh("cpu")
    dp_cp_group = dims.loss_mesh.get_group()
    dp_rank = dims.dp_rank
    tokenizer = build_tokenizer(cfg.data.tokenizer)
    loader = build_dataloader(
        cfg.data,
        tokenizer,
        split="train",
        seq_len=t.seq_len,
        global_batch_size=t.global_batch_size,
        dp_rank=dp_rank,
        dp_size=dims.dp,
        seed=t.seed,
    )
    val_loader = build_dataloader(
        cfg.data,
        tokenizer,
        split="validation",
        seq_len=t.seq_len,
        global_batch_size=EVAL_BATCH,
        dp_rank=dp_rank,
        dp_size=dims.dp,
        seed=t.seed,
    )
    torch.manual_seed(t.seed)
    with torch.device("meta"):
        model = Transformer(cfg.model)
    options = PartOptions(
        device=torch.device("cpu"),
        init_weights=lambda m: m.init_weights(seed=t.seed, copy_fn=copy_full_into),
        activation_checkpoint=t.activation_checkpoint,
        ac_selective=t.ac_selective,
        ac_layer_interval=t.ac_layer_interval,
        compile=t.compile,
    )
    pipe, pp_mesh = None, None
    if dims.pp > 1:
        pipe = parallelize_pipeline(
            model,
            LLAMA_SPEC,
            dims,
            p,
            options,
            micro_batch_size=t.micro_batch_size,
            local_batch_size=local_batch,
            seq_len=t.seq_len,
            autocast_dtype=None,
            loss_fn=token_loss_sum,
            step_context=StepContext(loss_parallel=dims.tp > 1 and p.loss_parallel),
        )
        parts, pp_mesh = pipe.model_parts, pipe.pp_mesh
    else:
        parts = [parallelize(model, LLAMA_SPEC, dims, p, options)]
    optimizer = build_optimizer(nn.ModuleList(parts), cfg.optimizer, device_type="cpu")
    scheduler = build_lr_scheduler(optimizer, cfg.lr_scheduler, t.steps)

    def loss_sum_of(m: nn.Module, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = m(inputs)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1), reduction="sum")
        return loss.full_tensor() if isinstance(loss, DTensor) else loss

    def evaluate() -> float:
        """Mean loss over EVAL_BATCHES validation batches (the same sequences in every layout)."""
        eval_sum, eval_count = torch.zeros(()), torch.zeros(())
        val_loader.reset()
        for _ in range(EVAL_BATCHES):
            batch = val_loader.next_batch()
            if pipe is not None:
                pipe.eval()
                eval_sum += pipe.forward_loss_sum(
                    batch.inputs if pipe.has_first_stage else None, batch.labels
                )
                pipe.train()
            else:
                with torch.no_grad():
                    eval_sum += loss_sum_of(parts[0], batch.inputs, batch.labels)
            eval_count += (batch.labels != IGNORE_INDEX).sum()
        totals = torch.stack([eval_sum, eval_count])
        dist.all_reduce(totals, group=dp_cp_group)
        return (totals[0] / totals[1]).item()

    losses, norms, evals = [], [], []
    for step in range(1, t.steps + 1):
        batch = loader.next_batch()
        inputs, labels = batch.inputs, batch.labels
        num_tokens = (labels != IGNORE_INDEX).sum()
        dist.all_reduce(num_tokens, group=dp_cp_group)
        scale = dims.dp_cp / num_tokens.clamp(min=1)
        if pipe is not None:
            loss_sum = pipe.step(inputs if pipe.has_first_stage else None, labels, loss_scale=scale)
        else:
            (m,) = parts
            accum = dims.grad_accum_steps(t.global_batch_size, t.micro_batch_size)
            loss_sum = torch.zeros(())
            for mi, ml in zip(inputs.chunk(accum), labels.chunk(accum)):
                micro = loss_sum_of(m, mi, ml)
                (micro * scale).backward()
                loss_sum += micro.detach()
            finish = getattr(m, "finish_gradient_sync", None)
            if finish is not None:
                finish()
        params = [q for part in parts for q in part.parameters()]
        norm = clip_grad_norm_(params, t.grad_clip, pp_mesh=pp_mesh)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        dist.all_reduce(loss_sum, group=dp_cp_group)
        losses.append((loss_sum / num_tokens).item())
        norms.append(norm.item())
        if step % EVAL_EVERY == 0:  # mid-run too: training after an evaluation must be unaffected by it
            evals.append(evaluate())
    # A DCP checkpoint of the parts under their own (global) names: layout independent.
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    state: dict = {}
    for part in parts:
        state.update(get_model_state_dict(getattr(part, "module", part)))  # strip DDP
    ckpt = os.path.join(cfg.job.dump_folder, f"ckpt-{name}")
    dcp.save({"model": state}, checkpoint_id=ckpt)
    keys = sorted({k for part in parts for k in part.state_dict()})
    return {"losses": losses, "norms": norms, "evals": evals, "keys": keys, "ckpt": ckpt}


def _run_cases(rank: int, world_size: int, cases: dict[str, TrainConfig]) -> dict[str, dict]:
    out = {}
    for name, cfg in cases.items():
        out[name] = _train(cfg, world_size, name)
    return out


# --------------------------------------------------------------------------------------------
# Parity
# --------------------------------------------------------------------------------------------


def _cfg(tmp: str, *overrides: str) -> TrainConfig:
    return tiny_config(tmp, PARITY_STEPS, "parallelism.dp_shard=1", *overrides)


# 2 ranks, pp=2: every schedule the installed torch has (4 blocks; interleaved ones get 4
# virtual stages of one block each).
SCHEDULE_CASES = {
    "GPipe": ("parallelism.pp_schedule=GPipe",),
    "1F1B": ("parallelism.pp_schedule=1F1B",),
    "Interleaved1F1B_noclip": (
        "parallelism.pp_schedule=Interleaved1F1B",
        "parallelism.pp_stages_per_rank=2",
        NO_CLIP,
    ),
    "LoopedBFS": ("parallelism.pp_schedule=LoopedBFS", "parallelism.pp_stages_per_rank=2"),
    "InterleavedZeroBubble": (
        "parallelism.pp_schedule=InterleavedZeroBubble",
        "parallelism.pp_stages_per_rank=2",
    ),
    "ZBVZeroBubble_noclip": (
        "parallelism.pp_schedule=ZBVZeroBubble",
        "parallelism.pp_stages_per_rank=2",
        NO_CLIP,
    ),
    # Activation checkpointing under the split (B then W) backward of zero bubble.
    "ZBVZeroBubble_ac_full": (
        "parallelism.pp_schedule=ZBVZeroBubble",
        "parallelism.pp_stages_per_rank=2",
        "training.activation_checkpoint=full",
    ),
}
# 4 ranks: pp=2 composed with a data-parallel or tensor-parallel axis.
COMPOSED_CASES = {
    "pp2_fsdp2_noclip": ("parallelism.dp_shard=2", "parallelism.pp_schedule=1F1B", NO_CLIP),
    # Zero-bubble's split weight-gradient pass under FSDP (needs the head as its own FSDP unit).
    "pp2_fsdp2_zbv": (
        "parallelism.dp_shard=2",
        "parallelism.pp_schedule=ZBVZeroBubble",
        "parallelism.pp_stages_per_rank=2",
    ),
    "pp2_tp2": ("parallelism.tp=2", "parallelism.pp_schedule=1F1B"),
    "pp2_ddp2_noclip": ("parallelism.dp_replicate=2", "parallelism.pp_schedule=1F1B", NO_CLIP),
}


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[str, dict]:
    """The harness without PP, clipped ("clip") and unclipped ("noclip"), in one launch."""
    tmp = str(tmp_path_factory.mktemp("ref"))
    (result,) = run_distributed(_run_cases, 1, {"clip": _cfg(tmp), "noclip": _cfg(tmp, NO_CLIP)})
    for ref in result.values():
        assert len(ref["losses"]) == 4 and len(ref["evals"]) == 2 and ref["losses"][-1] < ref["losses"][0]
    return result


def _reference_of(name: str, reference: dict[str, dict]) -> dict:
    return reference["noclip" if name.endswith("_noclip") else "clip"]


def _run_pp_cases(
    tmp: str, cases: dict[str, list[str]], *, world_size: int, timeout: int
) -> dict[str, list[dict]]:
    """Run every PP×2 case (name -> overrides) in one process group; results per case, per rank."""
    cfgs = {name: _cfg(tmp, "parallelism.pp=2", *ov) for name, ov in cases.items()}
    per_rank = run_distributed(_run_cases, world_size, cfgs, timeout=timeout)
    return {name: [r[name] for r in per_rank] for name in cfgs}


@pytest.fixture(scope="module")
def schedule_results(tmp_path_factory) -> dict[str, list[dict]]:
    cases = {name: ov for name, ov in SCHEDULE_CASES.items() if name.split("_")[0] in SCHEDULES}
    return _run_pp_cases(str(tmp_path_factory.mktemp("pp")), cases, world_size=2, timeout=400)


def _evals(result: dict) -> list[dict]:
    return [{"step": EVAL_EVERY * (i + 1), "loss": e} for i, e in enumerate(result["evals"])]


def _check(name: str, results: list[dict], reference: dict) -> None:
    got = results[0]
    worst = assert_parity(
        history_from(reference["losses"], reference["norms"]),
        history_from(got["losses"], got["norms"]),
        label=name,
    )
    evals = assert_parity(_evals(reference), _evals(got), metrics=("loss",), label=f"{name} eval")
    worst["eval"] = evals["loss"]
    print(
        f"{name}: max relative difference vs 1 process: "
        + ", ".join(f"{k} {v:.2e}" for k, v in worst.items())
    )
    for r in results[1:]:  # every rank reports the same losses, norms and eval losses
        assert (r["losses"], r["norms"], r["evals"]) == (
            results[0]["losses"],
            results[0]["norms"],
            results[0]["evals"],
        )
    # The model really is split: no rank holds all of it, together they hold all of it, under
    # the single-process names (layout-independent checkpoint keys).
    keys = [set(r["keys"]) for r in results]
    assert set().union(*keys) == set(reference["keys"]) and all(k != set(reference["keys"]) for k in keys)
    # Its checkpoint loads into one plain model and holds the single-process run's weights.
    got, want = _load_full(results[0]["ckpt"]), _load_full(reference["ckpt"])
    diff = max((got[k] - want[k]).abs().max().item() for k in want)
    print(f"{name}: checkpoint loads into 1 process; max |weight diff| vs 1 process = {diff:.1e}")
    assert diff < PARAM_ATOL


def _load_full(path: str) -> dict[str, torch.Tensor]:
    """A DCP checkpoint written by any layout, loaded into a plain single-process model."""
    import warnings

    import torch.distributed.checkpoint as dcp

    from tests.configs import TINY, make_config

    state = {k: torch.zeros_like(v) for k, v in Transformer(make_config(*TINY).model).state_dict().items()}
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load({"model": state}, checkpoint_id=path, no_dist=True)
    return state


@pytest.mark.slow
@pytest.mark.parametrize("name", list(SCHEDULE_CASES))
def test_schedule_matches_single_process(name: str, schedule_results: dict, reference: dict) -> None:
    if name not in schedule_results:
        pytest.skip(f"torch {torch.__version__} has no {name} schedule")
    _check(name, schedule_results[name], _reference_of(name, reference))


@pytest.fixture(scope="module")
def composed_results(tmp_path_factory) -> dict[str, list[dict]]:
    cases = {
        name: ov
        for name, ov in COMPOSED_CASES.items()
        if "ZBVZeroBubble" not in " ".join(ov) or "ZBVZeroBubble" in SCHEDULES
    }
    return _run_pp_cases(str(tmp_path_factory.mktemp("pp_composed")), cases, world_size=4, timeout=600)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(COMPOSED_CASES))
def test_composed_layout_matches_single_process(name: str, composed_results: dict, reference: dict) -> None:
    if name not in composed_results:
        pytest.skip(f"torch {torch.__version__} lacks the schedule of {name}")
    _check(name, composed_results[name], _reference_of(name, reference))


# --------------------------------------------------------------------------------------------
# Splitting and validation (no process group)
# --------------------------------------------------------------------------------------------


def _blocks(names: list[list[str]]) -> list[int]:
    return [sum(n.startswith("layers.") for n in stage) for stage in names]


def test_default_split_puts_one_block_fewer_on_first_and_last() -> None:
    names = stage_module_names(32, 4, None)
    assert _blocks(names) == [7, 9, 9, 7]
    assert names[0][0] == "tok_embeddings" and names[-1][-2:] == ["norm", "output"]
    assert _blocks(stage_module_names(126, 16, None)) == [7] + [8] * 14 + [7]  # 405B on 16 stages
    assert _blocks(stage_module_names(8, 2, None)) == [4, 4]
    assert _blocks(stage_module_names(9, 2, None)) == [5, 4]
    # Too few layers for the lighter ends: spread evenly, remainder to the middle.
    assert _blocks(stage_module_names(4, 4, None)) == [1, 1, 1, 1]
    assert _blocks(stage_module_names(5, 4, None)) == [1, 2, 1, 1]
    assert stage_module_names(3, 1, None) == [
        ["tok_embeddings", "layers.0", "layers.1", "layers.2", "norm", "output"]
    ]
    # Every block exactly once, in order.
    for n_layers, k in ((32, 4), (126, 16), (7, 3), (10, 8)):
        flat = [n for s in stage_module_names(n_layers, k, None) for n in s if n.startswith("layers.")]
        assert flat == [f"layers.{i}" for i in range(n_layers)]


def test_explicit_layers_per_stage() -> None:
    assert _blocks(stage_module_names(8, 4, 2)) == [2, 2, 2, 2]
    with pytest.raises(ConfigError, match="pp_layers_per_stage=3 x 4 stages != model.n_layers=8"):
        stage_module_names(8, 4, 3)
    with pytest.raises(ConfigError, match="model.n_layers=2 < 4 pipeline stages"):
        stage_module_names(2, 4, None)


def test_stage_ids_loop_and_v() -> None:
    assert [stage_ids_of_rank(r, 4, 2, "loop") for r in range(4)] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert [stage_ids_of_rank(r, 4, 2, "v") for r in range(4)] == [[0, 7], [1, 6], [2, 5], [3, 4]]
    from torch.distributed.pipelining._utils import generate_stage_to_rank_mapping

    v = generate_stage_to_rank_mapping(4, 8, style="v")
    assert all(v[s] == r for r in range(4) for s in stage_ids_of_rank(r, 4, 2, "v"))


def test_parts_keep_global_keys_and_cover_the_model() -> None:
    """Stages are the meta model minus what they do not own; the union of their state-dict keys
    is the whole model's, so checkpoints are layout independent."""
    with torch.device("meta"):
        model = Transformer(LlamaArgs(dim=64, n_layers=5, n_heads=4, vocab_size=128))
    names = stage_module_names(5, 3, None)
    parts = [_build_part(model, LLAMA_SPEC, n) for n in names]
    keys = [set(p.state_dict()) for p in parts]
    assert set().union(*keys) == set(model.state_dict()) and sum(map(len, keys)) == len(model.state_dict())
    assert parts[0].output is None and parts[1].tok_embeddings is None and parts[2].norm is not None
    assert list(parts[1].layers) == [n.split(".")[1] for n in names[1]]
    assert all(p.is_meta for part in parts for p in part.parameters())  # nothing materialised


def _validate(
    *, n_layers: int = 8, tie: bool = False, pp: int = 2, local: int = 8, micro: int = 2, **kw
) -> None:
    args = LlamaArgs(dim=64, n_layers=n_layers, n_heads=4, vocab_size=128, tie_embeddings=tie)
    validate_pp(args, ParallelismConfig(pp=pp, **kw), pp=pp, local_batch_size=local, micro_batch_size=micro)


@pytest.mark.parametrize(
    "kw,needle",
    [
        ({"pp_schedule": "Pipedream"}, "pp_schedule='Pipedream' is not a known pipeline schedule"),
        ({"tie": True}, "tie_embeddings=true cannot be pipelined"),
        (
            {"pp_schedule": "1F1B", "pp_stages_per_rank": 2},
            "pp_stages_per_rank=2 does not fit parallelism.pp_schedule=1F1B, which needs 1 virtual stages",
        ),
        (
            {"pp_schedule": "Interleaved1F1B", "pp_stages_per_rank": 1},
            "pp_stages_per_rank=1 .*Interleaved1F1B, which needs 2 or more .* or null to use that default",
        ),
        ({"pp_schedule": "ZBVZeroBubble", "pp_stages_per_rank": 3}, "=3 .*ZBVZeroBubble, which needs 2 "),
        ({"pp_schedule": "Interleaved1F1B", "pp_stages_per_rank": 2, "n_layers": 3}, "n_layers=3 < 4"),
        ({"pp_layers_per_stage": 3}, "pp_layers_per_stage=3 x 2 stages"),
        ({"pp": 4, "micro": 4}, "2 pipeline microbatches .* fewer than parallelism.pp=4"),
        ({"pp_microbatches": 3}, "pp_microbatches=3 does not divide the local batch of 8"),
        ({"micro": 3}, "not divisible by training.micro_batch_size=3"),
        (
            {"pp_schedule": "Interleaved1F1B", "pp_stages_per_rank": 2, "pp_microbatches": 5, "local": 10},
            "multiple of the number of rounds",
        ),
        ({"pp_module_names": [["tok_embeddings", "layers.1"], ["layers.0"]]}, "pp_module_names must be 2"),
    ],
)
def test_validate_pp_errors(kw: dict, needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        _validate(**kw)


def test_validate_pp_accepts_good_layouts() -> None:
    _validate()  # 1F1B, 4 microbatches of 2
    _validate(pp_schedule="Interleaved1F1B")  # unset stages per rank: 2 for the interleaved schedules
    assert stages_per_rank(ParallelismConfig(pp_schedule="Interleaved1F1B")) == 2
    assert stages_per_rank(ParallelismConfig(pp_schedule="1F1B")) == 1
    _validate(pp=1, tie=True, pp_stages_per_rank=5)  # PP off: nothing to check
    _validate(pp_schedule="gpipe")  # names are case-insensitive, like torch's
    for name in SCHEDULES:
        v = 1 if name in ("GPipe", "1F1B") else 2
        _validate(pp_schedule=name, pp_stages_per_rank=v)
    names = [
        ["tok_embeddings", *(f"layers.{i}" for i in range(3))],
        [*(f"layers.{i}" for i in range(3, 8)), "norm", "output"],
    ]
    _validate(pp_module_names=names)


@pytest.mark.parametrize("world", [2, 4])
def test_debug_pp_preset_validates_on_2_and_4_ranks(world: int) -> None:
    from tests.configs import make_config

    cfg = make_config("+experiment=debug_pp")
    p, t = cfg.parallelism, cfg.training
    validated_dims(
        p,
        world,
        spec=LLAMA_SPEC,
        model_args=cfg.model,
        seq_len=t.seq_len,
        global_batch_size=t.global_batch_size,
        micro_batch_size=t.micro_batch_size,
    )


def test_405b_4d_split_is_balanced() -> None:
    from tests.configs import make_config

    cfg = make_config("+experiment=405b_4d")
    p = cfg.parallelism
    names = stage_module_names(cfg.model.n_layers, p.pp * stages_per_rank(p), p.pp_layers_per_stage)
    assert _blocks(names) == [3] + [4] * 30 + [3]


def test_zero_bubble_with_compile_is_rejected() -> None:
    args = LlamaArgs(dim=64, n_layers=8, n_heads=4, vocab_size=128)
    for name in ("InterleavedZeroBubble", "ZBVZeroBubble"):
        cfg = ParallelismConfig(pp=2, pp_schedule=name, pp_stages_per_rank=2)
        with pytest.raises(ConfigError, match="training.compile=false"):
            validate_pp(args, cfg, pp=2, local_batch_size=8, micro_batch_size=2, compile=True)
    validate_pp(args, ParallelismConfig(pp=2), pp=2, local_batch_size=8, micro_batch_size=2, compile=True)
