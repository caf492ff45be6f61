"""The Qwen3 dense family against ``transformers``' own Qwen3 (nothing is downloaded).

* HF import: small random ``Qwen3ForCausalLM`` models (GQA with a head size other than dim / heads,
  tied and untied embeddings, plain multi-head), written by ``save_pretrained``, load through
  ``trainer.checkpoint.load.load_model`` with transformers' logits. Every norm gain (q/k head norms
  included) is randomised first: transformers initialises them to ones, which would hide a wrong
  mapping of the q/k norms.
* HF export: our model (seed init, gains randomised) written by ``save_hf`` loads in
  ``Qwen3ForCausalLM.from_pretrained`` with our logits.
* Presets: our analytic count = our model's parameters on meta = transformers' Qwen3 built from
  our exported config on meta, and within 2% of the published totals (printed).
* Bad input: q/k norm off in the qwen3 family, a q/k-normed Llama export, sliding-window folders.

Tolerance (fp32 on CPU): max |logit difference| <= 1e-5 with |logits| of order 1 (measured below,
printed); only the order of floating-point operations differs (SDPA vs transformers' eager
attention, fused vs separate RoPE).
"""

from __future__ import annotations

import pytest
import torch

from models import get_spec
from models.errors import ConfigError
from models.llama import LlamaHF
from models.qwen3 import Qwen3Args, Qwen3HF
from tests.configs import make_config
from trainer.checkpoint.hf import read_hf, save_hf

transformers = pytest.importorskip("transformers", reason="transformers (the dev extra) is not installed")

ATOL = 1e-5  # fp32 logits of order 1

# Published totals (Qwen3 model cards / technical report, embedding included).
PUBLISHED = {
    "qwen3_0.6b": 0.6e9,
    "qwen3_1.7b": 1.7e9,
    "qwen3_4b": 4.0e9,
    "qwen3_8b": 8.2e9,
    "qwen3_14b": 14.8e9,
    "qwen3_32b": 32.8e9,
}
MOE_PUBLISHED = {"qwen3_30b_a3b": (30.5e9, 3.3e9)}  # (total, active)

# Small random Qwen3 configs: the features the family must read.
_BASE = dict(
    vocab_size=300,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    rope_parameters={"rope_type": "default", "rope_theta": 1e6},
    initializer_range=0.1,
)
HF_CONFIGS = {
    "gqa_head_dim_untied": dict(
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, tie_word_embeddings=False
    ),
    "gqa_tied": dict(num_attention_heads=4, num_key_value_heads=1, head_dim=16, tie_word_embeddings=True),
    "mha_head_dim_tied": dict(
        num_attention_heads=2, num_key_value_heads=2, head_dim=48, tie_word_embeddings=True
    ),
}


def _logits(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        out = model(tokens)
    return getattr(out, "logits", out)


def _randomise_gains(model: torch.nn.Module, seed: int) -> None:
    """Every 1-d parameter (the RMSNorm gains: block, final and q/k head norms) to 1 + U(-0.5, 0.5)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.copy_(1 + torch.rand(p.shape, generator=gen) - 0.5)


def _tokens(seq: int = 40) -> torch.Tensor:
    return torch.randint(0, 300, (2, seq), generator=torch.Generator().manual_seed(1))  # (B, S)


@pytest.mark.parametrize("kind", list(HF_CONFIGS))
def test_transformers_folder_imports_and_our_export_loads_back(tmp_path, kind: str) -> None:
    from trainer.checkpoint.load import load_model

    torch.manual_seed(0)
    theirs = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**_BASE, **HF_CONFIGS[kind])).eval()
    _randomise_gains(theirs, 0)
    hf_dir = str(tmp_path / "hf")
    theirs.save_pretrained(hf_dir)
    tokens = _tokens()
    want = _logits(theirs, tokens)

    ours, _ = load_model(hf_dir)
    spec, args, _ = read_hf(hf_dir)
    cfg = HF_CONFIGS[kind]
    assert spec.family == "qwen3" and args.qk_norm and args.rope_theta == 1e6
    assert (args.head_dim, args.kv_heads, args.tie_embeddings) == (
        cfg["head_dim"],
        cfg["num_key_value_heads"],
        cfg["tie_word_embeddings"],
    )
    import_diff = (_logits(ours, tokens) - want).abs().max().item()

    # Export (sharded: several files and an index) -> transformers.
    out_dir = str(tmp_path / "ours")
    files = save_hf(ours.state_dict(), spec, args, out_dir, max_shard_bytes=40_000)
    assert "model.safetensors.index.json" in files
    back = transformers.Qwen3ForCausalLM.from_pretrained(out_dir).eval()
    assert (
        back.config.head_dim == cfg["head_dim"]
        and back.config.tie_word_embeddings == cfg["tie_word_embeddings"]
    )
    export_diff = (_logits(back, tokens) - want).abs().max().item()
    scale = want.abs().max().item()
    print(
        f"qwen3 {kind}: max |logit| {scale:.2f}; import max |dlogit| {import_diff:.2e}, export "
        f"{export_diff:.2e}"
    )
    assert import_diff <= ATOL and export_diff <= ATOL


def test_our_model_exports_to_transformers_with_equal_logits(tmp_path) -> None:
    """Our own weights (seed init, gains randomised; untied, GQA, head_dim 32 != 64 / 4) ->
    Qwen3ForCausalLM."""
    args = Qwen3Args(
        dim=64,
        n_layers=3,
        n_heads=4,
        n_kv_heads=2,
        attn_head_dim=32,
        vocab_size=300,
        ffn_hidden_dim=96,
        max_seq_len=128,
        tie_embeddings=False,
        init_std=0.1,
    )
    spec = get_spec("qwen3")
    model = spec.build(args)
    model.init_weights(seed=3)
    _randomise_gains(model, 1)
    save_hf(model.state_dict(), spec, args, str(tmp_path))
    theirs = transformers.Qwen3ForCausalLM.from_pretrained(str(tmp_path)).eval()
    tokens = _tokens(64)
    want = _logits(model.eval(), tokens)
    diff = (_logits(theirs, tokens) - want).abs().max().item()
    # Without the q/k norms the logits would differ: the check sees them.
    with torch.no_grad():
        for layer in theirs.model.layers:
            layer.self_attn.q_norm.weight.fill_(1.0)
    no_qk = (_logits(theirs, tokens) - want).abs().max().item()
    print(f"qwen3 export: max |dlogit| {diff:.2e} (q norm gains reset to 1 in transformers: {no_qk:.2e})")
    assert diff <= ATOL and no_qk > 1000 * ATOL


def _meta_count(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


@pytest.mark.parametrize("name", [*PUBLISHED, *MOE_PUBLISHED])
def test_preset_counts_match_transformers_and_published(name: str) -> None:
    cfg = make_config(f"model={name}")
    args = cfg.model
    spec = get_spec(args.family)
    counts = spec.param_counts(args)
    with torch.device("meta"):
        ours = _meta_count(spec.build(args))
        hf_cfg = spec.hf.to_hf_config(args, bos_id=None, eos_id=None, dtype="bfloat16")
        arch = getattr(transformers, hf_cfg["architectures"][0])
        config = getattr(transformers, arch.config_class.__name__)(**hf_cfg)
        theirs = _meta_count(arch(config))
    assert counts.total == ours == theirs, (counts.total, ours, theirs)
    if name in PUBLISHED:
        published = PUBLISHED[name]
        print(
            f"{name}: {counts.total / 1e9:.3f}B parameters (transformers {theirs / 1e9:.3f}B), "
            f"published {published / 1e9:.1f}B: {counts.total / published - 1:+.2%}"
        )
        assert abs(counts.total / published - 1) < 0.02
        assert args.qk_norm and args.head_dim == 128 and args.vocab_size == 151936 and args.rope_theta == 1e6
        assert args.tie_embeddings == (name in ("qwen3_0.6b", "qwen3_1.7b", "qwen3_4b"))
    else:
        total, active = MOE_PUBLISHED[name]
        print(
            f"{name}: {counts.total / 1e9:.3f}B total, {counts.active / 1e9:.3f}B active (published "
            f"{total / 1e9:.1f}B / {active / 1e9:.1f}B); q/k norm {args.qk_norm}, head_dim {args.head_dim}"
        )
        assert abs(counts.total / total - 1) < 0.02 and abs(counts.active / active - 1) < 0.02
        assert args.qk_norm and args.head_dim == 128


def test_bad_qwen3_input_is_refused() -> None:
    with pytest.raises(ConfigError, match="model.qk_norm=False.*set model.qk_norm=true"):
        make_config("model=qwen3_debug", "model.qk_norm=false")
    with pytest.raises(ConfigError, match="model.attn_head_dim=33 is odd"):
        make_config("model=qwen3_debug", "model.attn_head_dim=33")
    llama = make_config("model=debug", "model.qk_norm=true").model  # a Llama may use q/k norms ...
    with pytest.raises(ConfigError, match="no equivalent in Hugging Face LlamaForCausalLM.*family=qwen3"):
        LlamaHF().to_hf_config(llama, bos_id=None, eos_id=None, dtype="float32")  # ... but not export them
    hf = Qwen3HF()
    sliding = transformers.Qwen3Config(
        **_BASE, **HF_CONFIGS["gqa_tied"], use_sliding_window=True, sliding_window=16, max_window_layers=0
    ).to_dict()
    with pytest.raises(ConfigError, match="use_sliding_window=true"):
        hf.args_from_hf_config(sliding)
    with pytest.raises(ConfigError, match="attention_bias=true"):
        hf.args_from_hf_config({**sliding, "use_sliding_window": False, "attention_bias": True})
    with pytest.raises(ConfigError, match="model_type='llama'.*reads 'qwen3'"):
        hf.args_from_hf_config({**sliding, "model_type": "llama"})


@pytest.mark.slow
def test_qwen3_debug_trains_from_launch_sh(tmp_path) -> None:
    """``./launch.sh +experiment=qwen3_debug`` (2 CPU ranks, the built-in corpus): the loss falls,
    an evaluation runs, and the run ends with a checkpoint whose model is a Qwen3 (q/k norms).
    (This replaces test_presets' 3-step smoke run of the same experiment.)"""
    import json
    import os
    import subprocess

    from tests.configs import REPO

    env = dict(os.environ, OMP_NUM_THREADS="1", NPROC="2")
    for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        env.pop(key, None)
    dump = tmp_path / "run"
    proc = subprocess.run(
        [
            "./launch.sh",
            "+experiment=qwen3_debug",
            "training.steps=12",
            "training.seq_len=128",
            "metrics.log_freq=1",
            "training.eval_freq=12",
            "training.eval_steps=1",
            "checkpoint.interval=12",
            "data.max_documents=300",
            "metrics.tensorboard=false",
            f"job.dump_folder={dump}",
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    records = [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if "loss" in r]
    evals = [r["eval_loss"] for r in records if "eval_loss" in r]
    print(f"qwen3_debug via ./launch.sh: losses {[round(x, 3) for x in losses]}, eval {evals}")
    assert len(losses) == 12 and losses[-1] < losses[0] - 2.0 and len(evals) == 1
    marker = json.loads((dump / "checkpoints" / "step-12" / "checkpoint.json").read_text())
    model = marker["model"]
    assert (model["family"], model["qk_norm"], model["attn_head_dim"], model["tie_embeddings"]) == (
        "qwen3",
        True,
        64,
        True,
    )


def test_generation_with_kv_cache_matches_transformers_greedy(tmp_path) -> None:
    """Greedy decoding of a transformers Qwen3 folder: ours with the KV cache (q/k-normed, rotated
    keys cached) = ours without = transformers' ``generate`` (its own cache), token for token."""
    from models.generation import generate
    from trainer.checkpoint.load import load_model

    torch.manual_seed(0)
    config = transformers.Qwen3Config(
        **{**_BASE, "num_hidden_layers": 3}, **HF_CONFIGS["gqa_head_dim_untied"]
    )
    theirs = transformers.Qwen3ForCausalLM(config).eval()
    _randomise_gains(theirs, 2)
    theirs.save_pretrained(str(tmp_path))
    ours, _ = load_model(str(tmp_path))
    prompt = torch.randint(0, 300, (9,), generator=torch.Generator().manual_seed(3)).tolist()
    new = 30
    cached = generate(ours, prompt, max_new_tokens=new, temperature=0, use_cache=True)
    plain = generate(ours, prompt, max_new_tokens=new, temperature=0, use_cache=False)
    with torch.no_grad():
        hf = theirs.generate(
            torch.tensor([prompt]), max_new_tokens=new, do_sample=False, eos_token_id=None, pad_token_id=0
        )[0].tolist()
    print(f"qwen3 greedy, {new} new tokens: cached == uncached == transformers: {cached == plain == hf}")
    assert cached == plain == hf and len(cached) == len(prompt) + new
