"""Optimizer construction and the LR schedule."""

from __future__ import annotations

import math
import os
import re

import pytest
import torch

from models.llama import LlamaArgs, Transformer
from trainer.config import LRSchedulerConfig, OptimizerConfig
from trainer.optim import build_lr_scheduler, build_optimizer, lr_factor
from trainer.step import StepState


def _state() -> StepState:
    """A step's hook state (QK-clip reads nothing of it)."""
    return StepState(step=1, loader=None, tokens_seen=0)  # type: ignore[arg-type]


def test_warmup_then_cosine_to_floor() -> None:
    kw = {"warmup_steps": 4, "total_steps": 20, "decay_type": "cosine", "min_lr_ratio": 0.1}
    f = [lr_factor(s, **kw) for s in range(20)]
    assert f[:4] == [0.25, 0.5, 0.75, 1.0]
    assert f[4] == pytest.approx(1.0)
    assert f[-1] == pytest.approx(0.1)
    assert all(a >= b for a, b in zip(f[4:], f[5:]))  # monotone decay
    assert lr_factor(100, **kw) == pytest.approx(0.1)  # stays at the floor
    mid = 4 + (20 - 4 - 1) / 2
    assert lr_factor(int(mid), **kw) == pytest.approx(
        0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * int(mid - 4) / 15))
    )


def test_linear_and_constant() -> None:
    lin = [
        lr_factor(s, warmup_steps=0, total_steps=11, decay_type="linear", min_lr_ratio=0.0) for s in range(11)
    ]
    assert lin[0] == 1.0 and lin[-1] == pytest.approx(0.0) and lin[5] == pytest.approx(0.5)
    assert lr_factor(7, warmup_steps=2, total_steps=10, decay_type="constant", min_lr_ratio=0.0) == 1.0


def test_scheduler_drives_optimizer_and_no_decay_on_norms() -> None:
    model = Transformer(LlamaArgs(dim=32, n_layers=1, n_heads=2, vocab_size=64, ffn_hidden_dim=64))
    opt = build_optimizer(model, OptimizerConfig(lr=1e-3, weight_decay=0.1), device_type="cpu")
    decay, no_decay = opt.param_groups
    assert all(p.ndim >= 2 for p in decay["params"]) and decay["weight_decay"] == 0.1
    assert all(p.ndim == 1 for p in no_decay["params"]) and no_decay["weight_decay"] == 0.0
    sched = build_lr_scheduler(
        opt, LRSchedulerConfig(warmup_steps=2, decay_type="cosine", min_lr_ratio=0.0), 10
    )
    assert opt.param_groups[0]["lr"] == pytest.approx(0.5e-3)
    opt.step()
    sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(1e-3)
    assert isinstance(opt, torch.optim.AdamW)


# -- Muon -------------------------------------------------------------------------------------


def _tiny_llama() -> Transformer:
    torch.manual_seed(0)
    return Transformer(LlamaArgs(dim=32, n_layers=2, n_heads=2, vocab_size=64, ffn_hidden_dim=64))


def test_newton_schulz_and_lr_adjustment_are_torchs() -> None:
    """bf16 (torch's dtype): bitwise torch.optim._muon's iteration, wide, tall and square."""
    from torch.optim._muon import _adjust_lr, _zeropower_via_newtonschulz

    from trainer.optim.config import DEFAULT_NS_COEFFICIENTS
    from trainer.optim.muon import adjusted_lr, zeropower_via_newtonschulz

    gen = torch.Generator().manual_seed(0)
    for shape in [(32, 64), (64, 32), (17, 17), (3, 40)]:
        g = torch.randn(shape, generator=gen)
        ours = zeropower_via_newtonschulz(g, DEFAULT_NS_COEFFICIENTS, 5, 1e-7)
        assert torch.equal(ours, _zeropower_via_newtonschulz(g, DEFAULT_NS_COEFFICIENTS, 5, 1e-7)), shape
        fp32 = zeropower_via_newtonschulz(g, DEFAULT_NS_COEFFICIENTS, 5, 1e-7, torch.float32)
        assert fp32.dtype == torch.float32 and (fp32 - ours.float()).abs().max() < 0.05  # bf16 rounding only
        for fn in ("original", "match_rms_adamw"):
            assert adjusted_lr(0.02, fn, shape) == _adjust_lr(0.02, fn, torch.Size(shape))


def test_muon_groups_split_hidden_matrices_from_the_rest() -> None:
    from trainer.optim import muon_param_groups

    model = _tiny_llama()
    groups = muon_param_groups(model, OptimizerConfig(name="muon"), ("tok_embeddings", "norm", "output"))
    muon, decay, no_decay = groups
    assert muon["use_muon"] and not decay["use_muon"] and not no_decay["use_muon"]
    assert set(decay["names"]) == {"tok_embeddings.weight", "output.weight"} and decay["weight_decay"] == 0.1
    assert all(p.ndim == 1 for p in no_decay["params"]) and no_decay["weight_decay"] == 0.0
    assert len(muon["names"]) == 2 * 7 and all(
        ".attention." in n or ".feed_forward." in n for n in muon["names"]
    )


@pytest.mark.parametrize("adjust_lr_fn", ["original", "match_rms_adamw"])
def test_muon_one_process_is_torch_muon_plus_adamw_bitwise(adjust_lr_fn: str) -> None:
    """optimizer=muon on one process = torch.optim.Muon (hidden matrices) + torch.optim.AdamW (the
    rest) with the same hyperparameters, bitwise over 3 steps (NS in torch's bf16)."""
    import copy

    from trainer.config import MuonConfig

    ours_model = _tiny_llama()
    ref_model = copy.deepcopy(ours_model)
    cfg = OptimizerConfig(
        name="muon", lr=1e-2, muon=MuonConfig(lr=2e-2, weight_decay=0.05, adjust_lr_fn=adjust_lr_fn)
    )
    ours = build_optimizer(ours_model, cfg, device_type="cpu")
    hidden = [
        p for n, p in ref_model.named_parameters() if p.ndim == 2 and not n.startswith(("tok_", "output"))
    ]
    head = [p for n, p in ref_model.named_parameters() if p.ndim == 2 and n.startswith(("tok_", "output"))]
    vectors = [p for p in ref_model.parameters() if p.ndim == 1]
    ref = [
        torch.optim.Muon(hidden, lr=2e-2, weight_decay=0.05, adjust_lr_fn=adjust_lr_fn),
        torch.optim.AdamW(
            [{"params": head, "weight_decay": 0.1}, {"params": vectors, "weight_decay": 0.0}],
            lr=1e-2,
            betas=cfg.betas,
            eps=cfg.eps,
            fused=True,  # optimizer.implementation=auto on the CPU
        ),
    ]
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    for _ in range(3):
        for model, opts in ((ours_model, [ours]), (ref_model, ref)):
            model(tokens).logsumexp(-1).mean().backward()
            for opt in opts:
                opt.step()
                opt.zero_grad()
        for (name, a), b in zip(ours_model.named_parameters(), ref_model.parameters()):
            assert torch.equal(a, b), name
    assert len(ours.state) == sum(1 for _ in ours_model.parameters())


def test_owners_balance_newton_schulz_flops_within_candidates() -> None:
    from trainer.optim.muon_plan import assign_owners

    costs = [8, 7, 6, 5, 4, 3, 2, 1]
    owners = assign_owners(costs, [[0, 1, 2]] * 6 + [[1], [1]], 3)
    assert owners[6] == 1 and owners[7] == 1  # a unit goes only to a rank that holds it (a PP stage)
    loads = [sum(c for c, o in zip(costs, owners) if o == r) for r in range(3)]
    assert loads == [11, 11 + 3, 11], (
        loads
    )  # the six shared units split evenly (11 each), then 2 + 1 on rank 1


@pytest.mark.parametrize(
    "override, match",
    [
        ("optimizer.muon.adjust_lr_fn=rms", "optimizer.muon.adjust_lr_fn"),
        ("optimizer.muon.ns_steps=0", "optimizer.muon.ns_steps=0"),
        ("optimizer.muon.momentum=1.0", "optimizer.muon.momentum=1.0"),
        ("optimizer.muon.ns_dtype=float16", "optimizer.muon.ns_dtype"),
        ("optimizer.qk_clip_tau=50 model=deepseek_v3_debug", "model.family=deepseek_v3"),
        ("optimizer.qk_clip_tau=50 model=qwen3_debug", "model.qk_norm=true"),
        ("optimizer.qk_clip_tau=50 parallelism.cp=2", "parallelism.cp=2"),
    ],
)
def test_muon_config_errors_name_the_key(override: str, match: str) -> None:
    from models.errors import ConfigError
    from tests.configs import make_config

    with pytest.raises(ConfigError, match=match):
        make_config("optimizer=muon", *override.split())


# -- QK-clip --------------------------------------------------------------------------------------


def _qk_model(mask: str) -> Transformer:
    torch.manual_seed(0)
    model = Transformer(
        LlamaArgs(
            dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64, ffn_hidden_dim=64, attention_mask=mask
        )
    )
    model.init_weights(seed=0)
    with torch.no_grad():  # larger q/k weights: logits well above 1
        for layer in model.layers.values():
            layer.attention.wq.weight.mul_(30)
            layer.attention.wk.weight.mul_(10)
    return model


@torch.no_grad()
def _naive_max_logits(model: Transformer, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """(layers, heads) max of q.k/sqrt(D) over allowed pairs, head by head and pair by pair."""
    from models.common import apply_rotary_emb

    inputs: dict[int, torch.Tensor] = {}
    hooks = [
        layer.attention.register_forward_pre_hook(lambda m, a, i=i: inputs.__setitem__(i, a[0]))
        for i, layer in enumerate(model.layers.values())
    ]
    model(tokens, positions=positions)
    for h in hooks:
        h.remove()
    out = torch.full((len(inputs), 4), float("-inf"))
    B, S = tokens.shape
    for i, layer in enumerate(model.layers.values()):
        attn = layer.attention
        D = attn.head_dim
        q = (inputs[i] @ attn.wq.weight.T).view(B, S, 4, D)
        k = (inputs[i] @ attn.wk.weight.T).view(B, S, 2, D)
        q, k = apply_rotary_emb(q, k, model.rope_cache[positions])
        for b in range(B):
            for h in range(4):
                for qi in range(S):
                    for kj in range(qi + 1):  # causal; same document: no restart of positions in (kj, qi]
                        if (
                            attn.core.attention_mask == "block_causal"
                            and (positions[b, kj + 1 : qi + 1] == 0).any()
                        ):
                            continue
                        logit = float(q[b, qi, h] @ k[b, kj, h // 2]) / D**0.5
                        out[i, h] = max(out[i, h], logit)
    return out


@pytest.mark.parametrize("mask", ["causal", "block_causal"])
def test_recorded_max_logit_equals_naive_attention(mask: str) -> None:
    from trainer.optim.qk_clip import QKClip

    model = _qk_model(mask)
    tokens = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(2))
    positions = torch.tensor([list(range(12)), [0, 1, 2, 3, 4, 0, 1, 2, 0, 1, 2, 3]])  # 1 and 3 documents
    clip = QKClip(
        list(enumerate(layer.attention for layer in model.layers.values())),
        num_layers=2,
        n_heads=4,
        n_kv_heads=2,
        tau=1e9,
    )
    clip.begin_step(_state())
    model(tokens, positions=positions)
    measured = clip.measured_max()
    naive = _naive_max_logits(model, tokens, positions)
    print(
        f"qk-clip {mask}: max |measured - naive| {(measured - naive).abs().max().item():.2e} (max logit "
        f"{naive.max():.2f})"
    )
    assert torch.allclose(measured, naive, rtol=1e-5, atol=1e-5)


def test_qk_clip_scales_the_head_above_tau_to_tau() -> None:
    """One head above tau: its q (and shared k) rows are scaled, the next forward's max of that head
    is tau, every other head's max is unchanged (GQA: the kv head's other query head compensates)."""
    from trainer.optim.qk_clip import QKClip

    model = _qk_model("causal")
    tokens = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(3))
    positions = torch.arange(12).expand(2, 12)
    clip = QKClip(
        list(enumerate(layer.attention for layer in model.layers.values())),
        num_layers=2,
        n_heads=4,
        n_kv_heads=2,
        tau=0.0,
    )
    clip.begin_step(_state())
    model(tokens, positions=positions)
    before = clip.measured_max()
    top2 = before.flatten().topk(2).values
    clip.tau = float(top2.mean())  # between the largest and the second largest: exactly one head clipped
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    state = _state()
    clip.begin_step(state)
    model(tokens, positions=positions)
    clip.after_optimizer_step(state)
    stats = clip.metrics(state, torch.device("cpu"))
    assert set(stats) == {"qk_max_logit", "qk_clipped_heads"}
    assert stats["qk_clipped_heads"] == 1 and stats["qk_max_logit"] == pytest.approx(float(top2[0]))
    layer, head = divmod(int(before.flatten().argmax()), 4)
    changed = {n for n, p in model.named_parameters() if not torch.equal(p, weights[n])}
    assert changed == {f"layers.{layer}.attention.wq.weight", f"layers.{layer}.attention.wk.weight"}, changed
    D = 8
    wq_rows_changed = {
        r // D
        for r in range(32)
        if not torch.equal(
            model.layers[str(layer)].attention.wq.weight[r], weights[f"layers.{layer}.attention.wq.weight"][r]
        )
    }
    assert wq_rows_changed == {head, head ^ 1}  # the head and its kv group's other query head
    clip.begin_step(_state())
    model(tokens, positions=positions)
    after = clip.measured_max()
    expected = before.clone()
    expected[layer, head] = clip.tau
    print(
        f"qk-clip probe: head ({layer}, {head}) {before[layer, head]:.4f} -> {after[layer, head]:.6f}, "
        f"tau {clip.tau:.6f}; other heads max change {(after - expected).abs().max():.2e}"
    )
    assert torch.allclose(after, expected, rtol=1e-5, atol=1e-5)


def test_planner_counts_muon_newton_schulz_and_exchange() -> None:
    """The plan of optimizer=muon: NS FLOPs per rank = every hidden matrix's 5 iterations
    (4 m^2 n + 2 m^3 each, m <= n) over the ranks, counted here from the model's own parameters;
    the two all_to_all rows carry 4 B per held Muon element (FSDP x 2: half of them)."""
    from tests.configs import tiny_config
    from trainer.planner.cluster import compose_cluster
    from trainer.planner.plan import build_plan

    cfg = tiny_config("unused", "optimizer=muon", "parallelism.dp_shard=2")
    plan = build_plan(cfg, compose_cluster(["cluster=cpu"]))
    model = Transformer(cfg.model)
    hidden = [p for n, p in model.named_parameters() if p.ndim == 2 and n.startswith("layers.")]
    flops = sum(5 * (4 * min(p.shape) ** 2 * max(p.shape) + 2 * min(p.shape) ** 3) for p in hidden)
    assert plan.compute["ns_flops_per_rank"] == flops / 2
    muon_rows = [x for x in plan.collectives if x.name.startswith("Muon")]
    assert [x.logical_bytes for x in muon_rows] == [4 * sum(p.numel() for p in hidden) / 2] * 2
    assert (
        plan.verdict["step_s"] > plan.compute["compute_with_bubble_s"] + plan.compute["optimizer_s"] * 0.999
    )


# -- the registry ---------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["adamw", "muon", "sgd"])
def test_every_registered_optimizer_validates_builds_and_steps(name: str) -> None:
    """Each name of the table is checked, built and steps a tiny model on one process; the table
    holds exactly the optimizers the configs offer (configs/optimizer/<name>.yaml)."""
    from tests.configs import CONFIG_DIR
    from trainer.optim import OPTIMIZERS, validate_optimizer

    assert sorted(OPTIMIZERS) == sorted(f[:-5] for f in os.listdir(f"{CONFIG_DIR}/optimizer")), OPTIMIZERS
    cfg = OptimizerConfig(name=name)
    validate_optimizer(cfg, LRSchedulerConfig())
    model = _tiny_llama()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = build_optimizer([model], cfg, device_type="cpu")
    model(torch.randint(0, 64, (2, 8))).logsumexp(-1).mean().backward()
    opt.step()
    assert all(not torch.equal(p, before[n]) for n, p in model.named_parameters()), name


def test_unknown_names_are_refused_naming_the_registered_ones() -> None:
    from models.errors import ConfigError
    from tests.configs import make_config
    from trainer.optim import LR_SCHEDULES, lr_factor

    msg = re.escape("optimizer.name='lion' is not one of ['adamw', 'muon', 'sgd']")
    with pytest.raises(ConfigError, match=msg):
        build_optimizer(_tiny_llama(), OptimizerConfig(name="lion"), device_type="cpu")
    with pytest.raises(ConfigError, match=msg):
        make_config("optimizer.name=lion")
    assert list(LR_SCHEDULES) == ["cosine", "linear", "constant", "wsd"]
    msg = re.escape("lr_scheduler.decay_type='step' is not one of ['cosine', 'linear', 'constant', 'wsd']")
    with pytest.raises(ConfigError, match=msg):
        make_config("lr_scheduler.decay_type=step")
    with pytest.raises(ConfigError, match=msg):
        lr_factor(3, warmup_steps=1, total_steps=9, decay_type="step", min_lr_ratio=0.0)


def _run_layout(layout: str) -> frozenset[str]:
    """optimizer_layout of a 2-rank run that uses ``layout`` (with what it needs besides)."""
    from parallelisms.config import ParallelismConfig
    from parallelisms.parallel_dims import ParallelDims
    from trainer.optim import optimizer_layout

    degrees = {"tp": {"tp": 2}, "pp": {"pp": 2}, "cp": {"cp": 2}}.get(layout, {})
    if layout in ("ddp", "torch_ddp", "zero1"):
        degrees = {"dp_replicate": 2}
    p = ParallelismConfig()
    p.ddp.impl = "torch" if layout == "torch_ddp" else "custom"
    p.ddp.sharded_optimizer = layout == "zero1"
    p.fault_tolerance.enable = layout == "fault_tolerance"
    dims = ParallelDims(**degrees, ep=2 if layout == "ep" else 1, world_size=2)  # dp_shard fills the rest
    return optimizer_layout(dims, p)


def test_declared_layouts_are_what_the_registry_refuses(monkeypatch: pytest.MonkeyPatch) -> None:
    """For every entry and every layout: refused exactly when the entry does not declare it. Today
    both optimizers run everywhere; an entry without ``tp`` (registered here only) shows the refusal."""
    from models.errors import ConfigError
    from trainer.optim import LAYOUTS, OPTIMIZERS, OptimizerEntry, check_optimizer_layout
    from trainer.optim.adamw import build_adamw

    monkeypatch.setitem(OPTIMIZERS, "adamw_no_tp", OptimizerEntry(build_adamw, frozenset(LAYOUTS) - {"tp"}))
    for name, entry in OPTIMIZERS.items():
        for layout in LAYOUTS:
            run = _run_layout(layout)
            assert layout in run, (layout, run)
            try:
                check_optimizer_layout(name, run)
                refused = False
            except ConfigError:
                refused = True
            assert refused == (not run <= entry.layouts), (name, layout, run)
    assert all(e.layouts == frozenset(LAYOUTS) for n, e in OPTIMIZERS.items() if n != "adamw_no_tp")
    with pytest.raises(ConfigError, match=re.escape("optimizer.name=adamw_no_tp does not run under tp")):
        build_optimizer(
            _tiny_llama(), OptimizerConfig(name="adamw_no_tp"), device_type="cpu", layout=_run_layout("tp")
        )


def test_newton_schulz_coefficients_have_one_copy() -> None:
    """The dataclass default, the preset's value and the error message's example are the constant."""
    from models.errors import ConfigError
    from tests.configs import make_config
    from trainer.config import MuonConfig
    from trainer.optim.config import DEFAULT_NS_COEFFICIENTS
    from trainer.optim.muon import validate_muon_config

    assert MuonConfig().ns_coefficients == DEFAULT_NS_COEFFICIENTS == (3.4445, -4.7750, 2.0315)
    assert tuple(make_config("optimizer=muon").optimizer.muon.ns_coefficients) == DEFAULT_NS_COEFFICIENTS
    bad = OptimizerConfig(name="muon", muon=MuonConfig(ns_coefficients=(1.0, 2.0)))  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=re.escape("e.g. [3.4445,-4.7750,2.0315].")):
        validate_muon_config(bad)


def test_the_recipe_for_an_optimizer_names_files_that_exist() -> None:
    """docs/architecture.md "Adding an optimizer": every file it names (templates aside) exists."""
    from tests.configs import REPO

    text = open(os.path.join(REPO, "docs", "architecture.md"), encoding="utf-8").read()
    section = text.split("## Adding an optimizer", 1)[1].split("\n## ", 1)[0]
    named = set(re.findall(r"`([\w/]+\.(?:py|yaml))`", section))
    assert "trainer/optim/__init__.py" in named and "trainer/optim/config.py" in named, named
    missing = sorted(p for p in named if not os.path.isfile(os.path.join(REPO, p)))
    assert not missing, missing


def test_fused_sgd_is_refused_under_sharded_layouts_before_any_process_group() -> None:
    """torch's fused SGD has no DTensor sharding rule: a forced ``fused`` under FSDP / TP / EP is a
    ConfigError from the layout alone (the trainer checks it before init_process_group); ``auto``
    takes foreach there, and fused stays allowed where the parameters are plain tensors."""
    from models.errors import ConfigError
    from trainer.optim import check_optimizer_layout

    fused, auto = OptimizerConfig(name="sgd", implementation="fused"), OptimizerConfig(name="sgd")
    for layout in ("fsdp", "tp", "ep"):
        with pytest.raises(
            ConfigError, match=rf"optimizer.implementation=fused with optimizer=sgd under .*{layout}"
        ):
            check_optimizer_layout("sgd", _run_layout(layout), fused)
        check_optimizer_layout("sgd", _run_layout(layout), auto)
        check_optimizer_layout("adamw", _run_layout(layout), OptimizerConfig(implementation="fused"))
    for layout in ("ddp", "zero1", "pp"):
        check_optimizer_layout("sgd", _run_layout(layout), fused)
