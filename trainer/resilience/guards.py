"""Non-finite loss or gradient: every rank stops before the optimizer step, naming rank and step.

The global gradient norm is the same on every rank (clipping reduces it over all of them), so
it is the one value all ranks can branch on together; a NaN or Inf in any rank's loss or
gradient makes it non-finite everywhere. Only then (never in a healthy step) the ranks gather
which of them had a non-finite local loss, to name them.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any, Optional

import torch
import torch.distributed as dist

logger = logging.getLogger("meshwright")

# Test-only hook: "<rank>@<step>" makes that rank's forward output NaN at that step (the NaN
# test). Never set it in real runs.
NAN_ENV = "MESHWRIGHT_TEST_NAN_AT"


def non_finite_message(grad_norm: torch.Tensor, local_loss: torch.Tensor, step: int) -> Optional[str]:
    """None if ``grad_norm`` is finite (one host sync, as before). Otherwise, collectively on every
    rank, the message naming the ranks and the step; the caller raises before the optimizer step."""
    if bool(torch.isfinite(grad_norm)):
        return None
    world = dist.get_world_size() if dist.is_initialized() else 1
    finite = (
        torch.isfinite(local_loss.detach()).all().reshape(1).to(torch.int32)
    )  # (1,), on the loss's device
    flags = [finite]
    if world > 1:
        flags = [torch.zeros_like(finite) for _ in range(world)]
        dist.all_gather(flags, finite)
    bad = [r for r, f in enumerate(flags) if int(f.item()) == 0]
    if bad:
        origin = f"non-finite loss on rank {', '.join(map(str, bad))}"
    else:
        origin = (
            "a non-finite gradient (the loss was finite on every rank: the backward pass or the gradient "
            "reduction overflowed)"
        )
    return (
        f"{origin} at step {step} (global gradient norm {float(grad_norm)}); every rank stopped before the "
        f"optimizer step, nothing was applied and no checkpoint of this step was written. "
        "Lower optimizer.lr, keep training.grad_clip > 0, use training.mixed_precision=fp32, or resume from "
        "an "
        f"earlier checkpoint."
    )


def install_test_nan_hook(model: Any, rank: int, current_step: Callable[[], int]) -> None:
    """Test-only: with ``MESHWRIGHT_TEST_NAN_AT=<rank>@<step>``, this rank's forward returns NaN at that
    step, once (a step skipped by ``training.spike`` is taken again with the next batch, unpoisoned)."""
    spec = os.environ.get(NAN_ENV)
    if not spec:
        return
    want_rank, _, want_step = spec.partition("@")
    if int(want_rank) != rank or not hasattr(model, "register_forward_hook"):
        return

    fired: list[int] = []

    def hook(module: Any, args: Any, output: torch.Tensor) -> torch.Tensor:
        if current_step() == int(want_step) and not fired:
            fired.append(current_step())
            logger.warning(
                f"{NAN_ENV}={spec}: rank {rank} returns a NaN forward at step {want_step} (test hook)"
            )
            return output * float("nan")
        return output

    model.register_forward_hook(hook)
