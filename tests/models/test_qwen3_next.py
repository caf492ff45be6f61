"""Qwen3-Next (``model.family=qwen3_next``: Qwen3.5-MoE's layers, ``models/qwen3_5``) against transformers'
``Qwen3NextForCausalLM``, on folders written by its ``save_pretrained`` (seeded random weights, tied and
untied): the import gives transformers' logits and every parameter's gradient (mapped through our
export, which interleaves the DeltaNet's q/k/v/z and b/a projections back into ``in_proj_qkvz`` /
``in_proj_ba`` per key-head group), our export loads in transformers with our logits and is what the
running job's writer streams, the per-rank reader reads the same rows (a tensor-parallel shard of a
fused projection is one run of rows per key-head group), greedy generation equals transformers'
``generate``, and a folder whose layers are not all MoE is refused by name. fp32, CPU; the bounds are
Qwen3.5's (``tests/models/test_qwen3_5.py``)."""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.nn.functional as F

from models.errors import ConfigError
from models.generation import generate
from models.qwen3_5 import Qwen3_5HF, Qwen3NextArgs
from tests.models.test_qwen3_5 import _MOE, _SHAPE, ATOL, GRAD_RTOL, _logits, _ours, _randomise
from trainer.checkpoint.hf import read_hf, read_hf_config, save_hf

transformers = pytest.importorskip("transformers", reason="transformers (the dev extra) is not installed")

KINDS = {"untied": {}, "tied": {"tie_word_embeddings": True}}


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, tuple[str, torch.nn.Module]]:
    """kind -> (folder written by transformers' save_pretrained, the transformers model in eval)."""
    root = tmp_path_factory.mktemp("qwen3_next_hf")
    out = {}
    for seed, (kind, extra) in enumerate(KINDS.items()):
        torch.manual_seed(seed)
        config = transformers.Qwen3NextConfig(**_SHAPE, **_MOE, **extra, intermediate_size=96)
        model = transformers.Qwen3NextForCausalLM(config).float().eval()
        _randomise(model, 10 + seed)
        folder = str(root / kind)
        model.save_pretrained(folder)
        out[kind] = (folder, model)
    return out


def _hf_grad(hf_grads: dict[str, torch.Tensor], hf_name: str) -> torch.Tensor:
    """transformers' gradient of an HF tensor name (its experts are fused in memory)."""
    if ".mlp.experts." not in hf_name:
        return hf_grads[hf_name]
    layer, j, proj = hf_name.split(".")[2], int(hf_name.split(".")[5]), hf_name.split(".")[6]
    if proj == "down_proj":
        return hf_grads[f"model.layers.{layer}.mlp.experts.down_proj"][j]
    fused = hf_grads[f"model.layers.{layer}.mlp.experts.gate_up_proj"][j]
    half = fused.shape[0] // 2
    return fused[:half] if proj == "gate_proj" else fused[half:]


@pytest.mark.parametrize("kind", list(KINDS))
def test_import_matches_transformers_logits_and_gradients(folders, kind: str) -> None:
    folder, hf = folders[kind]
    ours = _ours(folder)
    args = ours.args
    assert isinstance(args, Qwen3NextArgs) and args.family == "qwen3_next"
    assert args.tie_embeddings == (kind == "tied") and (args.num_experts, args.top_k) == (4, 2)
    tokens = torch.randint(0, 128, (2, 70), generator=torch.Generator().manual_seed(1))
    labels = torch.randint(0, 128, (2, 70), generator=torch.Generator().manual_seed(2))
    results = []
    for model in (hf, ours):
        model.zero_grad()
        logits = _logits(model, tokens)
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
        loss.backward()
        results.append((logits.detach(), loss.item()))
    (want, want_loss), (got, got_loss) = results
    diff = (got - want).abs().max().item()
    assert diff <= ATOL, diff
    assert abs(got_loss - want_loss) <= 1e-5 * abs(want_loss)
    grads = {n: p.grad for n, p in ours.named_parameters()}
    hf_grads = {n: p.grad for n, p in hf.named_parameters()}
    worst, seen = 0.0, set()
    for hf_name, grad in Qwen3_5HF("qwen3_next").to_hf_state(grads, args):
        ref = _hf_grad(hf_grads, hf_name)
        err = (grad - ref).abs().max().item() / max(ref.abs().max().item(), 1e-12)
        worst = max(worst, err)
        seen.add(hf_name)
        assert err <= GRAD_RTOL, (hf_name, err)
    assert "model.layers.0.linear_attn.in_proj_qkvz.weight" in seen
    assert "model.layers.2.linear_attn.in_proj_ba.weight" in seen
    print(
        f"\n{kind}: max |logit diff| {diff:.1e} (|logits| <= {want.abs().max():.1f}); worst grad {worst:.1e}"
    )


def test_export_loads_in_transformers_and_streams_the_same(folders, tmp_path) -> None:
    from safetensors.torch import load_file

    from trainer.checkpoint.hf import save_hf_distributed

    folder, _ = folders["untied"]
    ours = _ours(folder)
    spec = read_hf_config(folder)[0]
    out = str(tmp_path / "export")
    save_hf(ours.state_dict(), spec, ours.args, out)
    with open(os.path.join(out, "config.json"), encoding="utf-8") as f:
        written = json.load(f)
    assert written["architectures"] == ["Qwen3NextForCausalLM"] and written["mlp_only_layers"] == []
    loaded = transformers.Qwen3NextForCausalLM.from_pretrained(out).float().eval()
    tokens = torch.randint(0, 128, (1, 40), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        diff = (_logits(loaded, tokens) - _logits(ours, tokens)).abs().max().item()
    assert diff <= ATOL, diff
    original = load_file(os.path.join(folder, "model.safetensors"))
    exported = load_file(os.path.join(out, "model.safetensors"))
    assert exported.keys() == original.keys()
    assert all(torch.equal(exported[k], original[k]) for k in original)  # the same bytes back
    streamed = str(tmp_path / "streamed")
    os.makedirs(streamed)
    save_hf_distributed(ours, spec, ours.args, streamed, is_writer=True)
    again = load_file(os.path.join(streamed, "model.safetensors"))
    assert again.keys() == exported.keys() and all(torch.equal(again[k], exported[k]) for k in again)


def test_sliced_reader_reads_the_same_rows(folders) -> None:
    """``checkpoint.initial_load_hf``'s per-rank reader: the whole model, and a tp=2 shard of each fused
    projection (rows of whole heads: one run per key-head group) equal the whole tensors' rows."""
    from trainer.checkpoint.hf import load_hf_into

    folder, _ = folders["tied"]
    expected = _ours(folder).state_dict()
    spec, args = read_hf_config(folder)
    with torch.device("meta"):
        model = spec.build(args)
    model.to_empty(device="cpu")
    load_hf_into(model, folder, spec, args)
    got = model.state_dict()
    assert got.keys() == expected.keys() and all(torch.equal(v, expected[k]) for k, v in got.items())

    class Reader:
        def __init__(self) -> None:
            _, _, self.state = read_hf(folder)
            from safetensors.torch import load_file

            self.hf = load_file(os.path.join(folder, "model.safetensors"))

        def read(self, name: str, index: tuple[slice, ...]) -> torch.Tensor:
            return self.hf[name][index]

    reader, adapter = Reader(), Qwen3_5HF("qwen3_next")
    for local in ("wq", "wk", "wv", "wz", "wb", "wa"):
        name = f"layers.1.delta_net.{local}.weight"
        rows = expected[name].shape[0]
        for half in (slice(0, rows // 2), slice(rows // 2, rows)):
            piece = adapter.read_slice(name, (half, slice(None)), reader, args)
            assert torch.equal(piece, expected[name][half]), (name, half)


def test_greedy_generation_with_the_recurrent_cache_equals_transformers(folders) -> None:
    folder, hf = folders["tied"]
    ours = _ours(folder)
    prompt = torch.randint(0, 128, (9,), generator=torch.Generator().manual_seed(5)).tolist()
    with torch.no_grad():
        want = hf.generate(
            torch.tensor([prompt]), max_new_tokens=16, do_sample=False, eos_token_id=None, pad_token_id=0
        )[0].tolist()
    assert generate(ours, prompt, max_new_tokens=16, temperature=0, use_cache=True) == want


def test_dense_layers_are_refused_by_name(folders, tmp_path) -> None:
    folder, _ = folders["untied"]
    with open(os.path.join(folder, "config.json"), encoding="utf-8") as f:
        cfg = json.load(f)
    for key, value in (("mlp_only_layers", [1]), ("decoder_sparse_step", 2), ("norm_topk_prob", False)):
        bad = str(tmp_path / key)
        os.makedirs(bad)
        with open(os.path.join(bad, "config.json"), "w", encoding="utf-8") as f:
            json.dump({**cfg, key: value}, f)
        with pytest.raises(ConfigError, match=f"{key}=") as e:
            read_hf_config(bad)
        assert "experts in every layer" in str(e.value)


def test_preset_counts_match_transformers_and_the_published_total() -> None:
    """``model=qwen3_next_80b_a3b``: our count is the built model's and transformers' Qwen3NextForCausalLM's
    from our exported config (both on meta); the published "80B total, 3B active" (non-embedding)."""
    from models import get_spec
    from tests.configs import make_config

    args = make_config("model=qwen3_next_80b_a3b").model
    spec = get_spec(args.family)
    assert spec.family == "qwen3_next" and spec.hf is not None
    with torch.device("meta"):
        model = spec.build(args)
    n = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    counts = spec.param_counts(args)
    assert n == counts.total
    hf_cfg = spec.hf.to_hf_config(args, bos_id=None, eos_id=None, dtype="bfloat16")
    with torch.device("meta"):
        hf = transformers.Qwen3NextForCausalLM(transformers.Qwen3NextConfig(**hf_cfg))
    assert sum(p.numel() for p in {id(p): p for p in hf.parameters()}.values()) == n
    assert 0.95 * 80e9 <= n <= 1.02 * 80e9, n
    active = counts.active - counts.embedding  # "A3B": 3.56B without the embedding
    assert 3e9 <= active < 4e9, active
    print(f"\nqwen3_next_80b_a3b: {n / 1e9:.2f}B parameters, {counts.active / 1e9:.2f}B active")
