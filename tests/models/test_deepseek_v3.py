"""The DeepSeek-V3 family against ``transformers``' own ``DeepseekV3ForCausalLM``, both ways.

Random tiny models written by ``save_pretrained`` (per-expert tensors, ``e_score_correction_bias``,
``rope_interleave``, YaRN in ``rope_parameters``): with and without ``q_lora_rank``, group-limited
routing (4 groups, 2 kept), a first dense layer, shared experts, a random (non-zero) routing bias,
YaRN with mscale == mscale_all_dim (DeepSeek-V3) and with mscale != mscale_all_dim (cos/sin scaled
too), interleaved and rotate-half RoPE rows. They import with transformers' logits (whole-tensor
reader and the sliced per-rank reader), and our exports load in transformers with our logits.
Nothing is downloaded.
"""

from __future__ import annotations

import pytest
import torch

from models import get_spec
from models.errors import ConfigError
from trainer.checkpoint.hf import load_hf_into, read_hf, save_hf

transformers = pytest.importorskip("transformers", reason="transformers (the dev extra) is not installed")

ATOL = 1e-5  # fp32 logits of |logits| ~ 1..3; measured <= 1e-6 (a few ulps)

_SHAPE = dict(
    vocab_size=96,
    hidden_size=32,
    intermediate_size=48,
    moe_intermediate_size=16,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=4,
    n_shared_experts=1,
    n_routed_experts=8,
    num_experts_per_tok=3,
    n_group=4,
    topk_group=2,
    first_k_dense_replace=1,
    kv_lora_rank=16,
    qk_nope_head_dim=8,
    qk_rope_head_dim=4,
    v_head_dim=6,
    max_position_embeddings=64,
    routed_scaling_factor=2.5,
    initializer_range=0.15,
    attn_implementation="eager",
)
_DEFAULT = {"rope_type": "default", "rope_theta": 10000.0}
_YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 8.0,
    "original_max_position_embeddings": 8,
    "beta_fast": 32,
    "beta_slow": 1,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
}
CASES = {
    "no_q_lora": dict(q_lora_rank=None, rope_parameters=_DEFAULT),
    "q_lora_yarn": dict(q_lora_rank=12, rope_parameters=_YARN),
    "q_lora_rotate_half": dict(q_lora_rank=12, rope_parameters=_DEFAULT, rope_interleave=False),
    "yarn_mscales_differ": dict(
        q_lora_rank=None,
        rope_parameters={**_YARN, "mscale": 0.707, "mscale_all_dim": 0.5},
        n_group=1,
        topk_group=1,
        norm_topk_prob=False,
    ),
}


def _hf_model(case: str) -> transformers.PreTrainedModel:
    torch.manual_seed(len(case))
    model = transformers.DeepseekV3ForCausalLM(
        transformers.DeepseekV3Config(**{**_SHAPE, **CASES[case]})
    ).eval()
    with torch.no_grad():  # norms and the routing bias away from their trivial initial values
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                p.add_(torch.randn_like(p) * 0.2)
        for module in model.modules():
            if hasattr(module, "e_score_correction_bias"):
                module.e_score_correction_bias.normal_(0, 0.05)
    return model


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, str]:
    out = {}
    for case in CASES:
        path = str(tmp_path_factory.mktemp(f"dsv3_{case}"))
        _hf_model(case).save_pretrained(path)
        out[case] = path
    return out


def _tokens() -> torch.Tensor:
    return torch.randint(0, _SHAPE["vocab_size"], (2, 40), generator=torch.Generator().manual_seed(1))


def test_import_matches_transformers_logits(folders) -> None:
    errors = {}
    for case, folder in folders.items():
        hf_model = transformers.DeepseekV3ForCausalLM.from_pretrained(
            folder, attn_implementation="eager"
        ).eval()
        spec, args, state = read_hf(folder)
        assert spec.family == "deepseek_v3" and args.q_lora_rank == CASES[case]["q_lora_rank"]
        model = spec.build(args).eval()
        model.load_state_dict(state)
        sliced = spec.build(args).eval()  # the per-rank sliced reader (rows permuted in the file)
        load_hf_into(sliced, folder, spec, args)
        tokens = _tokens()
        with torch.no_grad():
            ref = hf_model(tokens).logits
            errors[case] = max(
                (model(tokens) - ref).abs().max().item(), (sliced(tokens) - ref).abs().max().item()
            )
        assert ref.abs().max() > 0.5, "logits too small to test anything"
    print(f"\nHF -> meshwright max |logit error| per case: {errors}")
    assert max(errors.values()) <= ATOL


def test_sliced_reads_of_permuted_rows_match_the_full_tensor(folders) -> None:
    """A rank's slice (e.g. its tensor-parallel rows) of a RoPE-permuted tensor, read from the file, is the
    same slice of the fully read and permuted tensor."""
    from trainer.checkpoint.hf import _SliceReader, _weight_files

    folder = folders["q_lora_yarn"]
    spec, args, state = read_hf(folder)
    reader = _SliceReader(_weight_files(folder))
    try:
        for name in ("layers.1.attention.wq_b.weight", "layers.2.attention.wkv_a.weight"):
            rows = state[name].shape[0]
            for lo, hi in ((0, rows // 2), (rows // 2, rows), (3, rows - 5)):
                index = (slice(lo, hi), slice(0, state[name].shape[1]))
                assert torch.equal(spec.hf.read_slice(name, index, reader, args), state[name][lo:hi]), (
                    name,
                    lo,
                    hi,
                )
    finally:
        reader.close()


def test_export_loads_in_transformers(tmp_path) -> None:
    spec = get_spec("deepseek_v3")
    errors = {}
    for case in ("no_q_lora", "q_lora_yarn"):
        hf_cfg = _hf_model(case).config.to_dict()
        args = spec.make_args({**spec.hf.args_from_hf_config(hf_cfg), "init_std": 0.15})
        model = spec.build(args).eval()
        model.init_weights(seed=3)
        with torch.no_grad():
            for _, moe in spec.moe_layers(model):
                moe.expert_bias.normal_(0, 0.05, generator=torch.Generator().manual_seed(5))
        out = str(tmp_path / case)
        save_hf(model.state_dict(), spec, args, out)
        hf_model = transformers.DeepseekV3ForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
        tokens = _tokens()
        with torch.no_grad():
            errors[case] = (hf_model(tokens).logits - model(tokens)).abs().max().item()
    print(f"\nmeshwright -> HF max |logit error| per case: {errors}")
    assert max(errors.values()) <= ATOL
    mtp_args = spec.make_args({**spec.hf.args_from_hf_config(hf_cfg), "mtp_depth": 1})
    with pytest.raises(ConfigError, match="mtp_depth=1"):
        spec.hf.to_hf_config(mtp_args, bos_id=None, eos_id=None, dtype="float32")


# -- presets: parameter counts vs the published ones -----------------------------------------------

# (total, active) as published. "Active" is counted as the labs do: every parameter a token's forward
# multiplies by (output head included), not the input-embedding lookup.
PUBLISHED = {
    "deepseek_v2_lite": (15.7e9, 2.4e9),
    "deepseek_v3": (671e9, 37e9),
    "kimi_k2": (1.04e12, 32e9),
}
# DeepSeek-V2-Lite's "2.4B" is 2.45B by every convention that gives the others within 1% (the paper
# rounds down): 2.2% off, so its active bound is 2.5%; every other bound is 2%.
ACTIVE_RTOL = {"deepseek_v2_lite": 0.025}


def test_preset_parameter_counts_match_published() -> None:
    from tests.configs import make_config

    spec = get_spec("deepseek_v3")
    for name, (total, active) in PUBLISHED.items():
        args = make_config(f"model={name}").model
        with torch.device("meta"):
            model = spec.build(args)
        n = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
        counts = spec.param_counts(args)
        assert n == counts.total  # the analytic count is the built model's
        matmul_active = counts.active - counts.embedding
        print(
            f"\n{name}: total {n / 1e9:.2f}B (published {total / 1e9:g}B, {n / total - 1:+.2%}), active "
            f"{matmul_active / 1e9:.2f}B (published {active / 1e9:g}B, {matmul_active / active - 1:+.2%}; "
            f"{counts.active / 1e9:.2f}B with the embedding lookup)"
        )
        assert abs(n / total - 1) < 0.02
        assert abs(matmul_active / active - 1) < ACTIVE_RTOL.get(name, 0.02)


# -- generation: the KV cache holds the latents --------------------------------------------------


def _tiny_args(**overrides):
    from tests.configs import make_config

    base = make_config("model=deepseek_v3_debug").model
    fields = dict(
        dim=64,
        n_layers=3,
        n_heads=4,
        vocab_size=97,
        ffn_hidden_dim=96,
        max_seq_len=24,
        q_lora_rank=32,
        kv_lora_rank=16,
        qk_nope_head_dim=8,
        qk_rope_head_dim=8,
        v_head_dim=12,
        moe_hidden_dim=32,
    )
    import dataclasses

    return dataclasses.replace(base, **{**fields, **overrides})


def test_latent_kv_cache_matches_full_recompute() -> None:
    from models.attention import LatentKVCacheCore
    from models.generation import generate, kv_cache

    spec = get_spec("deepseek_v3")
    args = _tiny_args()
    model = spec.build(args).eval()
    model.init_weights(seed=1)
    prompt = torch.randint(0, args.vocab_size, (7,), generator=torch.Generator().manual_seed(0)).tolist()
    # 30 new tokens with a 24-token window: the window slides and the cache is refilled.
    plain = generate(model, prompt, max_new_tokens=30, temperature=0, use_cache=False)
    cached = generate(model, prompt, max_new_tokens=30, temperature=0, use_cache=True)
    assert cached == plain and len(cached) == len(prompt) + 30
    tokens = torch.tensor([plain[:12]])
    with torch.no_grad():
        full = model(tokens)
    with torch.no_grad(), kv_cache(model, args.max_seq_len) as caches:
        first = model(tokens[:, :5], torch.arange(5))
        rest = [model(tokens[:, i : i + 1], torch.tensor([i])) for i in range(5, 12)]
        cache = caches[0]
        assert isinstance(cache, LatentKVCacheCore)
        per_token = cache.latent.shape[-1]  # what the cache keeps per token and layer
    torch.testing.assert_close(torch.cat([first, *rest], dim=1), full, rtol=1e-5, atol=1e-5)
    expanded = args.n_heads * (args.qk_head_dim + args.v_head_dim)
    assert per_token == args.kv_lora_rank + args.qk_rope_head_dim
    print(
        f"\nMLA KV cache: {per_token} numbers per token and layer vs {expanded} expanded K/V "
        f"({expanded / per_token:.1f}x less); greedy tokens identical with and without the cache"
    )


# -- MTP: gradient of LM loss + weight / D * summed MTP loss per token, reported loss next-token only ---


def test_mtp_adds_its_weighted_loss_to_the_gradient_only() -> None:
    import torch.nn.functional as F

    spec = get_spec("deepseek_v3")
    args = _tiny_args(mtp_depth=2, mtp_loss_weight=0.5)
    model = spec.build(args)
    model.init_weights(seed=4)
    base = spec.build(_tiny_args())  # the same model without MTP modules
    base.load_state_dict({k: v for k, v in model.state_dict().items() if not k.startswith("mtp.")})
    tokens = torch.randint(0, args.vocab_size, (2, 16), generator=torch.Generator().manual_seed(3))
    logits = model(tokens)
    torch.testing.assert_close(logits, base(tokens), rtol=0, atol=0)  # next-token logits unchanged
    (stats,) = model.mtp_records  # (D, 2): summed cross-entropy, targets per depth
    assert stats.shape == (2, 2)
    F.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten()).backward()
    got = {n: p.grad.clone() for n, p in model.named_parameters()}
    # Reference: the explicit objective, through an independent forward of the MTP modules.
    model.zero_grad()
    emb = model.tok_embeddings(tokens)
    h = emb
    for layer in model.layers.values():
        h = layer(h, rope_cache=model.rope_cache)
    lm = F.cross_entropy(model.output(model.norm(h))[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())
    mtp, prev = [], h
    for k in (1, 2):
        module = model.mtp[str(k - 1)]
        n = tokens.shape[1] - k
        x = module.proj(torch.cat([module.hnorm(prev[:, :n]), module.enorm(emb[:, k:])], dim=-1))
        prev = module.block(x, rope_cache=model.rope_cache)
        mtp.append(
            F.cross_entropy(
                model.output(model.norm(prev[:, : n - 1])).flatten(0, 1),
                tokens[:, k + 1 :].flatten(),
                reduction="sum",
            )
        )
    torch.testing.assert_close(torch.stack(mtp).detach(), stats[:, 0])
    assert stats[:, 1].tolist() == [2 * (16 - k - 1) for k in (1, 2)]
    # standalone (no trainer): weight / D * summed MTP cross-entropy per token of the forward
    (lm + 0.5 / 2 * torch.stack(mtp).sum() / tokens.numel()).backward()
    worst = max(
        ((got[n] - p.grad).abs().max() / p.grad.abs().max().clamp(min=1e-12)).item()
        for n, p in model.named_parameters()
        if p.grad is not None
    )
    assert all(got[n].abs().sum() > 0 for n in got if n.startswith("mtp."))
    print(
        "\nMTP gradient vs explicit LM + 0.5 / D * MTP sum per token objective: max relative difference "
        f"{worst:.1e}"
    )
    assert worst < 1e-5


def test_mtp_targets_stop_at_packed_document_boundaries() -> None:
    """Block-causal masking: two documents packed in one window train MTP exactly as each alone -- the
    targets that cross into the other document are ignored (the family's ``mtp_targets``), the
    next-token loss's positions restart, and the (D, 2) MTP loss sums and target counts add up."""
    from models.deepseek_v3.model import mtp_targets
    from trainer.step import document_positions

    spec = get_spec("deepseek_v3")
    args = _tiny_args(mtp_depth=2, attention_mask="block_causal")
    model = spec.build(args)
    model.init_weights(seed=5)
    bos, eos = 1, 2
    g = torch.Generator().manual_seed(6)
    doc_a = [bos, *torch.randint(3, 97, (7,), generator=g).tolist(), eos]  # 9 tokens
    doc_b = [bos, *torch.randint(3, 97, (12,), generator=g).tolist()]  # 13 tokens, continues past the window
    after = 50  # the label of the window's last token (the next token of document b)

    def stats(tokens: list[int], last_label: int) -> torch.Tensor:
        inputs = torch.tensor([tokens])
        labels = torch.tensor([[*tokens[1:], last_label]])
        positions = document_positions(inputs, bos, eos)
        ids, targets = mtp_targets(inputs, labels, args.mtp_depth, positions)
        model.mtp_records = []
        model(inputs, positions=positions, mtp_inputs=ids, mtp_labels=targets)
        return model.mtp_records[0], targets

    packed, targets = stats(doc_a + doc_b, after)
    alone_a, _ = stats(doc_a, -100)  # alone, document a's tokens have no label after its EOS
    alone_b, _ = stats(doc_b, after)
    # Brute force: depth k at i keeps token i+k+1 iff tokens i..i+k+1 lie in i's document.
    doc_of = [0] * len(doc_a) + [1] * (len(doc_b) + 1)
    window = doc_a + doc_b + [after]
    for k in (1, 2):
        want = [
            window[i + k + 1] if i + k + 1 < len(window) and doc_of[i + k + 1] == doc_of[i] else -100
            for i in range(len(doc_a + doc_b))
        ]
        assert targets[0, :, k - 1].tolist() == want
    counts = packed[:, 1].tolist()
    assert (
        counts == (alone_a[:, 1] + alone_b[:, 1]).tolist() == [7 + 12, 6 + 11]
    )  # a: 9 - k - 1, b: 14 - k - 1
    torch.testing.assert_close(packed[:, 0], alone_a[:, 0] + alone_b[:, 0], rtol=1e-5, atol=1e-5)
    print(
        f"\npacked documents: MTP targets per depth {counts} (ignored across the boundary), loss sums "
        f"{packed[:, 0].tolist()} = separate documents' {(alone_a[:, 0] + alone_b[:, 0]).tolist()}"
    )


# -- the debug preset trains from ./launch.sh; MTP layouts it cannot run are refused -------------------


@pytest.mark.slow
def test_debug_preset_trains_from_launch_sh(tmp_path) -> None:
    """./launch.sh +experiment=deepseek_v3_debug (2 CPU ranks: FSDP, experts over ep=2, one MTP module) on the
    built-in corpus: the next-token loss falls, and mtp_loss (logged apart) falls too."""
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
            "+experiment=deepseek_v3_debug",
            "training.steps=12",
            "training.seq_len=128",
            "training.global_batch_size=8",
            "lr_scheduler.warmup_steps=3",
            "metrics.log_freq=4",
            "training.eval_freq=12",
            "training.eval_steps=1",
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
    train = [r for r in map(json.loads, (dump / "metrics.jsonl").read_text().splitlines()) if "loss" in r]
    losses, mtp = [r["loss"] for r in train], [r["mtp_loss"] for r in train]
    print(f"\ndeepseek_v3_debug via ./launch.sh: loss {losses}, mtp_loss {mtp}")
    assert [r["step"] for r in train] == [1, 4, 8, 12]
    assert losses[-1] < losses[0] - 1.0 and mtp[-1] < mtp[0] - 1.0
    assert all(r["aux_loss"] is not None and r["moe_imbalance_max"] >= 1 for r in train)


@pytest.mark.parametrize("axis", ["pp"])  # TP and CP run MTP (tests/parallelisms/test_deepseek_v3_parity.py)
def test_mtp_with_a_layout_it_cannot_run_is_refused(axis: str) -> None:
    from parallelisms.validate import validated_dims
    from tests.configs import make_config

    cfg = make_config(
        "+experiment=deepseek_v3_debug", "parallelism.ep=1", f"parallelism.{axis}=2", "parallelism.dp_shard=1"
    )
    t = cfg.training
    with pytest.raises(ConfigError, match=f"model.mtp_depth=1 with parallelism.{axis}=2"):
        validated_dims(
            cfg.parallelism,
            2,
            spec=get_spec("deepseek_v3"),
            model_args=cfg.model,
            seq_len=t.seq_len,
            global_batch_size=t.global_batch_size,
            micro_batch_size=t.micro_batch_size,
            compile=False,
            device_type="cpu",
        )


# -- the planner on DeepSeek-V3 ----------------------------------------------------------------------


def test_plan_of_the_deepseek_v3_layout_and_mla_activations(capsys) -> None:
    """``python -m trainer.plan +experiment=deepseek_v3_ep_pp`` plans the 671B model at its training scale;
    MLA's saved latents do not shrink with tensor parallel (replicated down-projections), its per-head
    tensors do."""
    from trainer.plan import main
    from trainer.planner.activations import layer_activation_bytes

    assert main(["+experiment=deepseek_v3_ep_pp", "cluster=h200_node"]) == 0
    out = capsys.readouterr().out
    print("\n" + out)
    assert "PP16 x FSDP128 x EP64" in out and "verdict: fits" in out
    spec = get_spec("deepseek_v3")

    def by_tp(args) -> tuple[float, float]:
        return tuple(
            layer_activation_bytes(spec, args, tp=tp, sequence_parallel=True, act_bytes=2) for tp in (1, 2)
        )

    small, large = by_tp(_tiny_args(kv_lora_rank=16)), by_tp(_tiny_args(kv_lora_rank=64))
    # a larger KV latent costs the same bytes per token at tp=1 and tp=2: latents are not split ...
    assert large[0] - small[0] == large[1] - small[1] == 2 * (2 * 48) > 0
    # ... while the per-head tensors are
    assert by_tp(_tiny_args(n_heads=8, dim=128))[1] < by_tp(_tiny_args(n_heads=8, dim=128))[0]
