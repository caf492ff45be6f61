"""ParallelDims validates degrees against the world size and the model before any process group."""

from __future__ import annotations

import pytest

from models.errors import ConfigError
from models.llama import LLAMA_SPEC, LlamaArgs
from parallelisms.parallel_dims import ParallelDims
from parallelisms.validate import validate_model, validated_dims


def dims(world: int, **kw: int) -> ParallelDims:
    base = {"dp_replicate": 1, "dp_shard": -1, "cp": 1, "tp": 1, "pp": 1, "ep": 1}
    base.update(kw)
    return ParallelDims(**base, world_size=world)


def test_fill_and_derived_sizes() -> None:
    d = dims(32, dp_replicate=4, tp=2)
    assert d.dp_shard == 4 and d.dp == 16 and d.dp_cp == 16
    assert d.fsdp_enabled and d.hsdp_enabled and not d.ddp_enabled
    d = dims(4, dp_replicate=4, dp_shard=1)
    assert d.ddp_enabled and not d.fsdp_enabled
    d = dims(1)
    assert d.dp == 1 and not d.ddp_enabled and not d.fsdp_enabled


@pytest.mark.parametrize(
    "world,kw,needle",
    [
        (2, {"tp": 3}, "parallelism.tp=3"),
        (8, {"dp_shard": 2, "tp": 2}, "multiply to 4"),
        (4, {"dp_shard": 0}, "parallelism.dp_shard=0"),
        (4, {"tp": 0}, "parallelism.tp=0"),
        (4, {"ep": 3}, "parallelism.ep=3"),
    ],
)
def test_bad_degrees(world: int, kw: dict, needle: str) -> None:
    with pytest.raises(ConfigError, match=needle.replace("*", r"\*")):
        dims(world, **kw)


def test_batch_divisibility() -> None:
    d = dims(4, dp_replicate=2)
    assert d.grad_accum_steps(32, 4) == 2
    with pytest.raises(ConfigError, match=r"global_batch_size=30 .* multiple of 16"):
        d.grad_accum_steps(30, 4)


@pytest.mark.parametrize(
    "kw,args,seq_len,needle",
    [
        ({"tp": 2}, LlamaArgs(dim=96, n_heads=3, n_kv_heads=3), 64, "n_heads=3"),
        ({"tp": 2}, LlamaArgs(dim=64, n_heads=4, n_kv_heads=1), 64, "n_kv_heads=1"),
        ({"tp": 2}, LlamaArgs(vocab_size=511), 64, "vocab_size=511"),
        ({"tp": 2}, LlamaArgs(), 63, "seq_len=63"),
        ({"pp": 8}, LlamaArgs(n_layers=4), 64, "pp=8 exceeds model.n_layers=4"),
    ],
)
def test_model_checks(kw: dict, args: LlamaArgs, seq_len: int, needle: str) -> None:
    d = dims(8, **kw)
    with pytest.raises(ConfigError, match=needle):
        validate_model(d, LLAMA_SPEC, args, seq_len=seq_len, sequence_parallel=True)


@pytest.mark.parametrize(
    "overrides,needle",
    [
        (("parallelism.tp=2", "parallelism.ddp.impl=torch"), "ddp.impl=torch with parallelism.tp=2"),
        (
            ("parallelism.tp=2", "parallelism.ddp.sharded_optimizer=true"),
            "sharded_optimizer=true with parallelism.tp=2",
        ),
        (("parallelism.cp=2", "training.seq_len=66"), r"seq_len=66 is not divisible by 4 = 2\*cp"),
        (
            ("parallelism.cp=2", "parallelism.cp_impl=ring"),
            "parallelism.cp_impl=allgather, which works on every device",
        ),
    ],
)
def test_unsupported_tp_compositions_are_config_errors(overrides: tuple[str, ...], needle: str) -> None:
    """Every parallelism check runs in ``validated_dims``, once, before any process group."""
    from tests.configs import make_config

    cfg = make_config(*overrides)
    t = cfg.training
    with pytest.raises(ConfigError, match=needle):
        validated_dims(
            cfg.parallelism,
            4,
            spec=LLAMA_SPEC,
            model_args=cfg.model,
            seq_len=t.seq_len,
            global_batch_size=t.global_batch_size,
            micro_batch_size=t.micro_batch_size,
        )


@pytest.mark.parametrize(
    "world,kw",
    [(8, {"dp_replicate": 2, "tp": 2}), (16, {"pp": 2, "dp_replicate": 2, "cp": 2}), (8, {"pp": 2, "tp": 2})],
)
def test_coordinates_follow_the_mesh_order(world: int, kw: dict) -> None:
    """Row-major over (pp, dp_replicate, dp_shard, cp, tp): tp varies fastest; ``dp`` flattens
    (dp_replicate, dp_shard). ``build_mesh`` re-checks these against the real mesh."""
    d = dims(world, **kw)
    seen = set()
    for rank in range(world):
        c = d.coordinates(rank)
        key = tuple(c[n] for n in ("pp", "dp_replicate", "dp_shard", "cp", "tp"))
        seen.add(key)
        assert c["dp"] == c["dp_replicate"] * d.dp_shard + c["dp_shard"]
        assert c["dp_cp"] == c["dp"] * d.cp + c["cp"]
        assert d.dp_rank_of(rank) == c["dp"]
    assert len(seen) == world
    assert d.coordinates(1)["tp" if d.tp > 1 else "cp" if d.cp > 1 else "dp_shard"] == 1
