"""Checkpoint folder rules, clear errors for bad checkpoints, Hugging Face round trip, seed
checkpoints and generation.

The multi-process parts are grouped into few spawned process groups (each costs seconds):
one single-process group trains the runs that are exported and writes a seed checkpoint, one
2-rank FSDP group exercises every bad-checkpoint error and the two ways to start from
foreign weights (a Hugging Face folder, a seed checkpoint).
"""

from __future__ import annotations

import json
import math
import os
import shutil

import pytest
import torch
import torch.distributed as dist

from models.errors import ConfigError
from models.llama import LlamaHF
from tests.configs import tiny_config
from tests.dist import run_distributed
from trainer.checkpoint.checkpointer import complete_steps, load_full_state
from trainer.checkpoint.hf import read_hf
from trainer.checkpoint.seed import validate_checkpoint_config
from trainer.checkpoint.storage import remove_leftovers

# -- folder rules and config validation (no processes) -----------------------------------


def test_only_marked_step_folders_count_and_leftovers_are_removed(tmp_path) -> None:
    for name in ("step-2", "step-4", "step-10", "step-6", "step-8.tmp-ab12", "step-4.trash-cd34", "notes"):
        (tmp_path / name).mkdir()
    for name in ("step-2", "step-4", "step-10"):
        (tmp_path / name / "checkpoint.json").write_text("{}")
    assert complete_steps(str(tmp_path)) == [2, 4, 10]  # numeric order; step-6 has no marker
    assert remove_leftovers(str(tmp_path)) == ["step-4.trash-cd34", "step-8.tmp-ab12"]
    assert sorted(os.listdir(tmp_path)) == ["notes", "step-10", "step-2", "step-4", "step-6"]
    assert complete_steps(str(tmp_path / "missing")) == []


@pytest.mark.parametrize(
    "overrides,needle",
    [
        (("checkpoint.keep_latest=1",), "keep_latest=1"),
        (("checkpoint.load_step=-2",), "load_step=-2"),
        (("checkpoint.load_step=3",), "checkpoint.enable=false"),
        (("checkpoint.async_mode=sometimes",), "async_mode"),
        (("checkpoint.initial_load_path=/a", "checkpoint.initial_load_hf=/b"), "only one"),
    ],
)
def test_bad_checkpoint_config(tmp_path, overrides, needle) -> None:
    with pytest.raises(ConfigError, match=needle):
        tiny_config(str(tmp_path), *overrides)


def test_seed_checkpoint_needs_one_process(tmp_path) -> None:
    cfg = tiny_config(str(tmp_path), "checkpoint.create_seed=true")
    with pytest.raises(ConfigError, match="one process, but the world size is 2"):
        validate_checkpoint_config(cfg.checkpoint, 2)


@pytest.mark.parametrize(
    "degrees",
    [
        dict(dp_replicate=2, dp_shard=1),  # DDP
        dict(dp_replicate=2, dp_shard=1, cp=2),  # DDP over dp_replicate x cp
        dict(dp_replicate=2, dp_shard=2),  # HSDP
        dict(dp_shard=4),  # FSDP
        dict(dp_shard=1, cp=4),  # cp alone: FSDP over cp
        dict(dp_shard=1),  # one process
    ],
)
def test_marker_layout_names_ddp_options_exactly_when_ddp_runs(degrees: dict) -> None:
    """The marker's layout reads whether DDP runs from ``ParallelDims.ddp_enabled``, no copy of the rule."""
    from parallelisms.config import ParallelismConfig
    from parallelisms.parallel_dims import ParallelDims
    from trainer.checkpoint.contents import describe_layout

    dims = ParallelDims(**degrees, world_size=math.prod(degrees.values()))
    layout = describe_layout(dims, ParallelismConfig(**degrees))
    assert ("ddp" in layout) == ("sharded_optimizer" in layout) == dims.ddp_enabled
    assert {k: layout[k] for k in degrees} == degrees


def test_hf_names_round_trip() -> None:
    from models.llama import Transformer

    with torch.device("meta"):
        model = Transformer(tiny_config("/tmp/unused").model)
    names = list(model.state_dict())
    adapter = LlamaHF()
    hf = [adapter.hf_names_of(n)[0] for n in names]
    assert "model.layers.3.mlp.gate_proj.weight" in hf and "lm_head.weight" in hf
    assert [adapter.from_hf_name(n) for n in hf] == names
    with pytest.raises(ConfigError, match="bias"):
        adapter.from_hf_name("model.layers.0.self_attn.q_proj.bias")


# -- spawned runs ----------------------------------------------------------------------


def _train_runs(rank: int, world_size: int, tmp: str) -> None:
    """Runs whose checkpoints the tests below read (one process)."""
    from trainer.train import Trainer

    runs = {
        "src": ("checkpoint.interval=2", "training.steps=4"),
        "tied": ("model.tie_embeddings=true", "model.rope_theta=50000", "training.steps=2"),
        "seed": ("checkpoint.create_seed=true", "training.seed=7"),
        "untied": ("model.rope_theta=50000", "training.steps=2"),
    }
    for name, overrides in runs.items():
        trainer = Trainer(tiny_config(os.path.join(tmp, name), "checkpoint.enable=true", *overrides))
        trainer.train()
        trainer.close()


def _full_model(trainer) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    from trainer.checkpoint.contents import ModelState

    sd = ModelState(trainer.model_parts).state_dict()
    return {
        k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone() for k, v in sorted(sd.items())
    }


def _error_of(cfg) -> str:
    from trainer.train import Trainer

    try:
        trainer = Trainer(cfg)
    except ConfigError as e:
        return str(e)
    trainer.close()
    return "no error"


def _bad_checkpoints(rank: int, world_size: int, tmp: str, hf_dir: str) -> dict:
    """Every bad-checkpoint error on 2 FSDP ranks, then the two foreign-weight starts."""
    src = os.path.join(tmp, "src", "checkpoints")
    fsdp = ("parallelism.dp_shard=2", "checkpoint.enable=true")

    def copy(name: str, damage) -> str:
        dump = os.path.join(tmp, name)
        if rank == 0:
            shutil.copytree(src, os.path.join(dump, "checkpoints"))
            damage(os.path.join(dump, "checkpoints", "step-4"))
        dist.barrier()
        return dump

    def truncate(path: str) -> None:
        with open(os.path.join(path, "__0_0.distcp"), "r+b") as f:
            f.truncate(1000)

    def flip(path: str) -> None:
        file = os.path.join(path, "__0_0.distcp")
        with open(file, "r+b") as f:
            f.seek(os.path.getsize(file) // 2)
            data = f.read(8)
            f.seek(-8, os.SEEK_CUR)
            f.write(bytes(b ^ 0xFF for b in data))

    def garbage_metadata(path: str) -> None:
        file = os.path.join(path, ".metadata")
        size = os.path.getsize(file)
        with open(file, "wb") as f:
            f.write(b"\x00garbage" * (size // 8) + b"\x00" * (size % 8))
        # Keep the recorded CRC consistent, so the unreadable pickle itself is what is caught.
        marker = os.path.join(path, "checkpoint.json")
        info = json.load(open(marker))
        info.pop("crc32")
        json.dump(info, open(marker, "w"))

    errors = {
        "missing_step": _error_of(
            tiny_config(copy("missing", lambda p: None), *fsdp, "checkpoint.load_step=3")
        ),
        "truncated": _error_of(tiny_config(copy("truncated", truncate), *fsdp)),
        "bit_flip": _error_of(tiny_config(copy("flip", flip), *fsdp)),
        "bad_metadata": _error_of(tiny_config(copy("meta", garbage_metadata), *fsdp)),
        "no_marker_asked": _error_of(
            tiny_config(
                copy("nomark", lambda p: os.remove(os.path.join(p, "checkpoint.json"))),
                *fsdp,
                "checkpoint.load_step=4",
            )
        ),
        "other_model_dim": _error_of(
            tiny_config(copy("dim", lambda p: None), *fsdp, "model.ffn_hidden_dim=192")
        ),
        "other_model_depth": _error_of(tiny_config(copy("depth", lambda p: None), *fsdp, "model.n_layers=2")),
        "batch_change": _error_of(
            tiny_config(copy("batch", lambda p: None), *fsdp, "training.global_batch_size=24")
        ),
        "initial_missing": _error_of(
            tiny_config(
                os.path.join(tmp, "init"), *fsdp, f"checkpoint.initial_load_path={tmp}/nowhere/step-4"
            )
        ),
        "hf_missing": _error_of(
            tiny_config(os.path.join(tmp, "hf"), *fsdp, f"checkpoint.initial_load_hf={tmp}")
        ),
    }

    from trainer.train import Trainer

    # A marker-less newest checkpoint is ignored (an interrupted save): resume from step 2.
    trainer = Trainer(tiny_config(os.path.join(tmp, "nomark"), *fsdp))
    errors["nomark_resumed_step"] = trainer.state.step
    trainer.close()
    # Start from exported Hugging Face weights under FSDP.
    trainer = Trainer(
        tiny_config(
            os.path.join(tmp, "from_hf"),
            *fsdp,
            "model.rope_theta=50000",
            f"checkpoint.initial_load_hf={hf_dir}",
        )
    )
    from_hf = _full_model(trainer)
    trainer.close()
    # Start from the seed checkpoint (written with training.seed=7) under FSDP with seed 0.
    seed_dump = os.path.join(tmp, "seed_run")
    if rank == 0:
        shutil.copytree(os.path.join(tmp, "seed", "checkpoints"), os.path.join(seed_dump, "checkpoints"))
    dist.barrier()
    trainer = Trainer(tiny_config(seed_dump, *fsdp, "training.steps=2"))
    from_seed, seed_step = _full_model(trainer), trainer.state.step
    history = trainer.train()
    trainer.close()
    return {
        "errors": errors,
        "from_hf": from_hf,
        "from_seed": from_seed,
        "seed_step": seed_step,
        "seed_losses": [r["loss"] for r in history if "loss" in r],
    }


def _logits(model, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(tokens)


@pytest.mark.slow
def test_checkpoint_errors_hf_round_trip_seed_and_generation(tmp_path, capsys) -> None:
    tmp = str(tmp_path)
    run_distributed(_train_runs, 1, tmp)

    # -- Hugging Face export -> transformers -> logits, sharded and tied variants.
    from trainer.checkpoint.load import load_model
    from trainer.export_hf import export
    from trainer.export_hf import main as export_main
    from trainer.generate import main as generate_main

    step2 = os.path.join(tmp, "untied", "checkpoints", "step-2")
    hf_dir = os.path.join(tmp, "hf_untied")
    assert export_main([step2, hf_dir]) == 0
    ours, tokenizer = load_model(step2)
    tokens = torch.randint(0, 512, (2, 40), generator=torch.Generator().manual_seed(0))
    ref = _logits(ours, tokens)
    _, args, state = read_hf(hf_dir)
    assert args.rope_theta == 50000
    want = load_full_state(step2, "model.")
    assert state.keys() == want.keys() and all(torch.equal(state[k], want[k]) for k in want)  # import back

    sharded_dir = os.path.join(tmp, "hf_sharded")
    files = export(step2, sharded_dir, max_shard_size="200KB")
    assert "model.safetensors.index.json" in files and sum(f.endswith(".safetensors") for f in files) > 2
    tied_step = os.path.join(tmp, "tied", "checkpoints", "step-2")
    tied_dir = os.path.join(tmp, "hf_tied")
    export(tied_step, tied_dir)
    assert not any(k == "lm_head.weight" for k in _safetensor_keys(tied_dir))

    transformers = pytest.importorskip("transformers", reason="transformers (the dev extra) is not installed")
    for path, check, ours_model in (
        (hf_dir, ref, None),
        (sharded_dir, ref, None),
        (tied_dir, None, tied_step),
    ):
        hf = transformers.LlamaForCausalLM.from_pretrained(path).eval()
        expected = check if check is not None else _logits(load_model(ours_model)[0], tokens)
        got = _logits(hf, tokens).logits
        assert torch.allclose(got, expected, rtol=1e-4, atol=1e-4), (path, (got - expected).abs().max())
    assert hf.config.tie_word_embeddings

    # -- generation: from the checkpoint and from the HF folder, same seed -> same tokens.
    from models.generation import generate

    hf_ours, hf_tokenizer = load_model(hf_dir)
    prompt = [tokenizer.bos_id, *tokenizer.encode("def ")]
    samples = [
        generate(
            m,
            prompt,
            max_new_tokens=12,
            temperature=0.8,
            top_k=20,
            generator=torch.Generator().manual_seed(3),
        )
        for m in (ours, hf_ours)
    ]
    assert samples[0] == samples[1] and len(samples[0]) > len(prompt)
    assert hf_tokenizer is not None and hf_tokenizer.eos_id == tokenizer.eos_id
    capsys.readouterr()
    assert generate_main([hf_dir, "--prompt", "def ", "--max-new-tokens", "12", "--temperature", "0"]) == 0
    assert capsys.readouterr().out.startswith("def ")

    # -- bad checkpoints, and starting from HF / seed weights, on 2 FSDP ranks.
    results = run_distributed(_bad_checkpoints, 2, tmp, hf_dir)
    errors = results[0]["errors"]
    assert results[1]["errors"] == errors  # every rank raises the same error
    expect = {
        "missing_step": ["load_step=3", "[2, 4]"],
        "truncated": ["__0_0.distcp has 1000 bytes"],
        "bit_flip": ["__0_0.distcp does not match its CRC32"],
        "bad_metadata": [".metadata cannot be read"],
        "no_marker_asked": ["load_step=4", "incomplete", "[2]"],
        "other_model_dim": ["layers.0.feed_forward.w1.weight", "[128, 64]", "[192, 64]"],
        "other_model_depth": ["layers.2.", "that this model lacks"],
        "batch_change": ["32 samples", "global_batch_size=24"],
        "initial_missing": ["nowhere/step-4 does not exist"],
        "hf_missing": ["has no config.json"],
    }
    for case, needles in expect.items():
        print(f"{case}: {errors[case]}")
        for needle in needles:
            assert needle in errors[case], (case, errors[case])
    assert errors["nomark_resumed_step"] == 2
    r = results[0]
    assert all(torch.equal(r["from_hf"][k], want[k]) for k in want)
    seed = load_full_state(os.path.join(tmp, "seed", "checkpoints", "step-0"), "model.")
    assert r["seed_step"] == 0 and r["from_seed"].keys() == seed.keys()
    assert all(torch.equal(r["from_seed"][k], seed[k]) for k in seed)
    assert len(r["seed_losses"]) == 2


def _safetensor_keys(path: str) -> list[str]:
    from safetensors import safe_open

    with safe_open(os.path.join(path, "model.safetensors"), "pt") as f:
        return list(f.keys())
