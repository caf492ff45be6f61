"""Float8 / MXFP8 training through torchao (``training.float8``), checked in emulation on CPU.

Float8 is never bitwise against high precision: each recipe is checked by its loss curve against
the same run without float8 (a floor: float8 is really on; a ceiling: it still trains the same
model) and by layout parity *within the recipe* against one process. The float8 casts are
deterministic functions of their inputs, so a layout that reduces in the same order (DDP, PP,
activation checkpointing) matches one process like a high-precision run does; FSDP and TP reduce in
another order, and a value on an e4m3 rounding boundary can then round to the neighbouring float8
value (2^-3 relative), which the tolerances below allow for.

Runs: the debug model cut to 2 blocks (14 linears, dims 32-128: all convert) on the tiny batch.
"""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch

from models import get_spec
from models.errors import ConfigError
from parallelisms.float8 import FLOAT8_RECIPES, plan_float8
from parallelisms.validate import validated_dims
from tests.configs import NO_CLIP, tiny_config
from tests.dist import run_distributed
from tests.parity import Case, GroupedRuns, assert_parity, step_metrics
from tests.trainer.test_checkpoint_reshard import _full_state, _step5
from trainer.config import TrainConfig

pytest.importorskip("torchao")

SMALL = ("model.n_layers=2", "training.micro_batch_size=4")
F8 = "training.float8.enable=true"
N_LINEARS = 14  # 2 blocks x (wq, wk, wv, wo, w1, w2, w3); never tok_embeddings or output
CONVERGE_STEPS = 20
PARITY_STEPS = 4

# Convergence (20 steps): per-step loss relative to the run without float8.
# Floor on the largest per-step difference: float8 is on (measured: see test output);
# ceiling on every step and on the final loss: it trains the same model.
FLOOR = 1e-4
CEILING = 1e-2
# Parity within a recipe against one process (losses and pre-clip grad norms, relative).
RTOL = 2e-5  # FSDP, DDP, PP, AC: measured <= 2e-6 (FSDP's sharded grad norm), 0 (PP, AC)
TP_RTOL = 1e-4  # TP, TP x FSDP (the sharded matmuls reduce in another order): measured <= 1.7e-5
# CP: not the same numbers as one process by construction -- each rank's activation (and activation
# gradient) amax, hence its float8 scale, comes from its own sequence chunk, not the whole sequence.
CP_RTOL = 2e-3  # measured: see test output

DP_SHARD = ("parallelism.dp_shard=2",)
# The FSDP cases also carry the ledgers (they count; they change no number): the all-gather bytes test.
LEDGERS = ("metrics.comm_ledger=true", "metrics.memory_ledger=true")
LAYOUTS = {  # name -> (recipe, overrides): every layout and recipe that runs on gloo
    "tensorwise/fsdp": ("tensorwise", (*DP_SHARD, *LEDGERS)),
    "tensorwise/fsdp_f8_all_gather": (
        "tensorwise",
        (*DP_SHARD, *LEDGERS, "training.float8.fsdp_float8_all_gather=true"),
    ),
    "tensorwise/tp_sp": ("tensorwise", ("parallelism.dp_shard=1", "parallelism.tp=2", *LEDGERS)),
    "tensorwise/ddp": ("tensorwise", ("parallelism.dp_shard=1", "parallelism.dp_replicate=2")),
    "tensorwise/pp": ("tensorwise", ("parallelism.dp_shard=1", "parallelism.pp=2")),
    "rowwise/fsdp": ("rowwise", DP_SHARD),
    "rowwise/tp": (
        "rowwise",
        ("parallelism.dp_shard=1", "parallelism.tp=2", "parallelism.sequence_parallel=false", *LEDGERS),
    ),
    # full AC recomputes every forward cast, the TP amax all-reduces of the forward included
    "rowwise/tp_sp_ac": (
        "rowwise",
        ("parallelism.dp_shard=1", "parallelism.tp=2", "training.activation_checkpoint=full", *LEDGERS),
    ),
    "rowwise_with_gw_hp/ddp": (
        "rowwise_with_gw_hp",
        ("parallelism.dp_shard=1", "parallelism.dp_replicate=2"),
    ),
    "mxfp8/fsdp": ("mxfp8", DP_SHARD),
    "tensorwise/ac_full": ("tensorwise", ("training.activation_checkpoint=full",)),
    # context parallel (gloo: the all-gather core): each rank scales its own sequence chunk (CP_RTOL)
    "tensorwise/cp": ("tensorwise", ("parallelism.dp_shard=1", "parallelism.cp=2")),
    # 4 ranks, one spawn: HSDP and TP x FSDP, both with float8 all-gather (TP x FSDP carries the ledgers)
    "tensorwise/hsdp_f8_all_gather": (
        "tensorwise",
        (
            "parallelism.dp_replicate=2",
            "parallelism.dp_shard=2",
            "training.float8.fsdp_float8_all_gather=true",
            "training.micro_batch_size=2",
        ),
    ),
    "tensorwise/tp_fsdp_f8_all_gather": (
        "tensorwise",
        (
            *LEDGERS,
            "parallelism.tp=2",
            "parallelism.dp_shard=2",
            "training.float8.fsdp_float8_all_gather=true",
        ),
    ),
}
MESH = ("dp_replicate", "dp_shard", "cp", "tp", "pp")
# TP layouts whose ledger is compared with the same layout without float8: what float8 adds is exactly
# the planned amax all-reduces over tp (8 B each tensorwise; one float64 per row for rowwise casts).
TP_WITHOUT_FLOAT8 = {
    "tensorwise/tp_sp": "off/tp_sp",
    "rowwise/tp": "off/tp",
    "rowwise/tp_sp_ac": "off/tp_sp_ac",
    "tensorwise/tp_fsdp_f8_all_gather": "off/tp_fsdp",
}


def _world(overrides: tuple[str, ...]) -> int:
    """The ranks of a layout: the product of the mesh sizes it sets (dp_shard=1 where it sets another)."""
    world = 1
    for o in overrides:
        key, _, value = o.partition("=")
        if key.startswith("parallelism.") and key.split(".", 1)[1] in MESH:
            world *= int(value)
    return world


def _micro(overrides: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(o for o in overrides if o.startswith("training.micro_batch_size="))


def _reference(recipe: str, overrides: tuple[str, ...]) -> str:
    """The one-process run a layout is compared with: the same recipe and the same microbatches (a
    float8 activation scale is the amax of one microbatch, so the microbatch size is part of the
    numbers: HSDP over 4 data-parallel ranks runs 2 sequences a microbatch, and so does its reference)."""
    micro = _micro(overrides)
    return f"{recipe}/single" + (f"_mb{micro[0].split('=')[1]}" if micro else "")


def _fsdp_gather_bytes(cfg: TrainConfig, float8_names: list[str]) -> int:
    """The logical bytes FSDP2 all-gathers in one step of the 2-block model, from its parameters alone:
    per unit, every parameter at 4 bytes (fp32), a float8 weight at 1 byte (float8 all-gather). The
    units are gathered root, block 0, block 1, head in forward; block 0 and the root again in backward
    (resharded after forward; the last block is kept); one microbatch per step here."""
    spec = get_spec(cfg.model.family)
    with torch.device("meta"):
        model = spec.build(cfg.model)
    float8 = {f"{n}.weight" for n in float8_names}

    def unit(prefixes: tuple[str, ...]) -> int:
        return sum(
            p.numel() * (1 if name in float8 else 4)
            for name, p in model.named_parameters()
            if name.startswith(prefixes)
        )

    root, head = unit(tuple(spec.first_modules)), unit(tuple(spec.last_modules))
    block0, block1 = unit(("layers.0.",)), unit(("layers.1.",))
    return root + block0 + block1 + head + block0 + root


def _losses(run: dict) -> list[float]:
    return [r["loss"] for r in run["history"] if "loss" in r]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> GroupedRuns:
    tmp = tmp_path_factory.mktemp("float8")

    def cfg(name: str, *overrides: str):
        return tiny_config(str(tmp / name.replace("/", "_")), *SMALL, *overrides)

    converge = f"training.steps={CONVERGE_STEPS}"
    parity = f"training.steps={PARITY_STEPS}"
    cases = {"converge/off": Case(1, cfg("converge_off", converge), params=False)}
    for recipe in FLOAT8_RECIPES:
        r = f"training.float8.recipe={recipe}"
        cases[f"converge/{recipe}"] = Case(1, cfg(f"converge_{recipe}", converge, F8, r), params=False)
    for layout, off in TP_WITHOUT_FLOAT8.items():
        overrides = tuple(o for o in LAYOUTS[layout][1] if not o.startswith("training.float8."))
        cases[off] = Case(_world(overrides), cfg(off, parity, *overrides), params=False)
    for name, (recipe, overrides) in LAYOUTS.items():
        ref = _reference(recipe, overrides)
        if ref not in cases:
            r, micro = f"training.float8.recipe={recipe}", _micro(overrides)
            cases[ref] = Case(1, cfg(ref, parity, F8, r, *micro), params=False)
        r = f"training.float8.recipe={recipe}"
        cases[name] = Case(_world(overrides), cfg(name, parity, F8, r, *overrides), params=False)
    return GroupedRuns(cases)


@pytest.mark.parametrize("recipe", FLOAT8_RECIPES)
def test_recipe_converges_near_high_precision(runs: GroupedRuns, recipe: str) -> None:
    """Each recipe trains the debug model 20 steps in emulation; 14 linears convert (header and log);
    its losses differ from the run without float8 by more than FLOOR and less than CEILING."""
    off, got = runs.get("converge/off"), runs.get(f"converge/{recipe}")
    folder = runs.cases[f"converge/{recipe}"].cfg.job.dump_folder
    with open(os.path.join(folder, "metrics.jsonl"), encoding="utf-8") as f:
        header = json.loads(f.readline())
    f8 = header["header"]["float8"]
    assert header["step"] == 0 and f8["recipe"] == recipe and f8["emulate"] is True, header
    assert f8["converted"] == N_LINEARS and len(f8["linears"]) == N_LINEARS, f8
    assert not any(n.startswith(("tok_embeddings", "output")) for n in f8["linears"]), f8["linears"]
    ref, losses = _losses(off), _losses(got)
    assert len(losses) == CONVERGE_STEPS and losses[-1] < losses[0] - 1.0, losses
    rel = [abs(a - b) / abs(a) for a, b in zip(ref, losses, strict=True)]
    print(
        f"{recipe}: final loss {losses[-1]:.4f} vs {ref[-1]:.4f} without float8; max per-step relative "
        f"difference {max(rel):.2e} (step {rel.index(max(rel)) + 1}), final {rel[-1]:.2e}"
    )
    assert max(rel) > FLOOR, f"{recipe}: losses within {max(rel):.1e} of high precision: float8 is not on"
    assert max(rel) < CEILING, f"{recipe}: losses {max(rel):.1e} away from high precision"


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_parity_within_recipe(runs: GroupedRuns, layout: str) -> None:
    """A layout trains the same float8 model as one process (per-step loss and pre-clip grad norm)."""
    recipe, overrides = LAYOUTS[layout]
    rtol = (
        CP_RTOL
        if "parallelism.cp=2" in overrides
        else TP_RTOL
        if any(o.startswith("parallelism.tp=") for o in overrides)
        else RTOL
    )
    ref, got = runs.get(_reference(recipe, overrides)), runs.get(layout)
    worst = assert_parity(ref["history"], got["history"], rtol=rtol, label=layout)
    for rank, history in enumerate(got["rank_histories"]):
        assert step_metrics(history) == step_metrics(got["history"]), f"{layout}: rank {rank} differs"
    print(f"{layout}: loss {worst['loss']:.1e}, grad norm {worst['grad_norm']:.1e} (rtol {rtol:g})")


def test_fsdp_float8_all_gather_ledger_bytes(runs: GroupedRuns) -> None:
    """FSDP x2: the comm ledger's all-gather bytes equal the expected payload exactly, with and without
    float8 all-gather (float8 weights at 1 byte: a quarter of their fp32 masters), and so does the plan;
    the scale precompute adds one all-reduce of one fp32 amax per float8 weight."""
    from trainer.planner.cluster import compose_cluster
    from trainer.planner.compare import compare_memory, compare_with_ledger
    from trainer.planner.plan import build_plan

    measured, planned = {}, {}
    for name in ("tensorwise/fsdp", "tensorwise/fsdp_f8_all_gather"):
        cfg, run = runs.cases[name].cfg, runs.get(name)
        last = [r for r in run["history"] if "comm" in r][-1]  # a steady step (scales precomputed)
        plan = build_plan(cfg, compose_cluster(["cluster=cpu"]))
        rows = compare_with_ledger(plan, last["comm"])
        memory = compare_memory(plan, last["memory"])
        ag = [r for r in rows if r["what"] == "all_gather" and r["kind"] == "comm"]
        ar = [r for r in rows if r["what"] == "all_reduce" and r["kind"] == "comm"]
        gathered = [r for r in memory if r["what"] == "fsdp_unsharded_params"]
        assert all(r["measured"] == ag[0]["measured"] for r in ag), ag  # every rank the same
        measured[name] = (ag[0]["measured"], ar[0]["measured"], gathered[0]["measured"])
        planned[name] = (ag[0]["planned"], ar[0]["planned"], gathered[0]["planned"])
    f8_cfg = runs.cases["tensorwise/fsdp_f8_all_gather"].cfg
    with open(os.path.join(f8_cfg.job.dump_folder, "metrics.jsonl"), encoding="utf-8") as f:
        names = json.loads(f.readline())["header"]["float8"]["linears"]
    off_bytes, f8_bytes = _fsdp_gather_bytes(f8_cfg, []), _fsdp_gather_bytes(f8_cfg, names)
    (off_ag, off_ar, off_buf), (f8_ag, f8_ar, f8_buf) = (
        measured["tensorwise/fsdp"],
        measured["tensorwise/fsdp_f8_all_gather"],
    )
    print(
        f"FSDP x2 all-gather bytes per step: {off_ag:,.0f} without float8 all-gather, {f8_ag:,.0f} with "
        f"(expected {off_bytes:,} / {f8_bytes:,}; planned {planned['tensorwise/fsdp'][0]:,.0f} / "
        f"{planned['tensorwise/fsdp_f8_all_gather'][0]:,.0f}); amax all-reduce +{f8_ar - off_ar:.0f} B; "
        f"gathered buffers {off_buf:,.0f} -> {f8_buf:,.0f} B (planned {planned['tensorwise/fsdp'][2]:,.0f}"
        f" -> {planned['tensorwise/fsdp_f8_all_gather'][2]:,.0f})"
    )
    assert (off_ag, f8_ag) == (off_bytes, f8_bytes)
    assert f8_ar - off_ar == 4 * N_LINEARS  # one fp32 amax per float8 weight, one all-reduce
    assert (planned["tensorwise/fsdp"][0], planned["tensorwise/fsdp_f8_all_gather"][0]) == (off_ag, f8_ag)
    assert planned["tensorwise/fsdp_f8_all_gather"][1] - planned["tensorwise/fsdp"][1] == 4 * N_LINEARS
    for name in planned:
        want, got = planned[name][2], measured[name][2]
        assert abs(got / want - 1) <= 0.05, f"{name}: gathered buffers {got} vs planned {want}"


def _all_reduces(run: dict) -> list[tuple[float, float]]:
    """Per rank: (calls, bytes) of the all-reduces in the run's last step, summed over axes (the amax
    all-reduces of TP x FSDP's scale precompute run over dp_shard_cp and tp)."""
    from trainer.observe.comm_ledger import ledger_totals

    ranks = [r for r in run["history"] if "comm" in r][-1]["comm"]["ranks"]
    totals = [ledger_totals(ranks[rank])["all_reduce"] for rank in sorted(ranks, key=int)]
    return [(t["calls"], t["bytes"]) for t in totals]


@pytest.mark.parametrize("layout", list(TP_WITHOUT_FLOAT8))
def test_tp_amax_all_reduces_match_plan(runs: GroupedRuns, layout: str) -> None:
    """Float8 under TP all-reduces the amax of every sharded operand's dynamic scale over tp: the comm
    ledger's all-reduces exceed the same run's without float8 by exactly the planned float8 rows'
    calls and bytes, and every collective of the float8 run is within 5% of the plan (or below 1% of
    its bytes). TP x FSDP with float8 all-gather: the weights arrive cast (only activations and
    gradients reduce), and the scale precompute adds its all-reduce over tp."""
    from trainer.planner.cluster import compose_cluster
    from trainer.planner.compare import compare_with_ledger
    from trainer.planner.plan import build_plan

    cfg, run = runs.cases[layout].cfg, runs.get(layout)
    plan = build_plan(cfg, compose_cluster(["cluster=cpu"]))
    amax = [x for x in plan.pp_rank_collectives[0] if x.name == "TP all_reduce (float8 amax)"]
    assert amax, f"{layout}: the plan has no float8 amax all-reduce over tp"
    float8 = [x for x in plan.pp_rank_collectives[0] if "float8" in x.name and x.op == "all_reduce"]
    calls, nbytes = sum(x.calls for x in float8), sum(x.logical_bytes for x in float8)
    rows = compare_with_ledger(plan, [r for r in run["history"] if "comm" in r][-1]["comm"])
    total = {r["rank"]: r["planned"] for r in rows if r["what"] == "total"}
    for r in rows:
        if r["kind"] == "comm" and (r["planned"] >= 0.01 * total[r["rank"]] or r["what"] == "total"):
            assert abs(r["ratio"] - 1) <= 0.05, f"{layout}: {r}"
        elif r["kind"] == "comm":  # small ops and unplanned scalars (token counts, loss, norm pieces:
            # 2,644 B a step here, with or without float8): below 1% of the step's bytes
            assert abs(r["measured"] - r["planned"]) < 0.01 * total[r["rank"]], f"{layout}: {r}"
    ranks = [r for r in run["history"] if "comm" in r][-1]["comm"]["ranks"]
    axes = {
        axis
        for rec in ranks.values()
        for op, by in rec.items()
        if op != "model_state" and isinstance(by, dict)
        for axis in by
    }
    assert not any(a.startswith("group") for a in axes), f"{layout}: unnamed groups in the ledger: {axes}"
    got, off = _all_reduces(run), _all_reduces(runs.get(TP_WITHOUT_FLOAT8[layout]))
    added = [(c - c0, b - b0) for (c, b), (c0, b0) in zip(got, off, strict=True)]
    print(
        f"{layout}: float8 adds {added[0][0]:.0f} all-reduces, {added[0][1]:,.0f} B per step "
        f"(planned {calls}, {nbytes:,.0f} B)"
    )
    assert added == [(calls, nbytes)] * len(added), (added, calls, nbytes)


# --------------------------------------------------------------------------------------------
# Errors: one ConfigError each, before any process group (plan_float8 is what the Trainer calls)
# --------------------------------------------------------------------------------------------


def _plan(tmp: str, world: int, *overrides: str):
    cfg = tiny_config(tmp, *SMALL, F8, *overrides)
    spec = get_spec(cfg.model.family)
    t = cfg.training
    dims = validated_dims(
        cfg.parallelism,
        world,
        spec=spec,
        model_args=cfg.model,
        seq_len=t.seq_len,
        global_batch_size=t.global_batch_size,
        micro_batch_size=t.micro_batch_size,
    )
    cpu = torch.device("cpu")
    return plan_float8(t.float8, cfg.parallelism, dims, cpu, spec, cfg.model, compute_dtype=torch.float32)


ERRORS = {  # name -> (world, overrides, words the message must contain)
    "no float8 matmul, emulate off": (1, ("training.float8.emulate=false",), "emulate=false on cpu"),
    "mxfp8 without SM100": (
        1,
        ("training.float8.recipe=mxfp8", "training.float8.emulate=false"),
        "need an SM100",
    ),
    "rowwise + float8 all-gather": (
        2,
        ("training.float8.recipe=rowwise", "training.float8.fsdp_float8_all_gather=true", *DP_SHARD),
        "only tensorwise",
    ),
    "float8 all-gather + DDP": (
        2,
        (
            "training.float8.fsdp_float8_all_gather=true",
            "parallelism.dp_shard=1",
            "parallelism.dp_replicate=2",
        ),
        "dp_shard=1",
    ),
    "float8 all-gather + ZeRO-1": (
        2,
        (
            "training.float8.fsdp_float8_all_gather=true",
            "parallelism.dp_shard=1",
            "parallelism.dp_replicate=2",
            "parallelism.ddp.sharded_optimizer=true",
        ),
        "ZeRO-1",
    ),
    "filter converts nothing": (1, ("training.float8.min_features=4096",), "converts no linear"),
    "mxfp8 under TP": (
        2,
        ("training.float8.recipe=mxfp8", "parallelism.dp_shard=1", "parallelism.tp=2"),
        "parallelism.tp=2",
    ),
    "unknown recipe": (1, ("training.float8.recipe=fp4",), "training.float8.recipe='fp4'"),
}


@pytest.mark.parametrize("name", list(ERRORS))
def test_config_errors(tmp_path, name: str) -> None:
    world, overrides, words = ERRORS[name]
    with pytest.raises(ConfigError) as e:
        _plan(str(tmp_path), world, *overrides)
    message = str(e.value)
    assert words in message and "\n" not in message and "set " in message, message


def test_moe_experts_refused_off_cuda(tmp_path) -> None:
    """Float8 experts would be a silent no-op on the CPU expert path (padded bmm): refused by name."""
    with pytest.raises(ConfigError, match="training.float8.experts=true on cpu"):
        _plan(str(tmp_path), 1, "model=moe_debug", "training.float8.experts=true")


def test_filter_keeps_head_embedding_and_router(tmp_path) -> None:
    """The MoE debug model: the router (``gate``), the embedding and the head never convert."""
    plan = _plan(str(tmp_path), 1, "model=moe_debug")
    assert plan is not None and plan.linears and plan.config.emulate is True, plan
    assert not any(n.split(".")[-1] == "gate" or n.startswith(("output", "tok_")) for n in plan.linears)


def test_torchao_imported_only_with_float8() -> None:
    """A run without float8 never needs torchao: no module of the product imports it at module level
    (only inside the functions that convert, check a GPU run or precompute scales; type-only imports
    sit under ``if TYPE_CHECKING``)."""
    import ast
    import pathlib

    root = pathlib.Path(__file__).resolve().parents[2]
    eager = []
    for package in ("models", "parallelisms", "trainer"):
        for path in sorted((root / package).rglob("*.py")):
            for node in ast.parse(path.read_text(encoding="utf-8")).body:  # module level only
                names = (
                    [a.name for a in node.names]
                    if isinstance(node, ast.Import)
                    else [node.module or ""]
                    if isinstance(node, ast.ImportFrom)
                    else []
                )
                eager += [f"{path.relative_to(root)}: {n}" for n in names if n.split(".")[0] == "torchao"]
    assert eager == [], eager


# --------------------------------------------------------------------------------------------
# Checkpoints stay in high precision
# --------------------------------------------------------------------------------------------

CKPT = ("checkpoint.interval=4", "training.steps=8", NO_CLIP)
F8_AG = (F8, "training.float8.fsdp_float8_all_gather=true")
MOE_LAYER = ("model=moe_debug", "model.n_layers=1", "training.micro_batch_size=4")
MX_EXPERTS = (F8, "training.float8.recipe=mxfp8", "training.float8.experts=true")
# kind -> (model, float8 of the multi-rank source, its layout, float8 of the one-process targets, their
# other overrides). MXFP8 experts under EP x2: the targets run micro-batch 8, the tokens of one EP
# expert GEMM (whose bf16 weight gradient is rounded once per micro-batch: test_float8_experts.py).
# (Float8 rowwise experts under EP x2 x FSDP x2: test_float8_grouped.py, with its reference kernels.)
CkptKind = tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...], tuple[str, ...], tuple[str, ...]]
CKPT_KINDS: dict[str, CkptKind] = {
    "tensorwise_fsdp_f8_all_gather": (SMALL, F8_AG, DP_SHARD, (F8,), ()),
    "mxfp8_experts_ep": (
        MOE_LAYER,
        MX_EXPERTS,
        (*DP_SHARD, "parallelism.ep=2"),
        MX_EXPERTS,
        ("training.micro_batch_size=8",),
    ),
}


def _ckpt_sources(tmp: str, kind: CkptKind) -> dict[str, TrainConfig]:
    """Multi-rank runs writing step 4: with float8 and without."""
    model, f8, layout, _, _ = kind
    on = ("checkpoint.enable=true", *CKPT, *layout)
    return {
        "f8": tiny_config(os.path.join(tmp, "f8"), *model, *on, *f8),
        "off": tiny_config(os.path.join(tmp, "off"), *model, *on),
    }


def _ckpt_targets(tmp: str, kind: CkptKind) -> dict[str, TrainConfig]:
    """One process from a step-4 checkpoint: float8 -> float8, float8 -> none, none -> float8."""
    model, _, _, f8, single = kind

    def target(name: str, source: str, *overrides: str) -> TrainConfig:
        path = os.path.join(tmp, source, "checkpoints", "step-4")
        return tiny_config(
            os.path.join(tmp, name),
            *model,
            *CKPT,
            *single,
            *overrides,
            f"checkpoint.initial_load_path={path}",
            "checkpoint.initial_load_model_only=false",
        )

    return {
        "f8->f8_single": target("f8_single", "f8", *f8),
        "f8->off_single": target("f8_off", "f8"),
        "off->f8_single": target("off_f8", "off", *f8),
    }


def _ckpt_worker(rank: int, world: int, sources: dict, targets: dict) -> dict:
    """Sources (5 steps, checkpoint at 4; then the float8 run resumed from 4) and targets (step 5 from a
    source's step-4 checkpoint), in this process group; each run's step 5, the float8 source's history."""
    from trainer.checkpoint.checkpointer import load_full_state
    from trainer.train import Trainer

    out: dict = {}
    for name, cfg in sources.items():
        trainer = Trainer(cfg)
        history = trainer.train(until_step=5)
        out[name], out[f"{name} history"] = _step5(history), history
        trainer.close()
        if name == "f8":
            trainer = Trainer(
                dataclasses.replace(cfg, checkpoint=dataclasses.replace(cfg.checkpoint, load_step=4))
            )
            out["f8 resumed"] = {"from": trainer.state.step, **_step5(trainer.train(until_step=5))}
            trainer.close()
            folder = os.path.join(cfg.job.dump_folder, "checkpoints", "step-4")
            state = load_full_state(folder, "model.")
            out["f8 dtypes"] = sorted({str(v.dtype) for v in state.values()})
            out["f8 files naming torchao"] = sorted(  # its tensor subclasses pickled: torchao needed to load
                f for f in os.listdir(folder) if b"torchao" in open(os.path.join(folder, f), "rb").read()
            )
    for name, cfg in targets.items():
        trainer = Trainer(cfg)
        path = cfg.checkpoint.initial_load_path
        got = _full_state(trainer)
        want = {f"model.{k}": v for k, v in load_full_state(path, "model.").items()}
        want.update({f"optimizer.{k}": v for k, v in load_full_state(path, "optimizer.").items()})
        mismatched = sorted(
            k
            for k in want.keys() | got.keys()
            if not (k in got and k in want and torch.equal(got[k], want[k]))
        )
        out[name] = {"mismatched": mismatched, "tensors": len(want), **_step5(trainer.train(until_step=5))}
        trainer.close()
    return out


def _assert_checkpoints(out: dict, label: str) -> tuple[dict[str, float], float]:
    """The checks of a ``_ckpt_worker`` result (sources and targets): fp32 plain tensors saved, the resume
    bitwise, every tensor loaded bitwise into one process, step 5 of the float8 target within RTOL of the
    source's. Returns that step's worst relative differences and the float8 -> none target's loss
    difference from the source (asserted > 0: float8 is on)."""
    assert out["f8 dtypes"] == ["torch.float32"] and out["f8 files naming torchao"] == [], out
    resumed = out["f8 resumed"]
    assert resumed["from"] == 4 and (resumed["loss"], resumed["grad_norm"]) == (
        out["f8"]["loss"],
        out["f8"]["grad_norm"],
    ), (resumed, out["f8"])
    for name in ("f8->f8_single", "f8->off_single", "off->f8_single"):
        assert out[name]["mismatched"] == [] and out[name]["tensors"] > 30, (name, out[name])
    worst = assert_parity([out["f8"]], [out["f8->f8_single"]], rtol=RTOL, label=f"{label} -> single")
    off_vs_f8 = abs(out["f8->off_single"]["loss"] - out["f8"]["loss"]) / out["f8"]["loss"]
    print(f"{label} reshard step 5: {worst}; the same weights without float8 differ by {off_vs_f8:.1e}")
    assert off_vs_f8 > 0, "the float8 and high-precision step 5 from the same weights are identical"
    return worst, off_vs_f8


@pytest.mark.parametrize("kind", list(CKPT_KINDS))
def test_checkpoints_stay_high_precision(tmp_path, kind: str) -> None:
    """A float8 run on 2 ranks (FSDP with float8 all-gather; EP with MXFP8 experts) saves fp32 masters
    under the plain names (plain tensors: no torchao class pickled); it resumes bitwise in float8,
    and reshards to one process with float8 (step 5 within RTOL), without float8, and from a run
    without float8 -- every tensor loaded bitwise."""
    tmp = str(tmp_path)
    out = run_distributed(_ckpt_worker, 2, _ckpt_sources(tmp, CKPT_KINDS[kind]), {}, timeout=600)[0]
    out.update(run_distributed(_ckpt_worker, 1, {}, _ckpt_targets(tmp, CKPT_KINDS[kind]), timeout=600)[0])
    _assert_checkpoints(out, kind)
