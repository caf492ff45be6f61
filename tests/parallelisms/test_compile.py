"""training.compile=true: per-block torch.compile before FSDP wrapping trains like eager.

One small case only (each first compile costs ~30 s on a CPU): FSDP x2, 4 steps, 2 blocks,
clipping off, eager and compiled in one launch. Per-step losses, pre-clip grad norms and
final weights are compared with ``tests/parity.py`` at the eager layouts' tolerance (relative
1e-5; measured on torch 2.13 CPU: losses and grad norms bitwise equal, weights within 1.3e-6).
Inductor may fuse and reorder float ops, which is why this is not asserted bitwise.
"""

from __future__ import annotations

import pytest

from tests.configs import NO_CLIP, tiny_config
from tests.parity import Case, assert_parallel_run, gather_cases

pytestmark = pytest.mark.slow


def record_compiled(trainer) -> dict:  # noqa: ANN001
    """Test hook: which blocks are compiled modules."""
    from torch._dynamo.eval_frame import OptimizedModule

    return {"compiled": [isinstance(b, OptimizedModule) for b in trainer.model.layers.values()]}


def test_compiled_fsdp_matches_eager(tmp_path) -> None:
    common = ("parallelism.dp_shard=2", "training.steps=4", "model.n_layers=2", NO_CLIP)
    runs = gather_cases(
        {
            "eager": Case(2, tiny_config(str(tmp_path / "eager"), *common), setup=record_compiled),
            "compiled": Case(
                2,
                tiny_config(str(tmp_path / "compiled"), *common, "training.compile=true"),
                setup=record_compiled,
            ),
        },
        world=2,
    )
    assert runs["compiled"]["observed"] == [{"compiled": [True, True]}] * 2
    assert runs["eager"]["observed"] == [{"compiled": [False, False]}] * 2
    assert_parallel_run(runs["eager"], runs["compiled"], label="compile vs eager (FSDP x2)")
