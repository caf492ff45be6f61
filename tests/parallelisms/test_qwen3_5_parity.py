"""The Qwen3.5 hybrid families (Gated DeltaNet + gated attention, dense and MoE) train the same model
in parallel layouts as in one process (fp32, CPU, gloo): per-step losses and pre-clip gradient norms
within 1e-5 relative, final weights within 1e-5 (``tests/parity.py``).

The tiny shape (``tests/configs.py``'s TINY on ``qwen3_5_debug`` / ``qwen3_5_moe_debug``): 4 blocks (3 Gated
DeltaNet, 1 gated attention), DeltaNet 2 key / 4 value heads (a ratio of 2) of 32, chunk 16 over windows
of 32 (two chunks). Layouts: FSDP, custom DDP + ZeRO-1, TP x2 with sequence parallel (the DeltaNet's
heads, convolution channels and decay vectors split over tp), activation checkpointing, pipeline x2, and
packed short documents (``block_causal``: the state and the convolution window restart at each of the
several documents of a window) under TP; context parallel x2 (causal), x2 and x4 on the short documents
(documents cross the ranks: the state and the conv window are handed over), contiguous slices, and TP x2
x CP x2 on them; pipeline x2 x TP x2, and pipeline x2 x CP x2 on the short documents (each stage's
DeltaNet layers hand their state over cp); HSDP 2 x 2; the MoE
family under FSDP, expert parallel x2, TP x2, CP x2 and Muon (matrices and stacked experts) under FSDP.
All cases of a world size run in one spawn.

Measured (4 steps, lr 1e-3): losses within 1.5e-7 and grad norms within 5.7e-6 relative everywhere; final
weights within 6e-7 (data parallel, EP, PP), 3e-6 (CP) and 5.3e-6 (TP); PP x2 x TP x2: loss 6.9e-8, grad
norm 2.0e-6, weights 1.5e-6; PP x2 x CP x2 (documents): loss 7.4e-8, grad norm 1.3e-6, weights 1.8e-6.
MoE x TP reaches 1.25e-5 in one element of a DeltaNet ``wv`` (Adam turns the ~1e-7 reduction-order
differences of a near-zero gradient into a different step), so that layout's weights are compared at
3e-5; its losses and grad norms keep 1e-5.
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.configs import NO_CLIP, PARITY_STEPS, tiny_config
from tests.parity import Case, GroupedRuns, assert_parallel_run

pytestmark = pytest.mark.slow

DENSE = ["model=qwen3_5_debug", "model.attn_head_dim=32", "model.linear_chunk_size=16", "optimizer.lr=1e-3"]
DENSE = [*DENSE, PARITY_STEPS]
UNTIED = [*DENSE, "model.tie_embeddings=false"]
DOCS = [*DENSE, "model.attention_mask=block_causal"]
DOCS_UNTIED = [*DOCS, "model.tie_embeddings=false"]
MOE = ["model=qwen3_5_moe_debug", "model.attn_head_dim=32", "model.linear_chunk_size=16"]
MOE = [*MOE, "model.ffn_hidden_dim=null", "optimizer.lr=1e-3", PARITY_STEPS]
TP2 = ["parallelism.tp=2", "parallelism.dp_shard=1"]
CP = ["parallelism.cp_load_balance=none", "parallelism.dp_shard=1"]
MUON = [
    "optimizer=muon",
    "optimizer.muon.ns_dtype=float32",
]  # the convs and vectors: AdamW  # contiguous slices (the state hand-off)
REFERENCES = {
    "q35_ref": DENSE,
    "q35_ref_noclip": [*DENSE, NO_CLIP],
    "q35_untied_ref_noclip": [*UNTIED, NO_CLIP],
    "q35_docs_ref": DOCS,
    "q35_docs_untied_ref_noclip": [*DOCS, "model.tie_embeddings=false", NO_CLIP],
    "q35_moe_ref": MOE,
    "q35_moe_muon_ref": [*MOE, *MUON],
}
LAYOUTS = {  # name -> (world, reference, overrides)
    "q35_fsdp_x2": (2, "q35_ref", [*DENSE, "parallelism.dp_shard=2"]),
    "q35_custom_ddp_zero1_x2_noclip": (
        2,
        "q35_ref_noclip",
        [
            *DENSE,
            "parallelism.dp_replicate=2",
            "parallelism.dp_shard=1",
            "parallelism.ddp.sharded_optimizer=true",
        ]
        + [NO_CLIP],
    ),
    "q35_tp2_sp": (2, "q35_ref", [*DENSE, *TP2]),
    "q35_fsdp_x2_ac_full": (
        2,
        "q35_ref",
        [*DENSE, "parallelism.dp_shard=2", "training.activation_checkpoint=full"],
    ),
    "q35_pp2_noclip": (
        2,
        "q35_untied_ref_noclip",
        [*UNTIED, "parallelism.pp=2", "parallelism.dp_shard=1", NO_CLIP],
    ),
    "q35_docs_tp2_sp": (2, "q35_docs_ref", [*DOCS, *TP2]),
    "q35_cp2": (2, "q35_ref", [*DENSE, "parallelism.cp=2", *CP]),
    "q35_docs_cp2": (2, "q35_docs_ref", [*DOCS, "parallelism.cp=2", *CP]),
    "q35_docs_cp4": (4, "q35_docs_ref", [*DOCS, "parallelism.cp=4", *CP]),
    "q35_docs_tp2_x_cp2": (4, "q35_docs_ref", [*DOCS, "parallelism.tp=2", "parallelism.cp=2", *CP]),
    "q35_pp2_x_tp2_noclip": (4, "q35_untied_ref_noclip", [*UNTIED, "parallelism.pp=2", *TP2, NO_CLIP]),
    "q35_docs_pp2_x_cp2_noclip": (
        4,
        "q35_docs_untied_ref_noclip",
        [*DOCS_UNTIED, "parallelism.pp=2", "parallelism.cp=2", *CP, NO_CLIP],
    ),
    "q35_hsdp_2x2_noclip": (
        4,
        "q35_ref_noclip",
        [*DENSE, "parallelism.dp_replicate=2", "parallelism.dp_shard=2", NO_CLIP],
    ),
    "q35_moe_cp2": (2, "q35_moe_ref", [*MOE, "parallelism.cp=2", *CP]),
    "q35_moe_fsdp_x2": (2, "q35_moe_ref", [*MOE, "parallelism.dp_shard=2"]),
    "q35_moe_ep2": (2, "q35_moe_ref", [*MOE, "parallelism.ep=2", "parallelism.dp_shard=2"]),
    "q35_moe_tp2_sp": (2, "q35_moe_ref", [*MOE, *TP2]),
    "q35_moe_muon_fsdp_x2": (2, "q35_moe_muon_ref", [*MOE, *MUON, "parallelism.dp_shard=2"]),
}

PARAM_ATOL = {"q35_moe_tp2_sp": 3e-5}  # final weights (see the module doc); 1e-5 elsewhere


# A vision-language folder written by transformers (Qwen3_5ForConditionalGeneration: the published format)
# with the DENSE tiny shape, read per rank under TP x2 (``checkpoint.initial_load_hf``: row ranges of
# the fused q/k/v and conv tensors, the vision tower skipped), trained one step and written back as a
# text model by the running job (``checkpoint.last_save_in_hf``: q, k, v gathered and fused again).
HF_LOAD = "q35_vl_hf_load_tp2_export"


def check_hf_load(trainer) -> dict:  # noqa: ANN001
    """After the Trainer loaded the folder: its parameters (gathered) against the folder's decoder."""
    from tests.parity import full_params
    from trainer.checkpoint.hf import read_hf

    _, _, want = read_hf(trainer.cfg.checkpoint.initial_load_hf)
    got = full_params(trainer.model_parts)
    return {"checked": sorted(got), "mismatched": [n for n in got if not torch.equal(got[n], want[n])]}


def _write_vl_folder(folder: str) -> None:
    transformers = pytest.importorskip("transformers")
    text = dict(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=32,
        linear_value_head_dim=32,
        linear_conv_kernel_dim=4,
        max_position_embeddings=2048,
        rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25},
        tie_word_embeddings=True,
    )
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64)
    torch.manual_seed(0)
    config = transformers.Qwen3_5Config(text_config=text, vision_config=vision, tie_word_embeddings=True)
    model = transformers.Qwen3_5ForConditionalGeneration(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1 and not name.endswith("A_log"):
                p.uniform_(-0.5, 0.5)
    model.save_pretrained(folder)


def _short_documents(path: str) -> None:
    """200 documents of 3 to 40 bytes (byte tokens, + BOS/EOS): several per 32-token window, some
    shorter than the convolution kernel, starts at and inside the chunks of 16."""
    import json
    import random

    rng = random.Random(0)
    words = ["delta", "rule", "state", "gate", "a", "ok", "chunk", "conv"]
    with open(path, "w", encoding="utf-8") as f:
        for _ in range(200):
            text = " ".join(rng.choice(words) for _ in range(rng.randint(1, 7)))[: rng.randint(3, 40)]
            f.write(json.dumps({"text": text}) + "\n")


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> GroupedRuns:
    tmp = tmp_path_factory.mktemp("qwen3_5_parity")
    docs = str(tmp / "short_documents.jsonl")
    _short_documents(docs)
    data = {"q35_docs_ref", "q35_docs_tp2_sp", "q35_docs_cp2", "q35_docs_cp4", "q35_docs_tp2_x_cp2"}
    data |= {"q35_docs_untied_ref_noclip", "q35_docs_pp2_x_cp2_noclip"}
    # torch's GEMM in every run (training.cpu_gemm=torch): the TP layouts' DTensor linears run it, and the
    # final-weight bounds (1e-5) are tighter than oneDNN's other fp32 summation order after 4 AdamW steps
    docs_data = lambda name: ["data=jsonl", f"data.path={docs}"] if name in data else []  # noqa: E731
    extra = lambda name: [*docs_data(name), "training.cpu_gemm=torch"]  # noqa: E731
    cases = {
        name: Case(1, tiny_config(str(tmp / name), *ov, *extra(name))) for name, ov in REFERENCES.items()
    }
    for name, (world, _, ov) in LAYOUTS.items():
        cases[name] = Case(world, tiny_config(str(tmp / name), *ov, *extra(name)))
    folder = str(tmp / "vl_folder")
    _write_vl_folder(folder)
    load = [*DENSE, *TP2, "training.steps=1", f"checkpoint.initial_load_hf={folder}"]
    load += ["checkpoint.last_save_in_hf=true"]
    cases[HF_LOAD] = Case(2, tiny_config(str(tmp / HF_LOAD), *load), setup=check_hf_load)
    return GroupedRuns(cases)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_qwen3_5_layout_matches_single_process(layout: str, runs: GroupedRuns) -> None:
    ref = runs.get(LAYOUTS[layout][1])
    losses = [r["loss"] for r in ref["history"] if "loss" in r]
    assert len(losses) == 4 and losses[-1] < losses[0], losses
    assert_parallel_run(ref, runs.get(layout), label=layout, atol=PARAM_ATOL.get(layout, 1e-5))


def test_vl_folder_loads_per_rank_under_tp_and_the_job_exports_it_back(runs: GroupedRuns) -> None:
    from trainer.checkpoint.hf import read_hf

    run = runs.get(HF_LOAD)
    observed = run["observed"]
    assert observed[0]["mismatched"] == [] and "layers.0.delta_net.wq.weight" in observed[0]["checked"]
    export = os.path.join(runs.cases[HF_LOAD].cfg.job.dump_folder, "checkpoints", "step-1-hf")
    spec, _, state = read_hf(export)
    assert spec.family == "qwen3_5"
    params = run["params"]  # tied weights once (the embedding), the export's state has the head too
    assert set(params) <= set(state) and len(params) > 30
    assert all(torch.equal(state[k], params[k]) for k in params)
    assert torch.equal(state["output.weight"], state["tok_embeddings.weight"])
