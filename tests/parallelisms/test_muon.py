"""Muon in every layout trains the same model as torch.optim.Muon on one process (fp32, CPU, gloo).

The reference is the single-process Trainer whose optimizer is replaced (test-only setup hook)
by ``torch.optim.Muon`` itself for the 2-D hidden weights (one 2-D copy per expert for 3-D
expert stacks) and ``torch.optim.AdamW`` for the rest, on the same batches and LR schedule.
Newton-Schulz runs in float32 in both (``optimizer.muon.ns_dtype=float32``; the reference's
``torch.optim._muon._zeropower_via_newtonschulz`` is swapped for the same iteration in fp32,
which ``tests/trainer/test_optim.py::test_newton_schulz_and_lr_adjustment_are_torchs`` shows
equal to torch's bitwise in bf16): in bf16 a 1e-7 reduction-order difference could flip a
rounding and the layouts would differ by ~1e-3.

Each parallel layout runs ``optimizer=muon`` through the real Trainer for 8 steps; losses and
pre-clip gradient norms must match to 1e-5 relative, final weights to 1e-5. The runs also count
Newton-Schulz calls and momentum elements per rank (each matrix once per step, momentum never
replicated), QK-clip cases must clip the same heads as one process, and a checkpoint test resumes
bitwise and reshards DDP -> ZeRO-1 -> FSDP -> TP -> DDP. All cases of a world size run in one
spawned group (dense and MoE together).
"""

from __future__ import annotations

from typing import Optional

import pytest
import torch

from tests.configs import NO_CLIP, tiny_config
from tests.parity import Case, GroupedRuns, assert_parallel_run, gather_cases

pytestmark = pytest.mark.slow

MUON = ["optimizer=muon", "optimizer.muon.ns_dtype=float32"]
MOE = [
    "model=moe_debug",
    "model.moe_hidden_dim=64",
    "model.first_k_dense=1",
    "model.num_shared_experts=1",
    "model.qk_norm=true",
]
DDP = ["parallelism.dp_replicate=2", "parallelism.dp_shard=1"]
LAYOUTS = {  # name -> (world, model, overrides)
    "custom_ddp_x2": (2, "dense", DDP),
    "torch_ddp_x2_noclip": (2, "dense", [*DDP, "parallelism.ddp.impl=torch", NO_CLIP]),
    "zero1_x2": (2, "dense", [*DDP, "parallelism.ddp.sharded_optimizer=true"]),
    "fsdp_x2_noclip": (2, "dense", ["parallelism.dp_shard=2", NO_CLIP]),
    "tp_sp_x2": (2, "dense", ["parallelism.dp_shard=1", "parallelism.tp=2"]),
    "pp2_1f1b": (2, "dense", ["parallelism.pp=2", "parallelism.dp_shard=1"]),
    "moe_ep_x2": (2, "moe", ["parallelism.ep=2", "parallelism.dp_shard=2"]),
    "hsdp_2x2": (4, "dense", ["parallelism.dp_replicate=2", "parallelism.dp_shard=2"]),
    "fsdp_tp_2x2_noclip": (4, "dense", ["parallelism.dp_shard=2", "parallelism.tp=2", NO_CLIP]),
    "pp2_fsdp2": (4, "dense", ["parallelism.pp=2", "parallelism.dp_shard=2"]),
    "moe_ep2_fsdp4": (4, "moe", ["parallelism.ep=2", "parallelism.dp_shard=4"]),
    "moe_ep2_tp2": (4, "moe", ["parallelism.ep=2", "parallelism.dp_shard=2", "parallelism.tp=2"]),
    # QK-clip: per-head maxima measured on local heads (TP) / full heads, reduced over the world,
    # q/k rows scaled through the weights' placements (TP rows, FSDP row shards)
    "qkclip_tp_sp_x2": (2, "qkclip", ["parallelism.dp_shard=1", "parallelism.tp=2"]),
    "qkclip_fsdp_x2": (2, "qkclip", ["parallelism.dp_shard=2"]),
}
QK_CLIP = ["optimizer.qk_clip_tau=0.08"]  # the tiny run's max logits are 0.08-0.12


def _overrides(model: str, extra: list[str]) -> list[str]:
    return [*(MOE if model == "moe" else []), *(QK_CLIP if model == "qkclip" else []), *MUON, *extra]


# -- the reference optimizer: torch.optim.Muon + torch.optim.AdamW (installed in the worker) -----


def _fp32_newton_schulz(grad, ns_coefficients, ns_steps, eps):  # noqa: ANN001, ANN202
    from trainer.optim.muon import zeropower_via_newtonschulz

    return zeropower_via_newtonschulz(grad, ns_coefficients, ns_steps, eps, torch.float32)


class TorchMuonAdamW(torch.optim.Optimizer):
    """torch.optim.Muon over the Muon groups' matrices (3-D stacks: a 2-D copy per expert, synced
    around each step) and torch.optim.AdamW over the other groups, as one optimizer for the
    Trainer (its LR schedule drives both through ``param_groups``)."""

    def __init__(self, groups: list[dict]) -> None:  # noqa: D107 -- groups as muon_param_groups builds them
        self.stacks: list[tuple[torch.Tensor, list[torch.nn.Parameter]]] = []
        matrices: list[torch.Tensor] = []
        (muon,) = [g for g in groups if g["use_muon"]]
        for p in muon["params"]:
            if p.ndim == 3:
                experts = [torch.nn.Parameter(p.detach()[e].clone()) for e in range(p.shape[0])]
                self.stacks.append((p, experts))
                matrices.extend(experts)
            else:
                matrices.append(p)
        self.muon = torch.optim.Muon(
            matrices,
            **{
                k: muon[k]
                for k in ("lr", "weight_decay", "momentum", "nesterov", "ns_steps", "eps", "adjust_lr_fn")
            },
            ns_coefficients=muon["ns_coefficients"],
        )
        self.adamw = torch.optim.AdamW(
            [
                {k: g[k] for k in ("params", "lr", "betas", "eps", "weight_decay")}
                for g in groups
                if not g["use_muon"]
            ],
            fused=True,  # the trainer's optimizer.implementation=auto on the CPU
        )
        self.all_params = [p for g in groups for p in g["params"]]
        self.param_groups = self.muon.param_groups + self.adamw.param_groups
        self.defaults, self.state = {}, {}
        self._optimizer_step_pre_hooks, self._optimizer_step_post_hooks = {}, {}

    @torch.no_grad()
    def step(self, closure=None):  # noqa: ANN001, ANN201
        for p, experts in self.stacks:
            for e, expert in enumerate(experts):
                expert.grad = p.grad[e].clone()
        self.muon.step()
        self.adamw.step()
        for p, experts in self.stacks:
            for e, expert in enumerate(experts):
                p[e].copy_(expert)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.all_params:
            p.grad = None
        self.muon.zero_grad()


def use_torch_muon(trainer) -> Optional[dict]:  # noqa: ANN001
    """Setup hook: the reference run steps with torch's own optimizers (NS in fp32)."""
    import torch.optim._muon as torch_muon

    from trainer.optim import build_lr_scheduler, muon_param_groups

    torch_muon._zeropower_via_newtonschulz = _fp32_newton_schulz
    cfg = trainer.cfg
    groups = muon_param_groups(
        trainer.model_parts, cfg.optimizer, trainer.spec.first_modules + trainer.spec.last_modules
    )
    trainer.optimizer = TorchMuonAdamW(groups)
    trainer.lr_scheduler = build_lr_scheduler(trainer.optimizer, cfg.lr_scheduler, cfg.training.steps)
    return record_qk_clip(trainer, {})


def count_work(trainer) -> dict:  # noqa: ANN001
    """Setup hook: count this rank's Newton-Schulz calls and momentum elements (filled every step)."""
    observed = {"steps": 0}

    def after_step(*_) -> None:  # noqa: ANN002
        observed["steps"] += 1
        state = trainer.optimizer.state
        bufs = [s["momentum_buffer"] for s in state.values() if "momentum_buffer" in s]
        observed["momentum_numel"] = sum(
            (b.to_local() if hasattr(b, "to_local") else b).numel() for b in bufs
        )
        inner = getattr(trainer.optimizer, "inner_optimizer", trainer.optimizer)
        observed["ns_calls"] = inner.ns_calls
        if hasattr(inner, "plan") and inner.process_group is not None:
            plan = inner.plan()
            observed["units"] = len(plan.units)
            observed["balance"] = inner.owner_balance()

    trainer.optimizer.register_step_post_hook(after_step)
    return record_qk_clip(trainer, observed)


def record_qk_clip(trainer, observed: dict) -> dict:  # noqa: ANN001
    """Record QK-clip's per-step statistics (qk_max_logit, qk_clipped_heads) into ``observed``: its
    ``after_optimizer_step`` hook calls ``clip`` by name, so the wrapper is seen however the hook is run."""
    from trainer.optim.qk_clip import QKClip

    qk_clip = trainer.hooks.of_type(QKClip)
    if qk_clip is not None:
        observed["qk_clip"] = []
        clip = qk_clip.clip

        def clip_and_record() -> dict:
            stats = clip()
            observed["qk_clip"].append(stats)
            return stats

        qk_clip.clip = clip_and_record
    return observed


# -- fixtures -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def references(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    tmp = tmp_path_factory.mktemp("muon_ref")
    cases = {}
    needed = {(model, NO_CLIP in ov) for _, model, ov in LAYOUTS.values()} | {("dense", False)}
    for model, noclip in sorted(needed):
        clip = "noclip" if noclip else "clip"
        extra = [NO_CLIP] if noclip else []
        cases[f"{model}_{clip}"] = Case(
            1, tiny_config(str(tmp / f"{model}_{clip}"), *_overrides(model, extra)), setup=use_torch_muon
        )
    cases["dense_ours"] = Case(1, tiny_config(str(tmp / "dense_ours"), *_overrides("dense", [])))
    return gather_cases(cases, world=1)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> GroupedRuns:
    tmp = tmp_path_factory.mktemp("muon")
    return GroupedRuns(
        {
            name: Case(world, tiny_config(str(tmp / name), *_overrides(model, ov)), setup=count_work)
            for name, (world, model, ov) in LAYOUTS.items()
        }
    )


def _reference(name: str, references: dict) -> dict:
    _, model, ov = LAYOUTS[name]
    return references[f"{model}_{'noclip' if NO_CLIP in ov else 'clip'}"]


# -- tests ----------------------------------------------------------------------------------------


def test_one_process_matches_torch_muon(references: dict) -> None:
    """Our Muon on one process against torch.optim.Muon + AdamW (the Trainer's own loop)."""
    assert_parallel_run(references["dense_clip"], references["dense_ours"], label="muon_1proc")
    losses = [r["loss"] for r in references["dense_clip"]["history"] if "loss" in r]
    assert losses[-1] < losses[0], losses


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_matches_torch_muon(layout: str, runs: GroupedRuns, references: dict) -> None:
    ref, got = _reference(layout, references), runs.get(layout)
    assert_parallel_run(ref, got, label=f"muon_{layout}")
    if LAYOUTS[layout][1] == "qkclip":  # the clip acted, on the same heads as in one process
        want = [s["qk_clipped_heads"] for s in ref["observed"][0]["qk_clip"]]
        for rank_observed in got["observed"]:
            assert [s["qk_clipped_heads"] for s in rank_observed["qk_clip"]] == want
        assert sum(want) > 0, want
        logged = [r["qk_clipped_heads"] for r in got["history"] if "loss" in r]  # metrics.jsonl
        assert logged == want, logged
        print(
            f"muon_{layout}: heads clipped per step {want}, max logit per step "
            f"{[round(s['qk_max_logit'], 3) for s in ref['observed'][0]['qk_clip']]}"
        )


def _muon_numel(run: dict) -> int:
    """Elements of the Muon matrices of a run (its final parameters, full)."""
    return sum(
        t.numel()
        for name, t in run["params"].items()
        if t.ndim >= 2 and not name.startswith(("tok_embeddings", "output"))
    )


@pytest.mark.parametrize(
    "layout", ["custom_ddp_x2", "fsdp_x2_noclip", "hsdp_2x2", "fsdp_tp_2x2_noclip", "moe_ep_x2", "pp2_fsdp2"]
)
def test_each_matrix_is_orthogonalised_once_and_momentum_is_not_replicated(
    layout: str, runs: GroupedRuns
) -> None:
    """Summed over ranks: one Newton-Schulz call per unit (matrix or expert) per step, and exactly
    one copy of the momentum (no replica keeps it twice)."""
    got = runs.get(layout)
    observed = got["observed"]
    steps = observed[0]["steps"]
    units = observed[0]["units"]
    calls = [o["ns_calls"] for o in observed]
    assert sum(calls) == units * steps, (calls, units, steps)
    assert sum(o["momentum_numel"] for o in observed) == _muon_numel(got)
    print(
        f"muon_{layout}: {units} matrices, NS calls per rank {calls} over {steps} steps, "
        f"owner balance (max/mean NS FLOPs) {observed[0]['balance']:.3f}"
    )


# -- checkpoints: resume bitwise, reshard across layouts ------------------------------------------

CKPT_SOURCES = {  # name -> overrides (2 ranks); each checkpoints at step 4 and trains to step 8
    "ddp": DDP,
    "zero1": [*DDP, "parallelism.ddp.sharded_optimizer=true"],
    "fsdp": ["parallelism.dp_shard=2"],
    "tp": ["parallelism.dp_shard=1", "parallelism.tp=2"],
}
CKPT_TARGETS = {  # name -> (source, overrides): loads the source's step-4 checkpoint, trains to 8
    "fsdp->fsdp": ("fsdp", CKPT_SOURCES["fsdp"]),
    "ddp->zero1": ("ddp", CKPT_SOURCES["zero1"]),
    "zero1->fsdp": ("zero1", CKPT_SOURCES["fsdp"]),
    "fsdp->tp": ("fsdp", CKPT_SOURCES["tp"]),
    "tp->ddp": ("tp", CKPT_SOURCES["ddp"]),
}


def _ckpt_worker(rank: int, world: int, sources: dict, targets: dict) -> dict:
    from tests.trainer.test_checkpoint_reshard import _full_state
    from trainer.checkpoint.checkpointer import load_full_state
    from trainer.train import Trainer

    out = {}
    for name, cfg in sources.items():
        trainer = Trainer(cfg)
        out[name] = {"history": trainer.train()}
        trainer.close()
    for name, cfg in targets.items():
        trainer = Trainer(cfg)
        got = _full_state(trainer)
        want = {
            f"optimizer.{k}": v
            for k, v in load_full_state(cfg.checkpoint.initial_load_path, "optimizer.").items()
        }
        momentum = sorted(k for k in want if k.endswith(".momentum_buffer"))
        mismatched = sorted(k for k in want if k not in got or not torch.equal(got[k], want[k]))
        out[name] = {
            "history": trainer.train(),
            "mismatched": mismatched,
            "momentum": momentum,
            "step": trainer.state.step,
        }
        trainer.close()
    return out


def test_checkpoint_resumes_bitwise_and_reshards(tmp_path) -> None:  # noqa: ANN001
    """Momentum and AdamW state are saved under the parameters' names (``state.<fqn>.momentum_buffer``)
    in every layout: the same layout resumes bitwise, another layout loads exactly the stored
    tensors and continues within 1e-5 (reduction order differs)."""
    from tests.dist import run_distributed
    from tests.parity import assert_parity, step_metrics

    common = [*MUON, "checkpoint.interval=4", NO_CLIP]
    sources = {
        n: tiny_config(str(tmp_path / n), *common, "checkpoint.enable=true", *ov)
        for n, ov in CKPT_SOURCES.items()
    }
    targets = {
        n: tiny_config(
            str(tmp_path / n.replace("->", "_to_")),
            *common,
            *ov,
            f"checkpoint.initial_load_path={tmp_path / src / 'checkpoints' / 'step-4'}",
            "checkpoint.initial_load_model_only=false",
        )
        for n, (src, ov) in CKPT_TARGETS.items()
    }
    results = run_distributed(_ckpt_worker, 2, sources, targets, timeout=1200)[0]
    for name, (src, _) in CKPT_TARGETS.items():
        got = results[name]
        assert got["mismatched"] == [] and len(got["momentum"]) == 28, (name, got["mismatched"][:5])
        ref = [r for r in results[src]["history"] if r.get("step", 0) > 4]
        resumed = [r for r in got["history"] if r.get("step", 0) > 4]
        same_layout = name.split("->")[0] == name.split("->")[1]
        if same_layout:
            assert step_metrics(resumed) == step_metrics(ref), name  # bitwise
        worst = assert_parity(ref, resumed, label=name)
        step5 = abs(resumed[0]["loss"] - ref[0]["loss"])
        print(
            f"muon checkpoint {name}: {'bitwise' if same_layout else 'resharded'}, next-step (5) loss "
            f"difference {step5:.2e}, steps 5-8 max rel loss {worst['loss']:.1e} grad norm "
            f"{worst['grad_norm']:.1e}"
        )
