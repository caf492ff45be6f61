"""A model family defined only here registers through the family door and trains, unchanged, under
FSDP x2, TP x2 and PP x2 -- the same as one process.

The family ``parallel_block`` is a tiny variant of Llama's block (GPT-J / PaLM style): attention and
the MLP read the same input, ``out = x + attn(norm1(x)) + ffn(norm2(x))``. Everything the rest of the
stack needs comes from its ``ModelSpec`` (``models.register_family``): no file outside this one is
edited to add it. The module registers the family at import, so every spawned rank that unpickles a
case (whose config holds :class:`ParallelBlockArgs`) registers it too.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

import pytest
from torch import Tensor, nn

from models import get_spec, register_family
from models.llama import LLAMA_SPEC
from models.llama.model import LlamaArgs, Transformer, TransformerBlock
from tests.configs import NO_CLIP, tiny_config
from tests.parity import Case, GroupedRuns, assert_parallel_run

FAMILY = "parallel_block"


@dataclass
class ParallelBlockArgs(LlamaArgs):
    """Llama's args; only the block differs."""

    family: str = FAMILY


class ParallelBlock(TransformerBlock):
    """``x + attn(attention_norm(x)) + ffn(ffn_norm(x))``: the same modules (and TP plan) as Llama's block."""

    def forward(self, x: Tensor, *, rope_cache: Tensor, positions: Optional[Tensor] = None) -> Tensor:
        attn = self.attention(self.attention_norm(x), rope_cache=rope_cache, positions=positions)
        return x + attn + self.feed_forward(self.ffn_norm(x))  # (B, S, H)


class ParallelBlockTransformer(Transformer):
    def build_block(self, layer_id: int, args: LlamaArgs) -> nn.Module:
        return ParallelBlock(layer_id, args)


SPEC = register_family(
    dataclasses.replace(
        LLAMA_SPEC, family=FAMILY, args_cls=ParallelBlockArgs, model_cls=ParallelBlockTransformer, hf=None
    )
)

LAYOUTS = {  # name -> (world, overrides): one launch per world size
    "one_process": (1, ()),
    "fsdp_x2": (2, ("parallelism.dp_shard=2",)),
    "tp_x2": (2, ("parallelism.tp=2", "parallelism.dp_shard=1")),
    "pp_x2": (2, ("parallelism.pp=2", "parallelism.dp_shard=1")),
}


def _family_config(folder: str, *overrides: str):  # noqa: ANN202 - a TrainConfig
    """The tiny run (clipping off, 4 steps) with its model args turned into this family's."""
    from trainer.config import validate

    cfg = tiny_config(folder, NO_CLIP, "training.steps=4", *overrides)
    cfg.model = SPEC.make_args({**dataclasses.asdict(cfg.model), "family": FAMILY})
    validate(cfg)
    return cfg


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> GroupedRuns:
    tmp = tmp_path_factory.mktemp("family_door")
    return GroupedRuns(
        {name: Case(world, _family_config(str(tmp / name), *ov)) for name, (world, ov) in LAYOUTS.items()}
    )


def test_the_family_is_reached_through_its_spec() -> None:
    assert get_spec(FAMILY) is SPEC
    model = SPEC.build(_family_config("/nonexistent-unused").model)
    assert isinstance(model.layers["0"], ParallelBlock)


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["fsdp_x2", "tp_x2", "pp_x2"])
def test_new_family_trains_the_same_in_every_layout(runs: GroupedRuns, layout: str) -> None:
    reference = runs.get("one_process")
    losses = [r["loss"] for r in reference["history"] if "loss" in r]
    assert len(losses) == 4 and losses[-1] < losses[0], losses
    assert_parallel_run(reference, runs.get(layout), label=f"{FAMILY} {layout}")
