"""DiLoCo and Streaming DiLoCo across fault-tolerant replica groups (``parallelism.fault_tolerance.
semi_sync``, trainer/resilience/semi_sync.py), launched as a user does (``FT_GROUPS=2 NPROC=1 ./launch.sh``).

* against an independent reference written here from the algorithm (two model copies, H inner AdamW
  steps each on its own samples, the pseudo-gradients averaged, Nesterov outer SGD on the weights of the
  last sync; for streaming, torchft's fragment schedule with delay 0 and alpha 0): every group's loss
  at every step and its final weights;
* inner SGD without clipping, ``sync_every=1`` and an outer SGD of lr 1 train what the synchronous
  fault-tolerant run trains (the per-step gradient mean over the groups);
* the configuration's refusals.
"""

from __future__ import annotations

import copy
import json
import os
import re
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from tests.configs import TINY, tiny_config
from tests.ft_harness import FT_FAST, FTJob
from trainer.config import ConfigError, compose_config
from trainer.resilience.fault_tolerance import group_folder
from trainer.resilience.guards import NAN_ENV
from trainer.resilience.semi_sync import SYNC_LOG

pytest.importorskip("torchft")

SS = "parallelism.fault_tolerance.semi_sync"
FT = "parallelism.fault_tolerance"
# One forward per step (no accumulation: the reference's arithmetic order), a constant LR (the
# reference's AdamW takes optimizer.lr), checkpoints at the last step only.
RUN = (
    *TINY,
    "training.micro_batch_size=4",
    "lr_scheduler.decay_type=constant",
    "lr_scheduler.warmup_steps=0",
    "training.steps=6",
    "checkpoint.enable=true",
    "checkpoint.interval=100",
    *FT_FAST,
    f"{FT}.min_replicas=2",
)
GROUPS, GROUP_BATCH, STEPS = 2, 4, 6


def test_semi_sync_config_errors() -> None:
    """Bad semi_sync settings fail at validation, naming the key and the fix."""
    base = ("+experiment=debug", "parallelism.dp_replicate=2", f"{FT}.enable=true", f"{SS}.method=diloco")
    cases = {
        f"{SS}.method=local_sgd": f"{SS}.method",
        f"{SS}.sync_every=0": "sync_every=0 must be >= 1",
        f"{SS}.fragments=2": "use method=streaming_diloco for fragments",
        f"{SS}.fragment_sync_delay=32": "fragment_sync_delay=32 must lie in [0, sync_every/fragments=32)",
        f"{SS}.fragment_update_alpha=1.5": "fragment_update_alpha=1.5 must lie in [0, 1]",
        f"{SS}.outer_optimizer.lr=0": "outer_optimizer.lr=0.0 must be > 0",
        f"{SS}.outer_optimizer.momentum=0": "optimizer.nesterov=true needs optimizer.momentum > 0",
        f"{SS}.outer_optimizer.name=lion": "optimizer.name",
        f"{FT}.startup_wait_s=5": "startup_wait_s=5.0: not supported",
    }
    for override, message in cases.items():
        with pytest.raises(ConfigError) as err:
            compose_config(*base, override)
        assert message in str(err.value), (override, str(err.value))
    streaming = (*base[:3], f"{SS}.method=streaming_diloco")
    for override, message in {
        f"{SS}.fragments=1": "needs >= 2 fragments",
        f"{SS}.fragments=3": "sync_every=32 must be a multiple of",
    }.items():
        with pytest.raises(ConfigError) as err:
            compose_config(*streaming, override)
        assert message in str(err.value), (override, str(err.value))
    with pytest.raises(ConfigError, match=f"{FT}.enable=true"):
        compose_config("+experiment=debug", f"{SS}.method=diloco")
    # quantize: torchft's Triton kernels run on CUDA only (silently ignored otherwise): refused by name
    from trainer.resilience.semi_sync import check_quantize

    cfg = compose_config(*base, f"{SS}.quantize=true")
    with pytest.raises(ConfigError, match="CUDA only"):
        check_quantize(cfg.parallelism.fault_tolerance.semi_sync, "cpu")


def test_sgd_is_torch_sgd() -> None:
    """optimizer=sgd (the outer optimizer's registry entry): torch.optim.SGD with Nesterov momentum on
    matrices decayed and vectors not, bitwise over 3 steps, and its own keys refused when out of range."""
    from trainer.optim import build_optimizer, validate_optimizer
    from trainer.optim.config import LRSchedulerConfig, OptimizerConfig

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 4))
    twin = copy.deepcopy(model)
    cfg = OptimizerConfig(name="sgd", lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01)
    ours = build_optimizer(model, cfg, device_type="cpu")
    theirs = torch.optim.SGD(
        [
            {"params": [p for p in twin.parameters() if p.ndim >= 2], "weight_decay": 0.01},
            {"params": [p for p in twin.parameters() if p.ndim < 2], "weight_decay": 0.0},
        ],
        lr=0.1,
        momentum=0.9,
        nesterov=True,
        fused=True,  # what optimizer.implementation=auto picks on the CPU for plain tensors
    )
    for step in range(3):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
        for m, opt in ((model, ours), (twin, theirs)):
            m(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), twin.parameters()))
    for bad, message in {
        "momentum": "optimizer.momentum=1.0 must lie in [0, 1)",
        "nesterov": "needs",
    }.items():
        wrong = OptimizerConfig(
            name="sgd", momentum=1.0 if bad == "momentum" else 0.0, nesterov=bad == "nesterov"
        )
        with pytest.raises(ConfigError, match=re.escape(message)):
            validate_optimizer(wrong, LRSchedulerConfig())


@pytest.mark.parametrize("inner", ["adamw", "sgd"])
def test_planner_counts_the_outer_optimizer(tmp_path, inner: str) -> None:
    """The planner's optimizer bytes under DiLoCo: the inner optimizer's state plus the outer one's (Nesterov
    momentum), as the real torch optimizers hold them after a step over the tiny model."""
    from trainer.planner.cluster import compose_cluster
    from trainer.planner.plan import build_plan
    from trainer.train import Trainer

    layout = (
        "parallelism.dp_replicate=2",
        "parallelism.dp_shard=1",
        f"{FT}.enable=true",
        f"{SS}.method=diloco",
    )
    optimizer = ("optimizer=sgd", "optimizer.momentum=0.9") if inner == "sgd" else ()
    plan = build_plan(
        tiny_config(str(tmp_path / "plan"), *optimizer, *layout), compose_cluster(["cluster=cpu"])
    )
    trainer = Trainer(tiny_config(str(tmp_path / "one"), *optimizer))
    try:
        model = trainer.model_parts[0]
        outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True, fused=True)
        model(torch.randint(0, 512, (2, 32))).logsumexp(-1).mean().backward()
        trainer.optimizer.step()
        outer.step()
        held = sum(
            v.numel() * v.element_size()
            for opt in (trainer.optimizer, outer)
            for state in opt.state.values()
            for v in state.values()
            if isinstance(v, torch.Tensor) and v.dim() > 0
        )
    finally:
        trainer.close()
    assert plan.stages[0].optimizer_bytes == held, (plan.stages[0].optimizer_bytes, held)


def _records(dump: str, group: int) -> list[dict[str, Any]]:
    with open(os.path.join(group_folder(dump, group), "metrics.jsonl"), encoding="utf-8") as f:
        return [r for r in map(json.loads, f) if "loss" in r]


def _final_weights(dump: str, group: int) -> dict[str, torch.Tensor]:
    from trainer.checkpoint.load import load_model

    model, _ = load_model(os.path.join(group_folder(dump, group), "checkpoints", f"step-{STEPS}"))
    return model.state_dict()


def _fragment_index(model: torch.nn.Module, fragments: int) -> list[int]:
    """The parameters (in order) cut into contiguous runs of about equal size: a parameter joins the
    fragment holding the midpoint of its elements (the documented rule, written again)."""
    sizes = [p.numel() for p in model.parameters()]
    total, before, out = sum(sizes), 0, []
    for n in sizes:
        midpoint = before + n / 2
        out.append(min(fragments - 1, int(midpoint / total * fragments)))
        before += n
    return out


def _reference(
    tmp: str, *, sync_every: int, fragments: int, lr: float, wd: float = 0.1, clip: float = 1.0
) -> tuple[list[list[float]], list[dict[str, torch.Tensor]]]:
    """DiLoCo from its definition: two copies of the model (the run's initial weights), each with its own
    torch.optim.AdamW (matrices decayed); copy g trains at step k on samples [8k + 4g, 8k + 4g + 4) (the
    run's loader reads them); every sync_every/fragments steps one fragment (torchft's order: the
    sync count mod fragments) takes the mean over the copies of (weights at its last sync - local
    weights) as the gradient of Nesterov SGD (lr 0.7, momentum 0.9) on its last-sync weights, and every
    copy takes the result. Returns each copy's per-step losses and final weights."""
    from trainer.train import Trainer

    one_group = (*RUN[: len(TINY) + 4], f"training.global_batch_size={GROUP_BATCH}")
    trainer = Trainer(tiny_config(tmp, *one_group))
    try:
        base = trainer.model_parts[0]
        copies = [copy.deepcopy(base) for _ in range(GROUPS)]
        inner = [
            torch.optim.AdamW(
                [
                    {"params": [p for p in m.parameters() if p.ndim >= 2], "weight_decay": wd},
                    {"params": [p for p in m.parameters() if p.ndim < 2], "weight_decay": 0.0},
                ],
                lr=lr,
                betas=(0.9, 0.95),
                eps=1e-8,
                fused=True,
            )
            for m in copies
        ]
        synced = [p.detach().clone() for p in base.parameters()]  # the weights of the last sync
        index = _fragment_index(base, fragments)
        outer_params = [
            [torch.nn.Parameter(synced[i].clone()) for i in range(len(synced)) if index[i] == k]
            for k in range(fragments)
        ]
        outer = [torch.optim.SGD(ps, lr=0.7, momentum=0.9, nesterov=True, fused=True) for ps in outer_params]
        losses: list[list[float]] = [[] for _ in range(GROUPS)]
        period, syncs = sync_every // fragments, 0
        loader = trainer.train_loader
        for step in range(STEPS):
            for g, (model, opt) in enumerate(zip(copies, inner)):
                loader.seek(step * GROUPS * GROUP_BATCH + g * GROUP_BATCH, stride=GROUPS * GROUP_BATCH)
                batch = loader.next_batch()
                kwargs = {"positions": batch.positions} if batch.positions is not None else {}
                logits = model(batch.inputs, **kwargs)
                loss = F.cross_entropy(
                    logits.flatten(0, 1).float(), batch.labels.flatten(), ignore_index=-100
                )
                loss.backward()
                if clip > 0:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
                opt.step()
                opt.zero_grad()
                losses[g].append(loss.item())
            if (step + 1) % period:
                continue
            k = syncs % fragments  # the fragment synced now
            members = [i for i in range(len(synced)) if index[i] == k]
            with torch.no_grad():
                for target, i in zip(outer_params[k], members):
                    local = [list(m.parameters())[i] for m in copies]
                    target.grad = torch.stack([synced[i] - p for p in local]).mean(0)
                outer[k].step()
                outer[k].zero_grad()
                for target, i in zip(outer_params[k], members):
                    synced[i].copy_(target)
                    for m in copies:
                        list(m.parameters())[i].copy_(target)
            syncs += 1
        names = [n for n, _ in base.named_parameters()]
        finals = [{n: p.detach().clone() for n, p in zip(names, m.parameters())} for m in copies]
        return losses, finals
    finally:
        trainer.close()


def _compare(
    dump: str, losses: list[list[float]], finals: list[dict[str, torch.Tensor]]
) -> tuple[float, float]:
    """Worst relative loss error and worst absolute final-weight error of the run's groups."""
    loss_err = weight_err = 0.0
    for g in range(GROUPS):
        records = _records(dump, g)
        assert [r["step"] for r in records] == list(range(1, STEPS + 1))
        for r, expected in zip(records, losses[g]):
            loss_err = max(loss_err, abs(r["loss"] - expected) / abs(expected))
        weights = _final_weights(dump, g)
        for name, expected in finals[g].items():
            weight_err = max(weight_err, (weights[name] - expected).abs().max().item())
    return loss_err, weight_err


def _check_sync_bytes(tmp_path, extra: tuple[str, ...], dump: str) -> None:
    """The ledger's cross-group bytes: nothing between syncs, at each sync a fragment's pseudo-gradient
    (+ the 32-byte status); their mean over the fragments is the planner's bytes per sync."""
    from trainer.observe.comm_ledger import UNREGISTERED_AXIS
    from trainer.planner.cluster import compose_cluster
    from trainer.planner.comm import semi_sync_bytes_per_sync
    from trainer.planner.context import build_context

    measured, previous = [], 0
    for r in _records(dump, 0):
        sent = r["comm"]["ranks"]["0"].get("all_reduce", {}).get(UNREGISTERED_AXIS, {}).get("bytes", 0)
        if r["ft/syncs"] == previous:
            assert sent == 0, r  # no cross-group byte between syncs
        else:
            measured.append(sent)
        previous = r["ft/syncs"]
    plan_layout = ("parallelism.dp_replicate=2", "parallelism.dp_shard=1", f"{FT}.enable=true")
    cfg = tiny_config(str(tmp_path / "plan"), *RUN, *extra, *plan_layout)
    predicted = semi_sync_bytes_per_sync(build_context(cfg, compose_cluster(["cluster=cpu"])), 0)
    fragments = cfg.parallelism.fault_tolerance.semi_sync.fragments
    mean = sum(measured[:fragments]) / fragments
    print(f"cross-group bytes per sync: measured {measured}, planner {predicted:.0f}")
    assert mean == predicted, (measured, predicted)


@pytest.mark.slow
def test_diloco_and_streaming_match_reference(tmp_path) -> None:
    """DiLoCo (H=3: syncs after steps 3 and 6) and Streaming DiLoCo (H=4, 2 fragments: fragment 0
    after steps 2 and 6, fragment 1 after step 4), two groups of one rank each, run side by side; each
    group's losses and final weights against the reference (fp32); DiLoCo with FSDP x2 inside each
    group against the same reference (a layout inside a group, fp32 tolerance)."""
    runs = {
        "diloco": (3, 1, (f"{SS}.method=diloco", f"{SS}.sync_every=3")),
        "streaming": (4, 2, (f"{SS}.method=streaming_diloco", f"{SS}.sync_every=4", f"{SS}.fragments=2")),
    }
    ledger = "metrics.comm_ledger=true"  # counts the cross-group bytes; the arithmetic is the same
    jobs = {name: FTJob(str(tmp_path / name), (*RUN, *extra, ledger)) for name, (_, _, extra) in runs.items()}
    # DiLoCo stopped after step 4 (one step into its second window; each group checkpoints its own) and
    # launched again to step 6: it resumes exactly.
    resumed = str(tmp_path / "resumed")
    jobs["first_part"] = FTJob(resumed, (*RUN, *runs["diloco"][2], "training.steps=4"))
    # FSDP x2 inside each group (2 samples a rank): the same DiLoCo against the same reference
    fsdp = FTJob(
        str(tmp_path / "fsdp"),
        (*RUN, *runs["diloco"][2], "parallelism.dp_shard=2", "training.micro_batch_size=2"),
        nproc=2,
    )
    jobs["fsdp"] = fsdp
    try:
        expected = {
            name: _reference(str(tmp_path / f"ref_{name}"), sync_every=h, fragments=f, lr=3e-3)
            for name, (h, f, _) in runs.items()
        }
        for job in jobs.values():
            assert job.wait(timeout=600) == 0, job.log()
        jobs["resumed"] = FTJob(resumed, (*RUN, *runs["diloco"][2]))
        assert jobs["resumed"].wait(timeout=600) == 0, jobs["resumed"].log()
    finally:
        for job in jobs.values():
            job.stop()
    for g in range(GROUPS):
        whole, again = _records(jobs["diloco"].dump, g), _records(resumed, g)
        assert [r["step"] for r in again] == list(range(1, STEPS + 1))
        assert [r["loss"] for r in again] == [r["loss"] for r in whole], g
        final, final_again = _final_weights(jobs["diloco"].dump, g), _final_weights(resumed, g)
        assert all(torch.equal(final[k], final_again[k]) for k in final), g
    del jobs["first_part"], jobs["resumed"], jobs["fsdp"]
    loss_err, weight_err = _compare(fsdp.dump, *expected["diloco"])
    print(f"diloco, FSDP x2 in each group: loss error {loss_err:.2e}, weight error {weight_err:.2e}")
    assert loss_err <= 1e-5 and weight_err <= 1e-4, (loss_err, weight_err)
    for name, job in jobs.items():
        loss_err, weight_err = _compare(job.dump, *expected[name])
        records = [_records(job.dump, g) for g in range(GROUPS)]
        syncs = [r["ft/syncs"] for r in records[0]]
        print(f"{name}: max relative loss error {loss_err:.2e}, weight error {weight_err:.2e}; syncs {syncs}")
        assert loss_err <= 1e-5 and weight_err <= 1e-5, (name, loss_err, weight_err)
        assert (
            all(r["ft/participants"] == 2 for r in records[0][2:]) and records[0][-1]["ft/failed_syncs"] == 0
        )
        _check_sync_bytes(tmp_path, runs[name][2], job.dump)
    # the groups meet only at syncs: DiLoCo's sync count after steps 3 and 6, streaming's after 2, 4, 6
    assert [r["ft/syncs"] for r in _records(jobs["diloco"].dump, 0)] == [0, 0, 1, 1, 1, 2]
    assert [r["ft/syncs"] for r in _records(jobs["streaming"].dump, 0)] == [0, 1, 1, 2, 2, 3]


@pytest.mark.slow
def test_diloco_h1_sgd_equals_synchronous(tmp_path) -> None:
    """Inner SGD, no clipping, sync_every=1, outer SGD of lr 1 without momentum: each step's outer update
    is the mean of the groups' SGD steps, i.e. SGD on the mean gradient, which the synchronous
    fault-tolerant run takes (per-step quorum and gradient all-reduce); with a loss spike skipped at
    step 5 in both runs."""
    # both runs skip step 5 as a loss spike (a NaN forward on rank 0 of each group, once): nothing is
    # applied, the batch is consumed, and under DiLoCo the skipped step still counts as an inner step
    sgd = (*RUN, "optimizer=sgd", "optimizer.lr=0.1", "training.grad_clip=0", "training.spike.enable=true")
    semi = (
        f"{SS}.method=diloco",
        f"{SS}.sync_every=1",
        f"{SS}.outer_optimizer.lr=1",
        f"{SS}.outer_optimizer.momentum=0",
        f"{SS}.outer_optimizer.nesterov=false",
    )
    poison = {NAN_ENV: "0@5"}
    jobs = [
        FTJob(str(tmp_path / "diloco"), (*sgd, *semi), env=poison),
        FTJob(str(tmp_path / "sync"), sgd, env=poison),
    ]
    try:
        for job in jobs:
            assert job.wait(timeout=600) == 0, job.log()
    finally:
        for job in jobs:
            job.stop()
    diloco, sync = jobs
    loss_err = 0.0
    for a, b, s in zip(
        _records(diloco.dump, 0), _records(diloco.dump, 1), _records(sync.dump, 0), strict=True
    ):
        # the synchronous run logs the loss over both groups' tokens (equal counts): the groups' mean
        loss_err = max(loss_err, abs((a["loss"] + b["loss"]) / 2 - s["loss"]) / s["loss"])
    from trainer.checkpoint.load import load_model

    ref = load_model(os.path.join(sync.dump, "checkpoints", f"step-{STEPS}"))[0].state_dict()
    weight_err = max(
        max((w - ref[n]).abs().max().item() for n, w in _final_weights(diloco.dump, g).items())
        for g in range(GROUPS)
    )
    for g in range(GROUPS):  # a sync after every inner step, the skipped one too (step 5 twice)
        with open(os.path.join(group_folder(diloco.dump, g), SYNC_LOG), encoding="utf-8") as f:
            assert [json.loads(line)["step"] for line in f] == [1, 2, 3, 4, 5, 5, 6], g
    print(f"DiLoCo H=1 vs synchronous: relative loss error {loss_err:.2e}, weight error {weight_err:.2e}")
    assert loss_err <= 1e-5 and weight_err <= 1e-5


@pytest.mark.slow
def test_kill_and_heal_keep_the_data_rule(tmp_path) -> None:
    """DiLoCo (H=2) in 2 groups, min_replicas=1: group 1 is SIGKILLed between syncs (step 5), later group 0
    inside a sync (after the quorum, before the exchange). Each time the survivor's sync misses a group
    that opened the window: the window is dropped and its samples trained again; the restarted group joins
    the survivor at its next sync, healing from it (outer momentum and weights of the last sync bitwise
    equal from then on). The committed windows tile the data: each sample committed once."""
    from trainer.resilience.fault_tolerance import KILL_ENV
    from trainer.resilience.semi_sync import KILL_IN_SYNC_ENV

    period, batch = 2, GROUP_BATCH
    job = FTJob(
        str(tmp_path / "ft"),
        (
            *RUN,
            "training.steps=100000",
            f"{FT}.min_replicas=1",
            f"{FT}.quorum_timeout_s=12",
            f"{FT}.hang_timeout_s=14",
            f"{SS}.method=diloco",
            f"{SS}.sync_every={period}",
        ),
        step_delay_s=0.1,
        env={KILL_ENV: "1@5", KILL_IN_SYNC_ENV: "0"},
    )

    def healed(group: int, after: int) -> bool:  # healed after step ``after`` and synced twice with its peer
        records = job.records(group)
        heals = [r for r in records if r.get("ft/heal_s") and r["step"] > after]
        return bool(heals) and records[-1]["ft/syncs"] >= heals[0]["ft/syncs"] + 2

    try:
        job.wait_for(lambda: healed(1, 4), 300, "group 1 to rejoin after its SIGKILL")
        rejoined = job.last_step(1)
        open(
            os.path.join(group_folder(job.dump, 0), "test_kill_in_sync_arm"), "w"
        ).close()  # group 0 dies next
        job.wait_for(lambda: healed(0, rejoined), 300, "group 0 to rejoin after its SIGKILL in a sync")
    finally:
        job.stop()
    exits = [line for line in job.supervisor_lines() if "exited" in line]
    assert len(exits) >= 2, job.supervisor_lines()
    records = {g: job.records(g) for g in range(GROUPS)}
    # bitwise equal outer state (outer momentum, weights of the last sync) wherever both logged a step
    by_step = [{r["step"]: r for r in records[g]} for g in range(GROUPS)]
    shared = sorted(set(by_step[0]) & set(by_step[1]))
    assert len(shared) >= 4, shared
    for step in shared:
        assert by_step[0][step]["ft/outer_sha"] == by_step[1][step]["ft/outer_sha"], step
    # the windows every group logged at its syncs (syncs.jsonl, kept across restarts), merged
    windows = set()
    for g in range(GROUPS):
        with open(os.path.join(group_folder(job.dump, g), SYNC_LOG), encoding="utf-8") as f:
            for line in f:
                w = json.loads(line)
                windows.add((w["sync"], w["window_start"], w["window_groups"], w["committed"]))
    committed = sorted((w for w in windows if w[3]), key=lambda w: w[0])
    failed = [w for w in windows if not w[3]]
    assert [w[0] for w in committed] == list(range(len(committed))), committed  # one commit per sync count
    position = 0
    for sync, start, groups, _ in committed:
        assert start == position, (sync, start, position)  # each window starts where the last one ended
        position += period * groups * batch
    starts = {w[0]: w[1] for w in committed}
    for sync, start, _, _ in failed:  # a dropped window's samples are trained again from its start
        assert starts.get(sync, start) == start, (sync, start, starts.get(sync))
    assert len(failed) >= 2, failed  # the survivor's sync after each kill
    # per step: each group read its slot of the window's samples
    for g in range(GROUPS):
        for r in records[g]:
            if r["step"] % period:
                start, groups, slot = r["ft/window"]
                assert r["ft/data_position"] == start + (r["step"] - 1) % period * groups * batch, r
    print(
        f"{len(committed)} committed windows ({position} samples, each once), {len(failed)} dropped; "
        f"group exits: {len(exits)}; {len(shared)} steps logged by both groups with equal outer state"
    )
