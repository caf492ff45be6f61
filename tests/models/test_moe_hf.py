"""Hugging Face interop of the MoE family against ``transformers`` itself.

Small random Mixtral and Qwen3-MoE models, written by ``save_pretrained`` (safetensors, with a
tokenizer saved alongside), must: import with transformers' logits (``trainer.checkpoint.load``,
``trainer.generate``'s loader, and the sliced reader of ``checkpoint.initial_load_hf``); generate through
``python -m trainer.generate``; start a run through ``trainer/main.py`` with
``checkpoint.initial_load_hf`` whose first loss is transformers' loss on that batch. HF stores no
routing bias (``expert_bias``): it starts at zero; every other tensor is still required, and a
config field we cannot compute is refused by name. Our exports load back in ``transformers``.

The Mixtral folder has the ``moe_debug`` preset's shape (the run uses ``model=moe_debug`` as is);
the Qwen3-MoE one adds what Qwen3 has (q/k norms, a head size other than dim / heads, a leading
dense layer, unnormalised top-k weights), set on the run by overrides. Nothing is downloaded.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from models.errors import ConfigError
from models.moe import MoEHF, moe_layers
from tests.configs import REPO, make_config
from trainer.checkpoint.hf import load_hf_into, read_hf, read_hf_config, save_hf, save_hf_distributed

transformers = pytest.importorskip("transformers", reason="transformers (the dev extra) is not installed")

ATOL = 2e-5  # fp32 logits, |logits| <= ~5 here; measured 4e-6 .. 6e-6 (a few ulps over 4 layers)
LOSS_RTOL = 1e-5  # first training loss vs transformers' loss on the same batch

# moe_debug's shape (configs/model/moe_debug.yaml): the Mixtral folder trains with model=moe_debug as is.
_SHAPE = dict(
    vocab_size=512,
    hidden_size=256,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    max_position_embeddings=2048,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    num_experts_per_tok=2,
    tie_word_embeddings=False,
)
CONFIGS = {
    "mixtral": lambda **kw: transformers.MixtralConfig(
        **{**_SHAPE, "intermediate_size": 256, "num_local_experts": 8, **kw}
    ),
    "qwen3_moe": lambda **kw: transformers.Qwen3MoeConfig(
        **{
            **_SHAPE,
            "head_dim": 64,
            "intermediate_size": 512,
            "moe_intermediate_size": 128,
            "num_experts": 8,
            "norm_topk_prob": False,
            "mlp_only_layers": [0],
            "decoder_sparse_step": 1,
            **kw,
        }
    ),
}
MODELS = {"mixtral": "MixtralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}
# model=moe_debug plus these overrides has each folder's shape.
RUN_OVERRIDES = {
    "mixtral": (),
    "qwen3_moe": (
        "model.qk_norm=true",
        "model.attn_head_dim=64",
        "model.first_k_dense=1",
        "model.ffn_hidden_dim=512",
        "model.moe_hidden_dim=128",
        "model.route_norm=false",
    ),
}
KINDS = list(CONFIGS)
PROMPT = "def main():"


def _env() -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    return env


def _tokenizer() -> transformers.PreTrainedTokenizerFast:
    """A byte-level BPE of 300 ids with <s> / </s>, trained on a few lines (offline)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(
        ["def main():\n    return 42\n", "import os\nprint(os.getcwd())\n"] * 4, trainer=trainer
    )
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")


def _randomise(model: torch.nn.Module, seed: int) -> None:
    """Every tensor random, norms and router too (HF initialises norms to ones and Qwen3's router
    to zeros): a tensor mapped to the wrong place changes the logits. Matrices ~ N(0, 1/fan_in),
    so activations and logits stay O(1) and the routing scores are well apart."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1.0 + 0.2 * noise if p.dim() == 1 else noise / math.sqrt(p.shape[-1]))


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, tuple[str, torch.nn.Module]]:
    """kind -> (folder written by transformers' save_pretrained, the transformers model in eval)."""
    root = tmp_path_factory.mktemp("moe_hf")
    tokenizer = _tokenizer()
    out = {}
    for seed, kind in enumerate(KINDS):
        torch.manual_seed(seed)
        model = getattr(transformers, MODELS[kind])(CONFIGS[kind]()).float().eval()
        _randomise(model, seed)
        folder = str(root / kind)
        model.save_pretrained(folder)  # safetensors
        tokenizer.save_pretrained(folder)
        out[kind] = (folder, model)
    return out


def _logits(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        out = model(tokens)
    return getattr(out, "logits", out)


# -- (a) import: transformers' logits -----------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_import_matches_transformers_logits(folders, kind: str) -> None:
    from trainer.checkpoint.load import load_model

    folder, hf = folders[kind]
    assert {"model.safetensors", "config.json", "tokenizer.json"} <= set(os.listdir(folder))
    tokens = torch.randint(0, 512, (2, 48), generator=torch.Generator().manual_seed(1))
    want = _logits(hf, tokens)

    # trainer.generate's loader: strict state dict; the routing bias HF lacks starts at zero.
    ours, tokenizer = load_model(folder)
    assert tokenizer is not None and tokenizer.bos_id == 0
    args = ours.args
    if kind == "qwen3_moe":
        assert (args.qk_norm, args.attn_head_dim, args.first_k_dense, args.route_norm) == (True, 64, 1, False)
        assert (args.ffn_hidden_dim, args.moe_hidden_dim) == (512, 128)
    else:
        assert (args.qk_norm, args.first_k_dense, args.route_norm, args.moe_hidden_dim) == (
            False,
            0,
            True,
            256,
        )
    biases = [moe.expert_bias for _, moe in moe_layers(ours)]
    assert len(biases) == (3 if kind == "qwen3_moe" else 4) and all(not b.any() for b in biases)
    diff = (_logits(ours, tokens) - want).abs().max().item()

    # The sliced reader of checkpoint.initial_load_hf: the same tensors; a stale bias is reset.
    spec, args = read_hf_config(folder)
    with torch.device("meta"):
        sliced = spec.build(args)
    sliced.to_empty(device="cpu")
    for _, moe in moe_layers(sliced):
        moe.expert_bias.fill_(3.0)
    load_hf_into(sliced, folder, spec, args)
    expected = ours.state_dict()
    assert sliced.state_dict().keys() == expected.keys()
    assert all(torch.equal(v, expected[k]) for k, v in sliced.state_dict().items())
    print(
        f"{MODELS[kind]}: import max |logit diff| vs transformers = {diff:.2e} (max |logit| "
        f"{want.abs().max().item():.1f}, atol {ATOL:g})"
    )
    assert diff <= ATOL


def test_missing_expert_weight_is_an_error_naming_it(folders, tmp_path) -> None:
    from safetensors.torch import load_file, save_file

    folder, _ = folders["mixtral"]
    broken = tmp_path / "broken"
    broken.mkdir()
    for name in ("config.json", "tokenizer.json"):
        (broken / name).write_bytes(open(os.path.join(folder, name), "rb").read())
    state = load_file(os.path.join(folder, "model.safetensors"))
    gone = "model.layers.2.block_sparse_moe.experts.5.w2.weight"
    del state[gone]
    save_file(state, str(broken / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ConfigError, match=f"no tensor '{gone}'.*layers.2.moe.experts.w2"):
        read_hf(str(broken))
    spec, args = read_hf_config(str(broken))
    model = spec.build(args)
    with pytest.raises(ConfigError, match=f"no tensor '{gone}'.*layers.2.moe.experts.w2"):
        load_hf_into(model, str(broken), spec, args)


# -- config fields we cannot compute are refused by name ------------------------------------------


@pytest.mark.parametrize(
    "kind,fields,needle",
    [
        ("mixtral", {"sliding_window": 128}, "sliding_window=128"),
        ("mixtral", {"num_experts_per_tok": 1}, "num_experts_per_tok=1"),
        ("mixtral", {"hidden_act": "gelu"}, "hidden_act='gelu'"),
        ("qwen3_moe", {"use_sliding_window": True, "sliding_window": 128}, "sliding_window=128"),
        ("qwen3_moe", {"num_experts_per_tok": 1, "norm_topk_prob": True}, "norm_topk_prob=true"),
        ("qwen3_moe", {"decoder_sparse_step": 2}, "decoder_sparse_step=2"),
        ("qwen3_moe", {"mlp_only_layers": [1]}, r"mlp_only_layers=\[1\]"),
        ("qwen3_moe", {"attention_bias": True}, "attention_bias"),
    ],
)
def test_unrepresentable_config_fields_are_refused(kind: str, fields: dict, needle: str) -> None:
    cfg = CONFIGS[kind]().to_dict()
    cfg.update(fields)
    with pytest.raises(ConfigError, match=needle):
        MoEHF().args_from_hf_config(cfg)


def test_representable_config_variants_are_read(caplog) -> None:
    hf = MoEHF()
    # Qwen3-MoE top-1 without renormalisation routes by the raw score, as ours does.
    top1 = hf.args_from_hf_config({**CONFIGS["qwen3_moe"]().to_dict(), "num_experts_per_tok": 1})
    assert (top1["top_k"], top1["route_norm"]) == (1, False)
    # A window no shorter than the context, or one switched off, is full causal attention.
    assert (
        hf.args_from_hf_config({**CONFIGS["mixtral"]().to_dict(), "sliding_window": 2048})["max_seq_len"]
        == 2048
    )
    assert hf.args_from_hf_config({**CONFIGS["qwen3_moe"]().to_dict(), "sliding_window": 128})["qk_norm"]
    # Training-time noise: read, with a warning.
    with caplog.at_level("WARNING", logger="meshwright"):
        hf.args_from_hf_config({**CONFIGS["mixtral"]().to_dict(), "router_jitter_noise": 0.01})
    assert "router_jitter_noise=0.01" in caplog.text
    # Export: a Mixtral top-1 model cannot be written (HF would scale its one expert by 1).
    args = make_config("model=moe_debug", "model.top_k=1").model
    with pytest.raises(ConfigError, match="top_k=1"):
        hf.to_hf_config(args, bos_id=None, eos_id=None, dtype="float32")


# -- export: what HF cannot hold is refused, the rest loads in transformers -------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_export_loads_in_transformers_and_refuses_a_moved_bias(folders, kind: str, tmp_path) -> None:
    from trainer.checkpoint.load import load_model

    folder, _ = folders[kind]
    ours, _ = load_model(folder)
    spec, args = read_hf_config(folder)
    tokens = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(2))
    save_hf(ours.state_dict(), spec, args, str(tmp_path / "export"))
    back = getattr(transformers, MODELS[kind]).from_pretrained(tmp_path / "export").float().eval()
    diff = (_logits(back, tokens) - _logits(ours, tokens)).abs().max().item()
    print(f"{MODELS[kind]}: export -> transformers max |logit diff| = {diff:.2e}")
    assert diff <= ATOL
    # The live-model writer (checkpoint.last_save_in_hf) writes the same tensors.
    os.makedirs(tmp_path / "live")  # the caller makes the folder (the Checkpointer: a tmp folder)
    save_hf_distributed(ours, spec, args, str(tmp_path / "live"), is_writer=True)
    assert read_hf(str(tmp_path / "live"))[2].keys() == ours.state_dict().keys()

    # A routing bias moved by aux-loss-free balancing: HF would route differently. Refused by name,
    # before any file is written.
    name, moe = moe_layers(ours)[0]
    moe.expert_bias[1] = 0.25
    for i, write in enumerate((save_hf, lambda *a: save_hf_distributed(*a, is_writer=True))):
        out = tmp_path / f"moved{i}"
        out.mkdir()
        with pytest.raises(ConfigError, match=f"{name}.expert_bias is non-zero"):
            write(ours.state_dict() if i == 0 else ours, spec, args, str(out))
        assert not os.listdir(out)


# -- (b) python -m trainer.generate <folder> ---------------------------------------------------------


@pytest.mark.slow  # a process of its own (~4-6 s on 2 cores)
@pytest.mark.parametrize("kind", KINDS)
def test_generate_cli_on_a_transformers_folder(folders, kind: str) -> None:
    """Greedy tokens of the CLI are transformers' greedy tokens."""
    from trainer.data.tokenizer import build_tokenizer

    folder, hf = folders[kind]
    new_tokens = 6
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "trainer.generate",
            folder,
            "--prompt",
            PROMPT,
            "--temperature",
            "0",
            "--max-new-tokens",
            str(new_tokens),
            "--device",
            "cpu",
        ],
        cwd=REPO,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    tok = build_tokenizer(os.path.join(folder, "tokenizer.json"))
    ids = [tok.bos_id, *tok.encode(PROMPT)]
    for _ in range(new_tokens):
        ids.append(int(_logits(hf, torch.tensor([ids]))[0, -1].argmax()))
        if ids[-1] == tok.eos_id:
            break
    assert proc.stdout == tok.decode(ids[1:]) + "\n", (proc.stdout, ids)
    assert f"{new_tokens} tokens in" in proc.stderr or tok.eos_id in ids


# -- (c) trainer/main.py checkpoint.initial_load_hf=<folder> --------------------------------------


_RUN = (
    "training.steps=2",
    "training.seq_len=64",
    "training.global_batch_size=2",
    "training.micro_batch_size=2",
    "training.eval_freq=0",
    "training.device=cpu",
    "data.max_documents=40",
    "metrics.log_freq=1",
    "metrics.tensorboard=false",
)


@pytest.mark.slow  # a training process (~5-10 s on 2 cores)
@pytest.mark.parametrize("kind", KINDS)
def test_initial_load_hf_run_starts_from_transformers_weights(folders, kind: str, tmp_path) -> None:
    """Two steps through the CLI; the first loss is transformers' loss on the run's first batch."""
    from models.common import IGNORE_INDEX
    from trainer.data.build import build_dataloader
    from trainer.data.tokenizer import build_tokenizer

    folder, hf = folders[kind]
    overrides = ("model=moe_debug", *RUN_OVERRIDES[kind], *_RUN, f"checkpoint.initial_load_hf={folder}")
    dump = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "trainer/main.py", *overrides, f"job.dump_folder={dump}"],
        cwd=REPO,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-3000:]
    assert "initial weights from Hugging Face folder" in log
    assert "differs from model config" not in log  # the overrides give the folder's model
    records = [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if "loss" in r]
    assert len(losses) == 2 and all(math.isfinite(x) for x in losses)

    cfg = make_config(*overrides)
    loader = build_dataloader(
        cfg.data,
        build_tokenizer(cfg.data.tokenizer),
        split="train",
        seq_len=cfg.training.seq_len,
        global_batch_size=cfg.training.global_batch_size,
        dp_rank=0,
        dp_size=1,
        seed=cfg.training.seed,
    )
    try:
        batch = loader.next_batch()
    finally:
        loader.close()
    logits = _logits(hf, batch.inputs)
    want = F.cross_entropy(logits.flatten(0, 1), batch.labels.flatten(), ignore_index=IGNORE_INDEX).item()
    print(
        f"{MODELS[kind]} -> model=moe_debug {' '.join(RUN_OVERRIDES[kind])}: first loss {losses[0]:.6f}, "
        f"transformers {want:.6f} (rel diff {abs(losses[0] - want) / want:.1e}); second {losses[1]:.6f}"
    )
    assert abs(losses[0] - want) <= LOSS_RTOL * want
