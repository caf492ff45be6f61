"""The Qwen3.5 hybrid families (Gated DeltaNet + gated attention, dense and MoE) against independent
references: transformers' own ``Qwen3_5ForCausalLM`` / ``Qwen3_5MoeForCausalLM`` /
``Qwen3_5ForConditionalGeneration`` (its pure-PyTorch delta-rule and convolution fallbacks run on CPU)
and a naive token-by-token loop. Nothing is downloaded.

* The delta rule: our chunked form equals transformers' recurrent fallback and ours, with lengths that
  are not multiples of the chunk, a key/value head ratio of 2 and an initial state; the gradient of
  the chunked form equals autograd through the recurrent loop.
* HF both ways, on folders written by transformers' ``save_pretrained`` (seeded random weights, every
  norm gain and decay parameter randomised so that a wrong mapping shows): logits and every
  parameter's gradient of a cross-entropy loss; our export loads in transformers with our logits;
  greedy generation with our recurrent-state cache equals transformers' ``generate``; the text decoder
  of a vision-language folder (its vision tower and MTP weights skipped).
* Documents: under ``block_causal`` a packed window equals each document run alone.
* Counts: analytic = built; the published presets against the published totals.

Tolerances (fp32 on CPU): logits 1.5e-4 absolute (|logits| ~ 5; transformers in fp32 is 9.9e-5 away from
itself in fp64 here); gradients 1e-4 relative to each
tensor's largest entry (the chunked rule's triangular solve and transformers' differ in the order of
operations; measured values printed).
"""

from __future__ import annotations

import math
import os

import pytest
import torch
import torch.nn.functional as F

from models import get_spec
from models.errors import ConfigError
from models.generation import generate
from models.qwen3_5 import Qwen3_5Args, Qwen3_5HF, Qwen3_5MoeArgs
from models.qwen3_5.delta_rule import chunk_gated_delta_rule, recurrent_gated_delta_rule, short_conv
from tests.configs import make_config
from trainer.checkpoint.hf import read_hf, read_hf_config, save_hf

transformers = pytest.importorskip("transformers", reason="transformers (the dev extra) is not installed")

ATOL = 1.5e-4  # fp32 logits of order 5; transformers fp32 vs its own fp64 forward: 9.9e-5 (dense)
GRAD_RTOL = 1e-4  # max |grad difference| / max |grad| per tensor

_SHAPE = dict(
    vocab_size=128,
    hidden_size=64,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=8,
    linear_conv_kernel_dim=4,
    max_position_embeddings=256,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
)
_MOE = dict(
    num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48, shared_expert_intermediate_size=40
)
KINDS = {  # kind -> (config class, model class, extra config)
    "dense_untied": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM", dict(intermediate_size=96)),
    "dense_tied": (
        "Qwen3_5TextConfig",
        "Qwen3_5ForCausalLM",
        dict(intermediate_size=96, tie_word_embeddings=True),
    ),
    "moe_untied": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM", _MOE),
    "moe_tied": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM", dict(_MOE, tie_word_embeddings=True)),
}


def _randomise(model: torch.nn.Module, seed: int) -> None:
    """Matrices ~ N(0, 1/fan_in); vectors (zero-centred norm gains, dt_bias, the gated norm's gain)
    N(0, 0.2^2) around their init; ``A_log`` the log of U(0.1, 3.1) (decays that neither vanish nor
    forget at once)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if name.endswith("A_log"):
                p.copy_(torch.rand(p.shape, generator=g).mul(3).add(0.1).log())
            elif name.endswith("linear_attn.norm.weight"):
                p.copy_(1 + 0.2 * noise)
            elif p.dim() == 1:
                p.copy_(0.2 * noise)
            else:
                p.copy_(noise / math.sqrt(p.shape[-1]))


def _hf_model(kind: str, seed: int) -> torch.nn.Module:
    cfg_cls, model_cls, extra = KINDS[kind]
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(getattr(transformers, cfg_cls)(**_SHAPE, **extra)).float().eval()
    _randomise(model, seed)
    return model


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, tuple[str, torch.nn.Module]]:
    """kind -> (folder written by transformers' save_pretrained, the transformers model in eval)."""
    root = tmp_path_factory.mktemp("qwen3_5_hf")
    out = {}
    for seed, kind in enumerate(KINDS):
        model = _hf_model(kind, seed)
        folder = str(root / kind)
        model.save_pretrained(folder)
        out[kind] = (folder, model)
    return out


def _ours(folder: str) -> torch.nn.Module:
    spec, args, state = read_hf(folder)
    model = spec.build(args)
    model.load_state_dict(state, strict=True)
    model.reset_rope_cache("cpu")
    return model.eval()


def _logits(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    out = model(tokens)
    return getattr(out, "logits", out)


# -- the delta rule and the convolution -------------------------------------------------------------


def _rule_inputs(B: int, S: int, nk: int, nv: int, dk: int, dv: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randn(B, S, nk, dk, generator=g),
        torch.randn(B, S, nk, dk, generator=g),
        torch.randn(B, S, nv, dv, generator=g),
        -torch.rand(B, S, nv, generator=g) * 2,
        torch.rand(B, S, nv, generator=g),
    ]


@pytest.mark.parametrize("S,chunk", [(77, 16), (64, 64), (5, 64)])
def test_chunked_rule_matches_transformers_recurrent_and_ours(S: int, chunk: int) -> None:
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_recurrent_gated_delta_rule

    q, k, v, g, beta = _rule_inputs(2, S, 2, 4, 16, 8, seed=S)
    state0 = torch.randn(2, 4, 16, 8, generator=torch.Generator().manual_seed(1)) * 0.1
    want, want_state = torch_recurrent_gated_delta_rule(
        q, k, v, g, beta, initial_state=state0, output_final_state=True, use_qk_l2norm_in_kernel=True
    )
    got, state = chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=chunk, initial_state=state0)
    loop, loop_state = recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=state0)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(state, want_state, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(loop, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(loop_state, want_state, atol=1e-5, rtol=1e-5)


def test_chunked_rule_gradients_match_the_recurrent_loop() -> None:
    inputs = [t.double().requires_grad_() for t in _rule_inputs(1, 37, 1, 2, 8, 4, seed=3)]
    weight = torch.randn(1, 37, 2, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    grads = []
    for fn in (
        lambda *t: chunk_gated_delta_rule(*t, chunk_size=8)[0],
        lambda *t: recurrent_gated_delta_rule(*t)[0],
    ):
        out = fn(*inputs)
        grads.append(torch.autograd.grad((out * weight).sum(), inputs))
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)  # both run in fp32 inside


def test_short_conv_matches_transformers_and_restarts_at_documents() -> None:
    from transformers.models.qwen3_5.modeling_qwen3_5 import causal_conv1d_fn

    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(2, 21, 12, generator=g), torch.randn(12, 1, 4, generator=g)
    y, tail = short_conv(x, w)
    want = causal_conv1d_fn(x.transpose(1, 2), w.squeeze(1), None, activation="silu").transpose(1, 2)
    torch.testing.assert_close(y, want)
    assert torch.equal(tail, x[:, -3:])
    # a tail continues the sequence: two halves equal the whole
    first, tail = short_conv(x[:, :10], w)
    second, _ = short_conv(x[:, 10:], w, tail)
    torch.testing.assert_close(torch.cat([first, second], 1), y)
    # documents (starts at 0, 2, 3 and 9; one of length 1) each alone
    resets = torch.zeros(2, 21, dtype=torch.bool)
    resets[:, [0, 2, 3, 9]] = True
    docs, _ = short_conv(x, w, resets=resets)
    for a, b in ((0, 2), (2, 3), (3, 9), (9, 21)):
        torch.testing.assert_close(docs[:, a:b], short_conv(x[:, a:b], w)[0])


def test_two_pass_state_hand_off_over_slices_equals_the_whole_sequence() -> None:
    """The math of context parallelism's two-pass form, on one process: each slice of a sequence (as
    a cp rank holds it) computes its chunk terms and its (M, S) from a zero state; the prefix
    combination S0_j = M_{j-1} S0_{j-1} + S_{j-1} gives each slice its incoming state; a scan from it
    equals the whole sequence's outputs, values and gradients. Documents cross slice boundaries and
    start at one; slices are not multiples of the chunk. The convolution's tail (with its document
    starts) crosses the boundaries too."""
    from models.qwen3_5.delta_rule import chunk_terms, scan_chunks, state_transition

    S, cuts = 77, [0, 20, 50, 77]
    leaves = [t.requires_grad_() for t in _rule_inputs(2, S, 2, 4, 16, 8, seed=11)]
    resets = torch.zeros(2, S, dtype=torch.bool)
    resets[0, [0, 18, 50, 51]] = True  # a start at the second boundary, one just before the first
    resets[1, [0, 33]] = True
    weight = torch.randn(2, S, 4, 8, generator=torch.Generator().manual_seed(12))
    whole, _ = chunk_gated_delta_rule(*leaves, chunk_size=16, resets=resets)
    want = torch.autograd.grad((whole * weight).sum(), leaves)
    terms = [
        chunk_terms(*(t[:, a:b] for t in leaves), chunk_size=16, resets=resets[:, a:b])
        for a, b in zip(cuts, cuts[1:])
    ]
    transitions = [state_transition(t) for t in terms]
    state, outs = None, []
    for t, (m, s) in zip(terms, transitions):
        outs.append(scan_chunks(t, state)[0])
        state = s if state is None else m @ state + s
    got = torch.cat(outs, 1)
    torch.testing.assert_close(got, whole, atol=1e-5, rtol=1e-5)
    for a, b in zip(torch.autograd.grad((got * weight).sum(), leaves), want):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    # the convolution: each slice gets the previous slice's last K-1 inputs and their document starts
    x, w = torch.randn(2, S, 12, generator=torch.Generator().manual_seed(13)), torch.randn(12, 1, 4)
    conv_whole, _ = short_conv(x, w, resets=resets)
    parts = []
    for a, b in zip(cuts, cuts[1:]):
        tail = x[:, a - 3 : a] if a else None
        tail_resets = resets[:, a - 3 : a] if a else None
        parts.append(short_conv(x[:, a:b], w, tail, resets[:, a:b], tail_resets)[0])
    torch.testing.assert_close(torch.cat(parts, 1), conv_whole)


# -- HF both ways ----------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", list(KINDS))
def test_import_matches_transformers_logits_and_gradients(folders, kind: str) -> None:
    folder, hf = folders[kind]
    ours = _ours(folder)
    args = ours.args
    assert isinstance(args, Qwen3_5MoeArgs) == kind.startswith("moe")
    assert args.tie_embeddings == kind.endswith("_tied")
    assert (args.linear_num_key_heads, args.linear_num_value_heads, args.rotary_dim) == (2, 4, 8)
    tokens = torch.randint(0, 128, (2, 70), generator=torch.Generator().manual_seed(1))
    labels = torch.randint(0, 128, (2, 70), generator=torch.Generator().manual_seed(2))
    losses = []
    for model in (hf, ours):
        model.zero_grad()
        logits = _logits(model, tokens)
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
        loss.backward()
        losses.append((logits.detach(), loss.item()))
    (want, want_loss), (got, got_loss) = losses
    diff = (got - want).abs().max().item()
    assert diff <= ATOL, diff
    assert abs(got_loss - want_loss) <= 1e-5 * abs(want_loss)
    # every gradient, mapped through our export (the fused DeltaNet tensors concatenated)
    adapter = Qwen3_5HF(args.family)
    grads = {n: p.grad for n, p in ours.named_parameters()}
    hf_grads = {n: p.grad for n, p in hf.named_parameters()}
    worst = 0.0
    for hf_name, grad in adapter.to_hf_state(grads, args):
        if ".mlp.experts." in hf_name:  # transformers keeps the experts fused in memory
            layer, j, proj = hf_name.split(".")[2], int(hf_name.split(".")[5]), hf_name.split(".")[6]
            fused = hf_grads[f"model.layers.{layer}.mlp.experts.gate_up_proj"][j]
            F_ = fused.shape[0] // 2
            ref = {"gate_proj": fused[:F_], "up_proj": fused[F_:]}.get(proj)
            if ref is None:
                ref = hf_grads[f"model.layers.{layer}.mlp.experts.down_proj"][j]
        else:
            ref = hf_grads[hf_name]
        err = (grad - ref).abs().max().item() / max(ref.abs().max().item(), 1e-12)
        worst = max(worst, err)
        assert err <= GRAD_RTOL, (hf_name, err)
    print(
        f"\n{kind}: max |logit diff| {diff:.1e} (|logits| <= {want.abs().max():.1f}); "
        f"worst grad error {worst:.1e}"
    )


@pytest.mark.parametrize("kind", ["dense_untied", "moe_tied"])
def test_sliced_reader_reads_the_same_tensors(folders, kind: str) -> None:
    """``checkpoint.initial_load_hf``'s per-rank reader (row ranges of the fused q/k/v tensors, per-expert
    tensors) gives the whole-folder reader's tensors; a stale routing bias is reset."""
    from trainer.checkpoint.hf import load_hf_into

    folder, _ = folders[kind]
    expected = _ours(folder).state_dict()
    spec, args = read_hf_config(folder)
    with torch.device("meta"):
        model = spec.build(args)
    model.to_empty(device="cpu")
    for name, buf in model.named_buffers():
        if name.endswith("expert_bias"):
            buf.fill_(3.0)
    load_hf_into(model, folder, spec, args)
    got = model.state_dict()
    assert got.keys() == expected.keys()
    assert all(torch.equal(v, expected[k]) for k, v in got.items())


@pytest.mark.parametrize("kind", ["dense_untied", "moe_tied"])
def test_export_loads_in_transformers_with_our_logits(folders, kind: str, tmp_path) -> None:
    folder, _ = folders[kind]
    ours = _ours(folder)
    spec = get_spec(ours.args.family)
    out = str(tmp_path / "export")
    save_hf(ours.state_dict(), spec, ours.args, out)
    loaded = getattr(transformers, KINDS[kind][1]).from_pretrained(out).float().eval()
    tokens = torch.randint(0, 128, (1, 40), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        diff = (_logits(loaded, tokens) - _logits(ours, tokens)).abs().max().item()
    assert diff <= ATOL, diff
    # the export reads back to the same tensors
    _, _, again = read_hf(out)
    assert all(torch.equal(v, again[k]) for k, v in ours.state_dict().items())
    # the running job's writer (one HF tensor at a time: q, k, v gathered together) writes the same
    from safetensors.torch import load_file

    from trainer.checkpoint.hf import save_hf_distributed

    streamed = str(tmp_path / "streamed")
    os.makedirs(streamed)
    save_hf_distributed(ours, spec, ours.args, streamed, is_writer=True)
    a, b = (load_file(os.path.join(d, "model.safetensors")) for d in (out, streamed))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("kind", ["dense_tied", "moe_untied"])
def test_greedy_generation_with_the_recurrent_cache_equals_transformers(folders, kind: str) -> None:
    folder, hf = folders[kind]
    ours = _ours(folder)
    prompt = torch.randint(0, 128, (9,), generator=torch.Generator().manual_seed(5)).tolist()
    with torch.no_grad():
        want = hf.generate(
            torch.tensor([prompt]), max_new_tokens=20, do_sample=False, eos_token_id=None, pad_token_id=0
        )[0].tolist()
    cached = generate(ours, prompt, max_new_tokens=20, temperature=0, use_cache=True)
    plain = generate(ours, prompt, max_new_tokens=20, temperature=0, use_cache=False)
    assert cached == want == plain


def test_vision_language_folder_imports_its_text_decoder(tmp_path, caplog) -> None:
    cfg = transformers.Qwen3_5Config(
        text_config={**_SHAPE, "intermediate_size": 96},
        vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64),
    )
    torch.manual_seed(0)
    vl = transformers.Qwen3_5ForConditionalGeneration(cfg).float().eval()
    _randomise(vl, 7)
    folder = str(tmp_path / "vl")
    vl.save_pretrained(folder)
    # an MTP tensor, as the published folders hold: named and skipped
    from safetensors.torch import load_file, save_file

    state = load_file(os.path.join(folder, "model.safetensors"))
    assert any(k.startswith("model.visual.") for k in state)
    state["mtp.fc.weight"] = torch.zeros(64, 128)
    save_file(state, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
    spec, args = read_hf_config(folder)
    assert spec.family == "qwen3_5" and isinstance(args, Qwen3_5Args)
    ours = _ours(folder)
    tokens = torch.randint(0, 128, (1, 33), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        want = vl(input_ids=tokens).logits
        diff = (_logits(ours, tokens) - want).abs().max().item()
    assert diff <= ATOL, diff
    # checkpoint.initial_load_hf's per-rank reader reads the same decoder
    from trainer.checkpoint.hf import load_hf_into

    with torch.device("meta"):
        sliced = spec.build(args)
    sliced.to_empty(device="cpu")
    with caplog.at_level("INFO", logger="meshwright"):
        load_hf_into(sliced, folder, spec, args)
    assert "tensors the qwen3_5 model does not use" in caplog.text
    assert all(torch.equal(v, ours.state_dict()[k]) for k, v in sliced.state_dict().items())
    # an unknown tensor is still refused by name
    state["model.language_model.layers.0.extra.weight"] = torch.zeros(1)
    save_file(state, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ConfigError, match="extra.weight"):
        read_hf(folder)


# -- documents ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe"])
def test_packed_documents_equal_each_document_alone(family: str) -> None:
    """Two packed rows of 45 tokens (not a multiple of the chunk of 16), documents marked by BOS as
    the trainer marks them (``trainer.step.document_positions``): starts at a chunk boundary (16, 32),
    inside chunks, documents of 1 and 2 tokens (shorter than the conv kernel of 4)."""
    from trainer.step import document_positions

    preset = "qwen3_5_debug" if family == "qwen3_5" else "qwen3_5_moe_debug"
    args = make_config(
        f"model={preset}", "model.attention_mask=block_causal", "model.linear_chunk_size=16", "model.dim=64"
    ).model
    model = get_spec(family).build(args)
    model.init_weights(seed=3)
    model.eval()
    bos = 1
    rows = [[0, 5, 7, 16, 30], [0, 2, 3, 20, 32, 34]]
    tokens = torch.randint(2, args.vocab_size, (2, 45), generator=torch.Generator().manual_seed(0))
    for r, starts in enumerate(rows):
        tokens[r, starts] = bos
    positions = document_positions(tokens, bos, None)
    with torch.no_grad():
        packed = model(tokens, positions)
        for r, starts in enumerate(rows):
            for a, b in zip(starts, [*starts[1:], 45]):
                alone = model(tokens[r : r + 1, a:b])
                torch.testing.assert_close(packed[r : r + 1, a:b], alone, atol=1e-5, rtol=1e-5)
    # the same window without document masking mixes the documents (the test can fail)
    args.attention_mask = "causal"
    plain = get_spec(family).build(args)
    plain.load_state_dict(model.state_dict())
    plain.reset_rope_cache("cpu")
    with torch.no_grad():
        assert not torch.allclose(plain(tokens)[0, 5:7], model(tokens[:1, 5:7]), atol=1e-3)


# -- counts and presets --------------------------------------------------------------------------------

# Published totals (model cards: "4B"; "35B in total and 3B activated"), which count the vision tower
# (~0.3-0.4B) that our text decoder has not: the text decoder must be within 5% below them.
PUBLISHED = {"qwen3_5_4b": (4.0e9, None), "qwen3_5_35b_a3b": (35e9, 3e9)}


@pytest.mark.parametrize("preset", ["qwen3_5_debug", "qwen3_5_moe_debug", "qwen3_5_4b", "qwen3_5_35b_a3b"])
def test_counts_match_the_built_model_and_the_published_totals(preset: str) -> None:
    args = make_config(f"model={preset}").model
    spec = get_spec(args.family)
    with torch.device("meta"):
        model = spec.build(args)
    n = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    counts = spec.param_counts(args)
    assert n == counts.total
    # transformers' own model from our exported config on meta: the same count
    hf_cfg = spec.hf.to_hf_config(args, bos_id=None, eos_id=None, dtype="float32")
    cls = "Qwen3_5MoeTextConfig" if spec.has_experts else "Qwen3_5TextConfig"
    model_cls = "Qwen3_5MoeForCausalLM" if spec.has_experts else "Qwen3_5ForCausalLM"
    with torch.device("meta"):
        hf = getattr(transformers, model_cls)(getattr(transformers, cls)(**hf_cfg))
    assert sum(p.numel() for p in {id(p): p for p in hf.parameters()}.values()) == n
    if preset in PUBLISHED:
        total, active = PUBLISHED[preset]
        assert 0.95 * total <= n <= total * 1.06, n
        if active is not None:
            non_embedding_active = counts.active - counts.embedding
            assert abs(non_embedding_active - active) / active < 0.02, non_embedding_active
        print(f"\n{preset}: {n / 1e9:.2f}B parameters, {counts.active / 1e9:.2f}B active")


def test_bad_input_is_refused_by_name() -> None:
    with pytest.raises(ConfigError, match="linear_num_value_heads=3"):
        Qwen3_5Args(linear_num_key_heads=2, linear_num_value_heads=3).validate()
    with pytest.raises(ConfigError, match="qk_norm"):
        Qwen3_5Args(qk_norm=False).validate()
    with pytest.raises(ConfigError, match="layer_types"):
        Qwen3_5HF("qwen3_5").args_from_hf_config(
            {
                **transformers.Qwen3_5TextConfig(**_SHAPE, intermediate_size=96).to_dict(),
                "layer_types": ["full_attention", "linear_attention", "linear_attention", "full_attention"],
            }
        )


@pytest.mark.parametrize("impl,balance", [("allgather", "headtail"), ("ring", "none")])
def test_context_parallel_needs_contiguous_slices(impl: str, balance: str) -> None:
    """The DeltaNet's state goes from each cp rank to the next: head-tail slices (not in order) and
    ring attention (which leaves the DeltaNet's core alone) are refused by name; contiguous all-gather
    is accepted."""
    from parallelisms.validate import validate_cp

    spec = get_spec("qwen3_5")
    kw = dict(cp=2, tp=1, sequence_parallel=False, seq_len=64, device_type="cuda", attention_mask="causal")
    with pytest.raises(ConfigError, match="cp_load_balance=none and parallelism.cp_impl=allgather"):
        validate_cp(cp_impl=impl, load_balance=balance, sequential_state=spec.sequential_state, **kw)
    validate_cp(cp_impl="allgather", load_balance="none", sequential_state=spec.sequential_state, **kw)


def test_muon_leaves_the_convolution_kernels_to_adamw() -> None:
    """Muon orthogonalises matrices and stacks of expert matrices; the DeltaNet's (C, 1, K) convolution
    kernels have none, so they join AdamW's decayed group; the stacked experts stay Muon's."""
    from trainer.optim.muon import muon_param_groups

    cfg = make_config("model=qwen3_5_moe_debug", "optimizer=muon")
    spec = get_spec(cfg.model.family)
    with torch.device("meta"):
        model = spec.build(cfg.model)
    groups = muon_param_groups(model, cfg.optimizer, spec.first_modules + spec.last_modules)
    muon = {n for g in groups if g["use_muon"] for n in g["names"]}
    adamw = {n for g in groups if not g["use_muon"] for n in g["names"]}
    assert "layers.0.delta_net.q_conv.weight" in adamw and "layers.0.delta_net.q_conv.weight" not in muon
    assert {"layers.0.moe.experts.w1", "layers.0.delta_net.wq.weight", "layers.3.attention.wq.weight"} <= muon
