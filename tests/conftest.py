"""Shared fixtures."""

from __future__ import annotations

import pytest

from tests.configs import NO_CLIP, PARITY_STEPS, tiny_config
from tests.parity import Case, gather_cases


@pytest.fixture(scope="session")
def tiny_reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    """The single-process Trainer on the tiny run for ``PARITY_STEPS`` (4) steps, the reference of the
    parity tests of the Llama layouts (one launch):

    * ``clip``: the defaults (grad_clip=1.0; every step of the tiny run is clipped);
    * ``noclip``: grad_clip=0, so a mis-scaled gradient reaches AdamW unnormalised;
    * ``clip_again``: ``clip`` repeated, to check the reference itself is deterministic.

    Each entry holds ``history`` (per-step loss and pre-clip grad_norm) and final ``params``.
    """
    tmp = tmp_path_factory.mktemp("reference")
    cases = {
        "clip": Case(1, tiny_config(str(tmp / "clip"), PARITY_STEPS)),
        "noclip": Case(1, tiny_config(str(tmp / "noclip"), PARITY_STEPS, NO_CLIP)),
        "clip_again": Case(1, tiny_config(str(tmp / "clip_again"), PARITY_STEPS)),
    }
    ref = gather_cases(cases, world=1)
    for run in ref.values():
        losses = [r["loss"] for r in run["history"] if "loss" in r]
        assert len(losses) == 4 and losses[-1] < losses[0], losses
    return ref
