"""The checkpoint term: one save's bytes and files per rank, as the planner plans it
(``trainer/planner/checkpoint.py``), as DCP's own planning finds it without writing
(``trainer/checkpoint/footprint.py``, what the rehearsal reports) and as a real save writes it.

A real 2-rank gloo save of the tiny model (FSDP, with and without tied embeddings, and DDP, whose
replicated tensors DCP de-duplicates) is measured file by file against both (ZeRO-1, whose owners save
their own optimizer state, against the plan); rehearsed 7b_hsdp and
70b_tp_fsdp ranks check that DCP's global plan over the derived local plans gives every one of the 32
ranks the data file the planner gives it, as a rehearsed qwen3_5_moe_debug rank at tp=2 does for its 2
ranks (a Gated DeltaNet's convolutions and decay vectors sharded over tp with its heads), a rehearsed
debug_pp rank (pipeline stages) its stage's.
"""

from __future__ import annotations

import os

import pytest

from tests.configs import tiny_config
from tests.dist import run_distributed

TOLERANCE = 0.05
LAYOUTS = {  # FSDP; FSDP with the head tied to the embedding (one tensor, two names); DDP (replicated)
    "fsdp": ("parallelism.dp_shard=2",),
    "tied": ("parallelism.dp_shard=2", "model.tie_embeddings=true"),
    "ddp": ("parallelism.dp_replicate=2", "parallelism.dp_shard=1"),
    "zero1": (
        "parallelism.dp_replicate=2",
        "parallelism.dp_shard=1",
        "parallelism.ddp.sharded_optimizer=true",
    ),
}
PLANNED_ONLY = {"zero1"}  # the footprint derives no other rank's plan under ZeRO-1 (other owners' state)
RUN = ("checkpoint.enable=true", "training.steps=1", "model.n_layers=2", "training.eval_freq=0")


def _save_and_size(rank: int, world_size: int, tmp: str) -> dict[str, dict[str, int]]:
    """In each rank: a real run ending with a checkpoint, then the footprint of that save's state."""
    from trainer.checkpoint.contents import completed_marker, peer_path
    from trainer.checkpoint.footprint import save_footprint
    from trainer.checkpoint.storage import CheckpointWriter, step_dir
    from trainer.train import Trainer

    out = {}
    for name, overrides in LAYOUTS.items():
        trainer = Trainer(tiny_config(os.path.join(tmp, name), *RUN, *overrides))
        trainer.train()
        if name in PLANNED_ONLY:
            trainer.close()
            continue
        ckpt, step = trainer.checkpointer, trainer.state.step
        marker = ckpt.marker(step, model_only=False)
        got = save_footprint(
            ckpt.save_state(),
            rank=rank,
            world_size=world_size,
            writer=CheckpointWriter(f"{step_dir(ckpt.folder, step)}.tmp-{'0' * 12}", step),
            peer_path=peer_path,
            coordinates=trainer.dims.coordinates,
            marker=lambda files, marker=marker: completed_marker(
                marker, files, {n: f"{0:08x}" for n in files}
            ),
        )
        trainer.close()
        out[name] = got.files
    return out


def _written(folder: str, rank: int) -> dict[str, int]:
    """The files of the committed checkpoint ``folder`` that ``rank`` wrote (rank 0 also DCP's .metadata
    and the marker), by the sizes on disk."""
    from trainer.checkpoint.storage import MARKER, read_marker

    files = {n: os.path.getsize(os.path.join(folder, n)) for n in read_marker(folder)["files"]}
    files[MARKER] = os.path.getsize(os.path.join(folder, MARKER))
    own = {n: size for n, size in files.items() if n.startswith(f"__{rank}_")}
    if rank == 0:
        own.update({n: size for n, size in files.items() if not n.startswith("__")})
    return own


@pytest.mark.slow
def test_a_real_save_writes_what_the_plan_and_the_footprint_say(tmp_path) -> None:
    from trainer.checkpoint.storage import step_dir
    from trainer.planner.cluster import compose_cluster
    from trainer.planner.plan import build_plan

    footprints = run_distributed(_save_and_size, 2, str(tmp_path))
    for name, overrides in LAYOUTS.items():
        cfg = tiny_config(str(tmp_path / name), *RUN, *overrides)
        plan = build_plan(cfg, compose_cluster(["cluster=cpu"]))
        assert plan.checkpoint is not None
        folder = step_dir(os.path.join(str(tmp_path / name), cfg.checkpoint.folder), 1)
        for rank in range(2):
            real = _written(folder, rank)
            planned = plan.checkpoint.rank_bytes[rank]
            print(
                f"{name} rank {rank}: real {sum(real.values()):,} B in {len(real)} files, "
                f"planned {planned:,.0f} B"
            )
            assert plan.checkpoint.rank_files[rank] == len(real)
            assert planned == pytest.approx(sum(real.values()), rel=TOLERANCE)
            if name in PLANNED_ONLY:
                continue
            mine = footprints[rank][name]
            print(f"{name} rank {rank}: footprint {sum(mine.values()):,} B")
            data = [n for n in real if n.endswith(".distcp")]
            assert sorted(mine) == sorted(real), f"{name} rank {rank}: the footprint names other files"
            assert {n: mine[n] for n in data} == {n: real[n] for n in data}, f"{name} rank {rank}: data files"
            assert sum(mine.values()) == pytest.approx(sum(real.values()), rel=0.001)


def _rehearsed_save(cfg, world: int, rank: int):
    """One training step of ``cfg`` rehearsed as ``rank`` of ``world`` (the fake process group), then the
    footprint of a save of its state, as ``python -m trainer.rehearse`` reports it."""
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from trainer.checkpoint.contents import completed_marker, every_stage, peer_path
    from trainer.checkpoint.footprint import save_footprint
    from trainer.checkpoint.storage import CheckpointWriter, step_dir
    from trainer.rehearse_trace import forget_meshes
    from trainer.rehearse_trainer import RehearsalTrainer

    saved = {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK="0")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        trainer = RehearsalTrainer(cfg, FakeTensorMode(allow_non_fake_inputs=True))
        with trainer.fake:
            trainer.train_step()
        trainer.state.step += 1
        ckpt, step = trainer.checkpointer, trainer.state.step
        marker = ckpt.marker(step, model_only=False)
        return save_footprint(
            ckpt.save_state(),
            rank=rank,
            world_size=world,
            writer=CheckpointWriter(f"{step_dir(ckpt.folder, step)}.tmp-{'0' * 12}", step),
            peer_path=peer_path,
            coordinates=trainer.dims.coordinates,
            every_stage=every_stage,
            marker=lambda files: completed_marker(marker, files, {n: f"{0:08x}" for n in files}),
        )
    finally:
        dist.destroy_process_group()
        forget_meshes()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


QWEN3_5_MOE_TP = ("model=qwen3_5_moe_debug", "parallelism.tp=2", "parallelism.dp_shard=1")


@pytest.mark.parametrize(
    ("experiment", "overrides", "world"),
    [
        ("7b_hsdp", ("model.n_layers=2",), None),
        ("70b_tp_fsdp", ("model.n_layers=1",), None),
        ("debug", QWEN3_5_MOE_TP, 2),
    ],
    ids=["7b_hsdp", "70b_tp_fsdp", "qwen3_5_moe_debug_tp2"],
)
def test_every_rank_writes_the_file_the_plan_gives_it(
    experiment: str, overrides: tuple[str, ...], world: int | None
) -> None:
    """7b_hsdp: each shard's chunks are held by its 4 replicas (dp_replicate), which DCP's coordinator
    spreads over them; 70b_tp_fsdp: the norms replicated over tp; in both the scalar optimizer steps and
    every object are held by all 32 ranks. qwen3_5_moe_debug at tp=2: the DeltaNet's convolution kernels
    and decay vectors are ``Shard(0)`` over tp (``shard_params``), the MoE layers replicated; every
    object is held by both ranks, so one misplaced tensor moves hundreds of them (planned 1,254 entries
    on rank 0 where DCP gave it 705 while the planner held those tensors replicated). DCP's global plan
    over the local plans derived from rank 0's and the planner's walk of the same rule give every rank
    the same data file, byte for byte, and rank 0 the same entries; rank 0's DCP .metadata and marker
    agree within 0.1%."""
    from trainer.config import compose_config
    from trainer.planner.cluster import compose_cluster
    from trainer.planner.plan import build_plan
    from trainer.rehearse import REHEARSAL_OVERRIDES, _dims_at, intended_world_size

    world = world or intended_world_size(experiment)
    cfg = compose_config(f"+experiment={experiment}", *overrides, *REHEARSAL_OVERRIDES)
    plan = build_plan(cfg, compose_cluster([]), experiment, dims=_dims_at(cfg, world)).checkpoint
    assert plan is not None and len(plan.rank_bytes) == world
    got = _rehearsed_save(cfg, world, 0)
    assert got.entries == plan.rank_entries[0]
    data = {int(n[2:].split("_")[0]): size for n, size in got.checkpoint.items() if n.endswith(".distcp")}
    assert sorted(data) == list(range(world))
    rank0_data = plan.rank_bytes[0] - plan.metadata_bytes - plan.marker_bytes
    assert [rank0_data, *plan.rank_bytes[1:]] == [data[r] for r in range(world)]
    assert plan.rank_files == [3] + [1] * (world - 1) and len(got.files) == 3
    print(
        f"{experiment}: rank 0 rehearsed {got.files}, planned .metadata {plan.metadata_bytes:,.0f}, "
        f"checkpoint.json {plan.marker_bytes:,.0f}"
    )
    assert got.bytes == pytest.approx(plan.rank_bytes[0], rel=0.001)


def test_a_pipeline_stage_writes_the_files_the_plan_gives_it() -> None:
    """debug_pp (pp 2 x dp_shard 2): rank 0 knows its own stage's entries and, of the other stage's plans,
    the entries every stage saves (schedule, loader, train state, RNG); its stage's two data files are
    the planner's, byte for byte. The .metadata, which lists the other stage's entries too, is not sized."""
    from trainer.config import compose_config
    from trainer.planner.cluster import compose_cluster
    from trainer.planner.plan import build_plan
    from trainer.rehearse import REHEARSAL_OVERRIDES, _dims_at

    world = 4
    cfg = compose_config("+experiment=debug_pp", *REHEARSAL_OVERRIDES)
    plan = build_plan(cfg, compose_cluster([]), "debug_pp", dims=_dims_at(cfg, world), rank=0).checkpoint
    assert plan is not None
    got = _rehearsed_save(cfg, world, 0)
    assert not got.complete and sorted(got.checkpoint) == ["__0_0.distcp", "__1_0.distcp"]
    rank0_data = plan.rank_bytes[0] - plan.metadata_bytes - plan.marker_bytes
    assert [got.checkpoint["__0_0.distcp"], got.checkpoint["__1_0.distcp"]] == [
        rank0_data,
        plan.rank_bytes[1],
    ]
    assert got.files == {"__0_0.distcp": rank0_data}
