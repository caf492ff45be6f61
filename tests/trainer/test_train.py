"""The Trainer loop: accumulation, loss normalisation, the non-finite stop, evaluation, run folder."""

from __future__ import annotations

import json

import pytest
from omegaconf import OmegaConf

from tests.configs import NO_CLIP, tiny_config
from tests.dist import run_distributed
from tests.parity import Case, assert_parallel_run, gather_cases, step_metrics
from trainer.config import TrainConfig, to_train_config

pytestmark = pytest.mark.slow


def _train(rank: int, world_size: int, cfg: TrainConfig) -> list[dict]:
    from trainer.train import Trainer

    trainer = Trainer(cfg)
    try:
        return trainer.train()
    finally:
        trainer.close()


def _train_expect_error(rank: int, world_size: int, cfg: TrainConfig) -> str:
    from trainer.train import Trainer, TrainingError

    trainer = Trainer(cfg)
    try:
        trainer.train()
    except TrainingError as e:
        return f"step={trainer.state.step} {e}"
    finally:
        trainer.close()
    return "no error"


def test_accumulation_matches_one_big_microbatch(tmp_path) -> None:
    """global 8 as 4 microbatches of 2 == one microbatch of 8 (loss normalised by global tokens):
    losses, pre-clip grad norms and weights, with clipping off (a per-microbatch normalisation
    error scales the gradient by the accumulation count; only the grad norm sees that)."""
    runs = gather_cases(
        {
            "accumulated": Case(1, tiny_config(str(tmp_path / "a"), "training.micro_batch_size=2", NO_CLIP)),
            "one_microbatch": Case(
                1, tiny_config(str(tmp_path / "b"), "training.micro_batch_size=8", NO_CLIP)
            ),
        },
        world=1,
    )
    assert len(step_metrics(runs["accumulated"]["history"])) == 8
    assert_parallel_run(runs["one_microbatch"], runs["accumulated"], label="grad accumulation 4 x 2 vs 1 x 8")


def test_non_finite_loss_stops_every_rank_before_the_step(tmp_path) -> None:
    cfg = tiny_config(
        str(tmp_path),
        "optimizer.lr=1e30",
        "lr_scheduler.warmup_steps=0",
        "training.grad_clip=0",
        "parallelism.dp_shard=2",
    )
    messages = run_distributed(_train_expect_error, 2, cfg)
    for msg in messages:
        assert "non-finite gradient" in msg and "at step 2" in msg and "nothing was applied" in msg, msg
    assert messages[0] == messages[1]  # both ranks stopped at the same step


def test_run_folder_config_and_eval(tmp_path) -> None:
    cfg = tiny_config(
        str(tmp_path),
        "training.eval_freq=4",
        "training.eval_steps=2",
        "metrics.log_freq=4",
        "data.val_fraction=0.05",
    )
    (history,) = run_distributed(_train, 1, cfg)
    evals = [r for r in history if "eval_loss" in r]
    assert [r["step"] for r in evals] == [4, 8]
    assert all(r["eval_loss"] > 0 and r["eval_tokens"] == 2 * 2 * 32 for r in evals)
    # config.yaml is the resolved config and reproduces the run's config.
    saved = OmegaConf.load(tmp_path / "config.yaml")
    assert to_train_config(saved) == cfg
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in lines] == [r["step"] for r in history]


def record_dtypes(trainer) -> dict:  # noqa: ANN001
    """Test hook: the dtypes of the first attention projection's input, weight and output, as
    seen inside the forward (under FSDP2 the weight is then the unsharded parameter)."""
    seen: dict = {}
    wq = getattr(trainer.model, "module", trainer.model).layers["0"].attention.wq

    def hook(module, inputs, output) -> None:  # noqa: ANN001
        seen.update(input=str(inputs[0].dtype), weight=str(module.weight.dtype), output=str(output.dtype))

    wq.register_forward_hook(hook)
    return seen


def test_bf16_is_in_effect_and_tracks_fp32(tmp_path) -> None:
    """bf16 autocast (single process) and FSDP2 bf16 parameters really compute in bf16 (dtypes seen
    inside the forward; losses measurably different from fp32) and follow the fp32 loss curve."""
    single = gather_cases(
        {
            "fp32": Case(1, tiny_config(str(tmp_path / "fp32")), setup=record_dtypes, params=False),
            "amp": Case(
                1,
                tiny_config(str(tmp_path / "amp"), "training.mixed_precision=bf16"),
                setup=record_dtypes,
                params=False,
            ),
        },
        world=1,
    )
    fsdp_cfg = tiny_config(
        str(tmp_path / "fsdp"), "parallelism.dp_shard=2", "parallelism.fsdp.param_dtype=bfloat16"
    )
    fsdp = gather_cases({"fsdp": Case(2, fsdp_cfg, setup=record_dtypes, params=False)}, world=2)["fsdp"]
    fp32 = "torch.float32"
    bf16 = "torch.bfloat16"
    assert single["fp32"]["observed"] == [{"input": fp32, "weight": fp32, "output": fp32}]
    # Autocast: fp32 master weights and residual stream, the matmul in bf16.
    assert single["amp"]["observed"] == [{"input": fp32, "weight": fp32, "output": bf16}]
    # FSDP2 param_dtype=bfloat16: the unsharded weights and the activations are bf16 on every rank.
    assert fsdp["observed"] == [{"input": bf16, "weight": bf16, "output": bf16}] * 2
    ref = step_metrics(single["fp32"]["history"])
    for name, run in (("autocast", single["amp"]), ("fsdp_bf16", fsdp)):
        got = step_metrics(run["history"])
        assert sorted(got) == sorted(ref) and got[8]["loss"] < got[1]["loss"]
        rel = max(abs(got[s]["loss"] - ref[s]["loss"]) / ref[s]["loss"] for s in ref)
        print(f"{name}: max relative loss difference vs fp32 {rel:.2e}")
        assert 1e-5 < rel < 0.02, (name, rel)  # bf16 rounding is visible (fp32 layouts agree to ~1e-7)
