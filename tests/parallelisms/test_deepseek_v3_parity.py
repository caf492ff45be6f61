"""DeepSeek-V3 layouts train the same model as one process (fp32, CPU, gloo).

A tiny DeepSeek-V3 (deepseek_v3_debug shrunk: 4 layers, the first dense, MLA with a query latent,
8 experts top-2 in 4 groups (2 kept) + 1 shared, sigmoid routing, expert bias and sequence-wise aux
loss) runs 4 optimizer steps (``PARITY_STEPS``) through the real Trainer in each layout; per-step
losses, pre-clip gradient norms (1e-5 relative) and final parameters (1e-5) must equal the
single-process run's.
Config ``A``: MTP off, clipping on; ``B``: one MTP module, clipping off; ``D``: two MTP modules without
the aux loss (for CP, see ``C``), clipping off, run under TP (+SP, loss parallel) and CP (MTP's shifted
ids/targets are built on the whole sequence, then sharded); PP rejects MTP
(``parallelisms.validate._validate_mtp``).
MLA under TP splits heads (wq_b / wkv_b column-wise, wo row-wise) and replicates the low-rank
down-projections; under CP it all-gathers the latents: the CP case runs with the comm ledger, and
the test prints the bytes per token and layer gathered over cp against the expanded K/V.
"""

from __future__ import annotations

import os

import pytest

from tests.configs import PARITY_STEPS, tiny_config
from tests.parity import Case, GroupedRuns, assert_parallel_run, assert_parity

pytestmark = pytest.mark.slow

DS = [
    PARITY_STEPS,
    "model=deepseek_v3_debug",
    "model.n_kv_heads=null",
    "model.q_lora_rank=32",
    "model.kv_lora_rank=16",
    "model.qk_nope_head_dim=8",
    "model.qk_rope_head_dim=8",
    "model.v_head_dim=12",
    "model.moe_hidden_dim=32",
    "model.bias_update_coeff=0.01",
    "model.aux_loss_coeff=0.01",
]
# C: A without the auxiliary loss, for CP: the MoE aux loss (global or per sequence) is computed over the
# tokens of one forward, which under CP are a rank's shard of each sequence, so it is another objective.
CONFIGS = {
    "A": DS,
    "B": [*DS, "model.mtp_depth=1", "training.grad_clip=0"],
    "C": [*DS, "model.aux_loss_coeff=0"],
    "D": [
        *DS,
        "model.aux_loss_coeff=0",
        "model.mtp_depth=2",
        "training.grad_clip=0",
        "model.attention_mask=block_causal",
    ],  # packed documents: MTP targets stop at their boundaries
}
EP2 = ["parallelism.ep=2", "parallelism.dp_shard=2"]
DDP2 = ["parallelism.dp_replicate=2", "parallelism.dp_shard=1"]
LAYOUTS = {  # name -> (world, config, overrides)
    "fsdp2": (2, "A", ["parallelism.dp_shard=2"]),
    "fsdp2_mtp_noclip": (2, "B", ["parallelism.dp_shard=2"]),
    "custom_ddp2_mtp_noclip": (2, "B", DDP2),
    "zero1_mtp_noclip": (2, "B", [*DDP2, "parallelism.ddp.sharded_optimizer=true"]),
    "ep2_mtp_noclip": (2, "B", EP2),
    "tp2": (2, "A", ["parallelism.tp=2", "parallelism.dp_shard=1"]),
    "tp2_mtp_noclip": (2, "D", ["parallelism.tp=2", "parallelism.dp_shard=1"]),
    "tp2_nosp_mtp_noclip": (
        2,
        "D",
        [
            "parallelism.tp=2",
            "parallelism.dp_shard=1",
            "parallelism.sequence_parallel=false",
            "parallelism.loss_parallel=false",
        ],
    ),
    "cp2_mtp_noclip": (2, "D", ["parallelism.cp=2", "parallelism.dp_shard=1"]),
    "cp2": (2, "C", ["parallelism.cp=2", "parallelism.dp_shard=1"]),
    "pp2": (2, "A", ["parallelism.pp=2", "parallelism.dp_shard=1"]),
    "hsdp2x2_mtp_noclip": (4, "B", ["parallelism.dp_replicate=2", "parallelism.dp_shard=2"]),
    "ep2_tp2": (4, "A", [*EP2, "parallelism.tp=2"]),
    "ep2_tp2_mtp_noclip": (4, "D", [*EP2, "parallelism.tp=2"]),
    # DDP over dp_replicate x cp (no FSDP all-gathers): the ledger's cp all-gathers are MLA's alone
    "cp2_ddp2": (4, "C", ["parallelism.cp=2", *DDP2, "metrics.comm_ledger=true"]),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> GroupedRuns:
    tmp = str(tmp_path_factory.mktemp("dsv3"))
    cases = {f"ref_{c}": Case(1, tiny_config(os.path.join(tmp, f"ref_{c}"), *o)) for c, o in CONFIGS.items()}
    for name, (world, config, overrides) in LAYOUTS.items():
        cases[name] = Case(world, tiny_config(os.path.join(tmp, name), *CONFIGS[config], *overrides))
    return GroupedRuns(cases)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_deepseek_v3_layout_matches_single_process(layout: str, runs: GroupedRuns) -> None:
    _, config, _ = LAYOUTS[layout]
    ref = runs.get(f"ref_{config}")
    losses = [r["loss"] for r in ref["history"] if "loss" in r]
    assert len(losses) == 4 and losses[-1] < losses[0]
    if config in ("B", "D"):
        assert all(r.get("mtp_loss", 0) > 0 for r in ref["history"] if "loss" in r)
    got = runs.get(layout)
    assert_parallel_run(ref, got, label=f"deepseek_v3 {layout}")
    if config in ("B", "D"):  # the logged MTP loss too (mean over depths, microbatches, dp x cp ranks)
        worst = assert_parity(
            ref["history"], got["history"], metrics=("mtp_loss",), label=f"{layout} mtp_loss"
        )
        print(f"{layout}: mtp_loss max relative difference {worst['mtp_loss']:.2e}")


def test_mla_context_parallel_gathers_latents(runs: GroupedRuns) -> None:
    """Bytes all-gathered over cp per token and MLA layer (comm ledger) = the latent (C + R floats),
    against the expanded per-head K/V (nh * (Dqk + Dv) floats) a K/V-gathering core would move."""
    from trainer.config import TrainConfig  # noqa: F401 -- the config types the composed preset

    cfg = tiny_config("unused", *CONFIGS["C"])
    a, t = cfg.model, cfg.training
    record = [r for r in runs.get("cp2_ddp2")["history"] if "comm" in r][-1]
    ranks = record["comm"]["ranks"]
    rank0 = ranks["0"] if "0" in ranks else ranks[0]
    print(f"\nledger, rank 0, one step: {rank0}")
    gathered = rank0["all_gather"]["cp"]["bytes"]
    # per step and rank: its dp share of the batch (cp does not split it) of seq_len tokens, every layer,
    # forward
    tokens = t.global_batch_size // 2 * t.seq_len
    per_token_layer = gathered / (tokens * a.n_layers)
    latent = (a.kv_lora_rank + a.qk_rope_head_dim) * 4
    expanded = a.n_heads * (a.qk_head_dim + a.v_head_dim) * 4
    print(
        f"\nMLA cp=2: all-gathered {per_token_layer:.1f} bytes per token and layer (latent {latent} B) vs "
        f"{expanded} B of expanded K/V: {expanded / per_token_layer:.1f}x less"
    )
    assert per_token_layer == latent
