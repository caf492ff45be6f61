"""The planner's float8 terms (``training.float8``; parallelisms/float8.py): with
``fsdp_float8_all_gather`` FSDP2 all-gathers the converted weights in float8 -- one byte an element
instead of ``param_dtype``'s (a quarter of fp32 masters, half of bf16) -- and the step hook
all-reduces one fp32 amax per float8 weight after each optimizer step, then keeps one fp32 scale
per weight for the next all-gathers. Masters, gradients, optimizer state and the gradient
reduce-scatter stay in high precision; without float8 all-gather nothing changes (the casts happen
on the gathered weights, inside each matmul). The precision term of the planner, not a family's:
the converted linears come from the same filter the trainer applies, run on the meta model."""

from __future__ import annotations

from parallelisms.float8 import float8_weight_names
from trainer.planner.context import PlanContext

__all__ = ["AMAX_BYTES", "float8_gathered", "float8_weights"]

AMAX_BYTES = 4  # one fp32 amax (all-reduced) and one fp32 scale (kept) per float8 weight


def _all_gathers_float8(c: PlanContext) -> bool:
    f8 = c.cfg.training.float8
    return f8.enable and f8.fsdp_float8_all_gather and c.dims.fsdp_enabled and c.table.model is not None


def float8_weights(c: PlanContext) -> list[tuple[int, float]]:
    """Per float8 weight that FSDP all-gathers in float8: (its block's index in ``c.table.blocks``,
    its elements on one tp rank, unsharded by FSDP). Empty without ``fsdp_float8_all_gather``."""
    if not _all_gathers_float8(c):
        return []
    model, spec = c.table.model, c.spec
    assert model is not None  # _all_gathers_float8
    index = {key: i for i, (key, _) in enumerate(spec.block_items(model))}
    params = dict(model.named_parameters())
    out = []
    for name in float8_weight_names(model, c.cfg.training.float8, spec):
        key = name[len(spec.blocks) + 1 :].split(".")[0]  # "<blocks>.<key>.<...>.weight"
        out.append((index[key], params[name].numel() / c.dims.tp))  # every block linear is TP-sharded
    return out


def float8_gathered(c: PlanContext) -> list[float]:
    """Per block (``c.table.blocks``' order): the elements FSDP all-gathers in float8 (one byte each)."""
    out = [0.0] * len(c.table.blocks)
    for block, elements in float8_weights(c):
        out[block] += elements
    return out
