"""Hugging Face interop beyond the plain round trip (``test_checkpoint.py``): scaled RoPE both
ways against ``transformers``, sharded loading that reads only each rank's share, and the
final weights saved as a HF folder by a running job (``checkpoint.last_save_in_hf``).

``transformers`` models are built offline with random weights; nothing is downloaded.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import re
import threading
import time

import pytest
import torch

from models.common import RopeScaling, rope_inv_freq
from models.errors import ConfigError
from models.llama import LlamaHF
from tests.configs import make_config, tiny_config
from tests.dist import run_distributed
from trainer.checkpoint.hf import read_hf, save_hf

transformers = pytest.importorskip("transformers", reason="transformers (the dev extra) is not installed")

# head_dim 16, theta 1e4: wavelengths 6.3, 19.9, 62.8, 199, ... tokens. With an original context
# of 64 and frequency factors 1 / 4, llama3 keeps the first, interpolates the next two and divides
# the rest by ``factor``: every band of the rule is exercised at positions up to a few hundred.
ROPE = {
    "llama3": {
        "rope_type": "llama3",
        "rope_theta": 10000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    },
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
}


def _hf_config(kind: str) -> transformers.LlamaConfig:
    """A small untied GQA Llama; initializer_range 0.1 makes attention sharp enough that a wrong
    rotation changes the logits by far more than the tolerance."""
    return transformers.LlamaConfig(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rope_parameters=dict(ROPE[kind]),
        tie_word_embeddings=False,
        initializer_range=0.1,
    )


@pytest.mark.parametrize("kind", ["llama3", "linear"])
def test_rope_frequencies_match_transformers(kind: str) -> None:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = _hf_config(kind)
    want, attention_factor = ROPE_INIT_FUNCTIONS[kind](config, "cpu")
    args = LlamaHF().args_from_hf_config(config.to_dict())
    scaling = RopeScaling(**args["rope_scaling"])
    ours = rope_inv_freq(16, args["rope_theta"], scaling)
    assert attention_factor == 1.0  # cos/sin are not rescaled for these types
    torch.testing.assert_close(ours.float(), want, rtol=1e-6, atol=0)  # HF computes in fp32, we in fp64
    ratio = rope_inv_freq(16, 10000.0) / ours
    if kind == "llama3":  # kept, interpolated and divided bands all present
        assert ratio[0] == 1 and ratio[-1] == 8 and ((ratio > 1.01) & (ratio < 7.99)).sum() == 2
    else:
        torch.testing.assert_close(ratio, torch.full_like(ratio, 4.0))


def _logits(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        out = model(tokens)
    return getattr(out, "logits", out)


@pytest.mark.parametrize("kind", ["llama3", "linear"])
def test_scaled_rope_imports_and_exports_with_transformers_logits(tmp_path, kind: str) -> None:
    from trainer.checkpoint.load import _build, load_model

    torch.manual_seed(0)
    theirs = transformers.LlamaForCausalLM(_hf_config(kind)).eval()
    hf_dir = str(tmp_path / "hf")
    theirs.save_pretrained(hf_dir)
    tokens = torch.randint(0, 300, (2, 320), generator=torch.Generator().manual_seed(1))  # (B, S)
    want = _logits(theirs, tokens)

    # Import: config.json (transformers 5 writes rope_parameters) -> our args -> our model.
    ours, _ = load_model(hf_dir)
    assert ours.args.rope_scaling.type == kind and ours.args.n_kv_heads == 2
    import_diff = (_logits(ours, tokens) - want).abs().max().item()
    spec, args, state = read_hf(hf_dir)
    unscaled = _build(spec, dataclasses.replace(args, rope_scaling=RopeScaling()), state, torch.device("cpu"))
    unscaled_diff = (_logits(unscaled, tokens) - want).abs().max().item()

    # Export: our weights and config -> shards + index -> transformers.
    out_dir = str(tmp_path / "ours")
    files = save_hf(ours.state_dict(), spec, args, out_dir, max_shard_bytes=60_000)
    assert "model.safetensors.index.json" in files
    back = transformers.LlamaForCausalLM.from_pretrained(out_dir).eval()
    rope = back.config.rope_parameters
    assert {k: rope[k] for k in ROPE[kind]} == ROPE[kind]
    export_diff = (_logits(back, tokens) - _logits(ours, tokens)).abs().max().item()
    print(
        f"{kind}: import max |dlogit| {import_diff:.2e}, export {export_diff:.2e}, unscaled RoPE "
        f"{unscaled_diff:.2f}"
    )
    assert import_diff <= 1e-4 and export_diff <= 1e-4
    assert unscaled_diff > 100 * 1e-4  # the scaling matters at these positions


def test_rope_config_fields_of_transformers_4_and_5() -> None:
    hf = LlamaHF()
    base = {
        "model_type": "llama",
        "hidden_size": 64,
        "num_attention_heads": 4,
        "num_hidden_layers": 2,
        "vocab_size": 300,
        "intermediate_size": 96,
        "max_position_embeddings": 512,
    }
    llama3 = {k: v for k, v in ROPE["llama3"].items() if k != "rope_theta"}
    v5 = hf.args_from_hf_config({**base, "rope_parameters": ROPE["llama3"]})
    v4 = hf.args_from_hf_config({**base, "rope_theta": 10000.0, "rope_scaling": {**llama3, "type": "llama3"}})
    assert v4 == v5 and v5["rope_scaling"]["original_max_seq_len"] == 64
    # transformers' own fallback: no original_max_position_embeddings -> max_position_embeddings
    no_orig = {k: v for k, v in ROPE["llama3"].items() if k != "original_max_position_embeddings"}
    assert (
        hf.args_from_hf_config({**base, "rope_parameters": no_orig})["rope_scaling"]["original_max_seq_len"]
        == 512
    )
    # What we write is what transformers reads back.
    spec_args = make_config("model=llama3_8b").model
    written = hf.to_hf_config(spec_args, bos_id=None, eos_id=None, dtype="bfloat16")
    read = transformers.LlamaConfig(**written).rope_parameters
    assert read["rope_type"] == "llama3" and read["factor"] == spec_args.rope_scaling.factor
    assert read["original_max_position_embeddings"] == spec_args.rope_scaling.original_max_seq_len
    assert hf.args_from_hf_config(written)["rope_scaling"] == dataclasses.asdict(spec_args.rope_scaling)


def _tiny(tmp_path, name: str, *overrides: str):
    """(spec, args, model with seed-1 weights) of the tiny test model with ``overrides``."""
    from models import get_spec

    args = tiny_config(str(tmp_path / name), *overrides).model
    spec = get_spec(args.family)
    model = spec.build(args)
    model.init_weights(seed=1)
    return spec, args, model


def test_load_hf_into_checks_the_folder(tmp_path, caplog) -> None:
    from trainer.checkpoint.hf import load_hf_into

    spec, args, source = _tiny(tmp_path, "a", "model.rope_theta=50000")
    hf_dir = str(tmp_path / "hf")
    save_hf(source.state_dict(), spec, args, hf_dir, max_shard_bytes=100_000)
    _, _, target = _tiny(tmp_path, "b", "model.rope_theta=50000")
    target.init_weights(seed=2)
    nbytes = load_hf_into(target, hf_dir, spec, args)
    assert all(torch.equal(v, source.state_dict()[k]) for k, v in target.state_dict().items())
    assert nbytes == sum(v.numel() * 4 for v in source.state_dict().values())  # each tensor read once

    spec2, args2, shallow = _tiny(tmp_path, "c", "model.n_layers=2", "model.rope_theta=50000")
    with pytest.raises(ConfigError, match="model.layers.2.*that this model lacks"):
        load_hf_into(shallow, hf_dir, spec2, args2)
    with pytest.raises(ConfigError, match="has no config.json"):
        load_hf_into(target, str(tmp_path), spec, args)
    _, args3, other_rope = _tiny(tmp_path, "d")  # rope_theta 10000: same shapes, other function
    with caplog.at_level("WARNING", logger="meshwright"):
        load_hf_into(other_rope, hf_dir, spec, args3)
    assert "rope_theta=50000.0 (this run: 10000.0)" in caplog.text


# -- sharded loading: each rank reads only its share ------------------------------------------


def _proc_status(key: str) -> int:
    with open("/proc/self/status", encoding="utf-8") as f:
        return int(re.search(rf"^{key}:\s+(\d+) kB", f.read(), re.M).group(1)) * 1024


def _rchar() -> int:
    """Bytes this process passed through read-like system calls (page-cache hits included)."""
    with open("/proc/self/io", encoding="utf-8") as f:
        return int(re.search(r"^rchar: (\d+)", f.read(), re.M).group(1))


def _measured(fn, out: dict):
    """``fn`` wrapped to record its peak resident-memory growth and the bytes it read.

    Peak: VmHWM after resetting it (``/proc/self/clear_refs`` 5); where that is not allowed, a
    thread samples VmRSS every millisecond instead.
    """

    def wrapper(*args, **kwargs):
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            sampler = None
        except OSError:
            sampler = {"peak": 0, "stop": False}

            def sample() -> None:
                while not sampler["stop"]:
                    sampler["peak"] = max(sampler["peak"], _proc_status("VmRSS"))
                    time.sleep(0.001)

            thread = threading.Thread(target=sample, daemon=True)
        before, rchar = _proc_status("VmRSS"), _rchar()
        if sampler is not None:
            sampler["peak"] = before
            thread.start()
        result = fn(*args, **kwargs)
        out["rchar"] = _rchar() - rchar
        if sampler is not None:
            sampler["stop"] = True
            thread.join()
            out["peak_growth"], out["how"] = sampler["peak"] - before, "sampled VmRSS"
        else:
            out["peak_growth"], out["how"] = _proc_status("VmHWM") - before, "VmHWM"
        out["reported"] = result
        return result

    return wrapper


def _load_38m(rank: int, world_size: int, tmp: str, hf_dir: str) -> dict:
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    import trainer.checkpoint.hf
    from trainer.checkpoint.contents import ModelState
    from trainer.train import Trainer

    out: dict = {}
    trainer.checkpoint.hf.load_hf_into = _measured(
        trainer.checkpoint.hf.load_hf_into, out
    )  # the Checkpointer imports it late
    cfg = make_config(
        "model=38m",
        f"job.dump_folder={tmp}/run38m",
        "parallelism.dp_shard=2",
        "training.seq_len=32",
        "training.global_batch_size=4",
        "training.micro_batch_size=2",
        "data.max_documents=40",
        "metrics.tensorboard=false",
        f"checkpoint.initial_load_hf={hf_dir}",
    )
    run = Trainer(cfg)  # training.seed=0 here, the export used seed 5: equality proves the load
    state = ModelState(run.model_parts).state_dict()
    local = sum(v.to_local().numel() * v.element_size() for v in state.values() if isinstance(v, DTensor))
    want = read_hf(hf_dir)[2] if rank == 0 else {}
    mismatched = []
    for name in sorted(state):
        full = state[name].full_tensor() if isinstance(state[name], DTensor) else state[name]
        if rank == 0 and not torch.equal(full, want[name]):
            mismatched.append(name)
    dist.barrier()
    run.close()
    return {**out, "local_bytes": local, "mismatched": mismatched, "checked": len(state), "want": len(want)}


@pytest.mark.slow
def test_fsdp_hf_load_reads_only_each_ranks_share_38m(tmp_path) -> None:
    from models import get_spec

    cfg = make_config("model=38m")
    spec = get_spec("llama")
    model = spec.build(cfg.model)
    model.init_weights(seed=5)
    hf_dir = str(tmp_path / "hf38m")
    files = save_hf(model.state_dict(), spec, cfg.model, hf_dir, max_shard_bytes=40 * 10**6)
    del model
    weights = [f for f in files if f.endswith(".safetensors")]
    assert len(weights) > 1  # sharded, with an index
    full_bytes = sum(os.path.getsize(os.path.join(hf_dir, f)) for f in weights)
    model_bytes = spec.param_counts(cfg.model).total * 4  # fp32
    results = run_distributed(_load_38m, 2, str(tmp_path), hf_dir, timeout=900)
    assert results[0]["checked"] == results[0]["want"] == 111 and results[0]["mismatched"] == []
    for rank, r in enumerate(results):
        print(
            f"rank {rank}: peak RSS growth during load_hf_into {r['peak_growth'] / 2**20:.1f} MiB = "
            f"{r['peak_growth'] / model_bytes:.1%} of the model's {model_bytes / 2**20:.1f} MiB "
            f"({r['how']}); "
            f"read {r['rchar'] / 2**20:.1f} MiB = {r['rchar'] / full_bytes:.1%} of the files (rchar), "
            f"reader count {r['reported'] / full_bytes:.1%}; this rank's shard "
            f"{r['local_bytes'] / model_bytes:.1%}"
        )
        assert r["peak_growth"] <= 0.6 * model_bytes
        assert 0.45 * full_bytes <= r["rchar"] <= 0.6 * full_bytes
        assert r["reported"] <= 0.6 * full_bytes


# -- checkpoint.last_save_in_hf -----------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides,needle",
    [
        (("checkpoint.last_save_in_hf=true", "parallelism.pp=2"), "pipeline parallelism"),
        (("checkpoint.hf_dtype=float8",), "checkpoint.hf_dtype"),
        (("checkpoint.hf_max_shard_size=lots",), "lots"),
        (("checkpoint.hf_max_shard_size=0",), "hf_max_shard_size"),
    ],
)
def test_bad_last_save_in_hf_config(tmp_path, overrides, needle) -> None:
    with pytest.raises(ConfigError, match=needle):
        tiny_config(str(tmp_path), *overrides)


_HF_SAVE = ("checkpoint.last_save_in_hf=true", "checkpoint.hf_max_shard_size=100KB", "training.steps=2")


def _train_and_save_hf(rank: int, world_size: int, tmp: str, runs: dict) -> None:
    from trainer.train import Trainer

    for name, overrides in runs.items():
        run = Trainer(tiny_config(os.path.join(tmp, name), *_HF_SAVE, *overrides))
        run.train()
        run.close()


@pytest.mark.slow
def test_last_save_in_hf_single_process_fsdp_and_tp(tmp_path) -> None:
    from safetensors.torch import load_file

    from trainer.checkpoint.checkpointer import load_full_state
    from trainer.checkpoint.load import load_model

    tmp = str(tmp_path)
    one: dict[str, tuple[str, ...]] = {"single": ("checkpoint.enable=true",), "hf_only": ()}
    if importlib.util.find_spec("torchao") is not None:  # MXFP8 weights are torchao wrappers: saved plain
        one["mxfp8"] = (
            "checkpoint.enable=true",
            "training.float8.enable=true",
            "training.float8.recipe=mxfp8",
        )
    run_distributed(_train_and_save_hf, 1, tmp, one)
    run_distributed(
        _train_and_save_hf,
        2,
        tmp,
        {
            "fsdp": ("checkpoint.enable=true", "parallelism.dp_shard=2"),
            "tp": ("checkpoint.enable=true", "parallelism.tp=2", "parallelism.dp_shard=1"),
        },
    )
    tokens = torch.randint(0, 512, (2, 40), generator=torch.Generator().manual_seed(0))
    tensors = {}
    for name in (*one, "fsdp", "tp"):
        folder = os.path.join(tmp, name, "checkpoints")
        hf_dir = os.path.join(folder, "step-2-hf")
        assert sorted(os.listdir(folder)) == (["step-2", "step-2-hf"] if name != "hf_only" else ["step-2-hf"])
        names = sorted(os.listdir(hf_dir))
        shards = [n for n in names if n.endswith(".safetensors")]
        assert len(shards) > 2 and {"model.safetensors.index.json", "config.json", "meshwright.json"} <= set(
            names
        )
        index = json.load(open(os.path.join(hf_dir, "model.safetensors.index.json")))
        assert sorted(set(index["weight_map"].values())) == shards
        tensors[name] = {k: v for s in shards for k, v in load_file(os.path.join(hf_dir, s)).items()}
        assert json.load(open(os.path.join(hf_dir, "meshwright.json")))["step"] == 2
        if name == "hf_only":
            continue
        # Bit-identical to the DCP checkpoint of the same step, and transformers agrees with us.
        step2 = os.path.join(folder, "step-2")
        want = load_full_state(step2, "model.")
        _, _, got = read_hf(hf_dir)
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want), name
        ours = _logits(load_model(step2)[0], tokens)
        theirs = _logits(transformers.LlamaForCausalLM.from_pretrained(hf_dir).eval(), tokens)
        diff = (theirs - ours).abs().max().item()
        print(f"last_save_in_hf {name}: max |dlogit| vs transformers {diff:.2e}")
        assert diff <= 1e-4, (name, diff)
    # Without checkpoint.enable the HF folder is still written, with the same weights.
    assert all(torch.equal(tensors["hf_only"][k], v) for k, v in tensors["single"].items())


def test_hf_folders_are_not_checkpoints_and_their_leftovers_are_removed(tmp_path) -> None:
    from trainer.checkpoint.checkpointer import complete_steps
    from trainer.checkpoint.storage import remove_leftovers

    for name in ("step-2", "step-2-hf", "step-4-hf.tmp-ab12", "step-4-hf.trash-cd34"):
        (tmp_path / name).mkdir()
    (tmp_path / "step-2" / "checkpoint.json").write_text("{}")
    (tmp_path / "step-2-hf" / "checkpoint.json").write_text("{}")  # never a resumable step
    assert complete_steps(str(tmp_path)) == [2]
    assert remove_leftovers(str(tmp_path)) == ["step-4-hf.tmp-ab12", "step-4-hf.trash-cd34"]
    assert sorted(os.listdir(tmp_path)) == ["step-2", "step-2-hf"]
