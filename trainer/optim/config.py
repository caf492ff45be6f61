"""Typed optimizer and LR-schedule options (the ``optimizer`` and ``lr_scheduler`` config groups' schemas).

They live here, beside the optimizers, and ``trainer/config.py`` registers them with Hydra (as it does
``trainer/eval/config.py``'s); this module imports nothing of the trainer, so the registry
(``trainer/optim/__init__.py``) and ``trainer/config.py`` can both import it. Their checks are
``trainer.optim.validate_optimizer``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

__all__ = ["DEFAULT_NS_COEFFICIENTS", "LRSchedulerConfig", "MuonConfig", "OptimizerConfig"]

# Muon's Newton-Schulz quintic (a, b, c): torch.optim.Muon's (Keller Jordan's). The one copy: the
# config default, its error message and the tests read it here.
DEFAULT_NS_COEFFICIENTS: tuple[float, float, float] = (3.4445, -4.7750, 2.0315)


@dataclass
class MuonConfig:
    """The Muon group of ``optimizer.name=muon`` (>=2-D hidden weights; experts per expert)."""

    lr: float = 3e-4  # peak LR of the Muon group (the schedule scales it like the AdamW group's)
    weight_decay: float = 0.1  # decoupled: p *= 1 - lr * weight_decay
    momentum: float = 0.95
    nesterov: bool = True
    ns_steps: int = 5  # Newton-Schulz iterations
    ns_coefficients: tuple[float, float, float] = DEFAULT_NS_COEFFICIENTS
    eps: float = 1e-7  # floor of the norm the iteration divides by
    adjust_lr_fn: str = (
        "match_rms_adamw"  # match_rms_adamw (0.2*sqrt(max(A,B))) | original (sqrt(max(1,A/B)))
    )
    ns_dtype: str = "bfloat16"  # bfloat16 (torch.optim.Muon's) | float32


@dataclass
class OptimizerConfig:
    # a name in trainer.optim.OPTIMIZERS: adamw | muon (Muon for hidden matrices, AdamW with the keys
    # below for the rest)
    name: str = "adamw"
    lr: float = 3e-4
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.1
    implementation: str = "auto"  # auto | fused | foreach | for-loop
    muon: MuonConfig = field(default_factory=MuonConfig)  # used when name=muon
    momentum: float = 0.0  # name=sgd: torch.optim.SGD's momentum
    nesterov: bool = False  # name=sgd: Nesterov momentum (needs momentum > 0)
    qk_clip_tau: float = 0.0  # QK-clip: cap on each attention head's max pre-softmax logit; 0 = off


@dataclass
class LRSchedulerConfig:
    warmup_steps: int = 10
    decay_type: str = "cosine"  # a name in trainer.optim.LR_SCHEDULES: cosine | linear | constant | wsd
    min_lr_ratio: float = 0.1  # floor of the decay, as a fraction of optimizer.lr
    # decay_type=wsd only (trainer/optim/schedules.py wsd): the decay's shape, linear | cosine | 1-sqrt;
    # its length: decay_start_step (the first decayed step; "decay from here"), else decay_steps, else
    # decay_fraction of training.steps
    decay_shape: str = "linear"
    decay_fraction: float = 0.2
    decay_steps: Optional[int] = None
    decay_start_step: Optional[int] = None
