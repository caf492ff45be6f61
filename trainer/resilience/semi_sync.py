"""DiLoCo and Streaming DiLoCo across the fault-tolerant replica groups (``parallelism.fault_tolerance.
semi_sync``), on torchft 0.2.0's ``torchft.local_sgd.DiLoCo``.

Each replica group trains on its own with its inner optimizer (``optimizer.*``, any layout inside the
group). Every ``sync_every / fragments`` inner steps one fragment of the model is synchronised across
the groups: a quorum (a lagging group heals here, from a live peer, through the authenticated transport
of trainer/resilience/trust.py), the *pseudo-gradient* of the fragment (its weights at the last sync
minus its local weights) averaged over the groups, and the outer optimizer
(``semi_sync.outer_optimizer``, from the optimizer registry; DiLoCo's is Nesterov SGD) applied to the
weights of the last sync. ``fragments=1`` is DiLoCo; ``fragments >= 2`` is Streaming DiLoCo, with
torchft's schedule: fragment ``manager_step % fragments`` at each sync point.

Between syncs there is no cross-group collective and no quorum: the per-step quorum, the token sum and
the gradient mean of synchronous fault tolerance are off (trainer/resilience/fault_tolerance.py).
torchft's own schedule drives the sync; it runs as a step hook after the inner optimizer's step.

Fragments: the parameters of the model parts in their order, cut into ``fragments`` contiguous runs of
about equal size (a parameter belongs to the fragment that holds the midpoint of its elements;
:func:`fragment_of`). Under FSDP or TP each rank exchanges its local shards with the same rank of the
other groups (the groups have identical layouts).

Data: group ``g`` of ``G`` reads, at each inner step, ``b`` samples at ``position + g*b`` where the
position advances ``G*b`` per inner step (``b`` = global batch / dp_replicate), so the groups train
disjoint samples. Checkpoints: each group writes its own (``<dump>/replica_group_<g>/checkpoints``),
with the inner state, the weights of the last sync and the outer optimizers (:class:`SemiSyncState`).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Optional, Protocol

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from models.errors import ConfigError

if TYPE_CHECKING:
    from torchft import Manager
    from torchft.local_sgd import DiLoCo

    from parallelisms.config import SemiSyncConfig
    from trainer.data.loader import DataLoader
    from trainer.step import StepState

logger = logging.getLogger("meshwright")


def fragment_of(numels: list[int], fragments: int) -> list[int]:
    """The fragment of each parameter (``numels``: their global element counts, in order): contiguous
    runs of about ``total / fragments`` elements; a parameter goes where the midpoint of its elements
    falls."""
    total = sum(numels)
    out, before = [], 0
    for n in numels:
        out.append(min(fragments - 1, (2 * before + n) * fragments // (2 * total)))
        before += n
    return out


class Fragment(nn.Module):
    """A fragment of the model: the live parameters it holds (shared with the model, not copies),
    under their model names with ``.`` as ``/``; torchft's DiLoCo reads ``named_parameters()``."""

    def __init__(self, named: list[tuple[str, nn.Parameter]]) -> None:
        super().__init__()
        self.params = nn.ParameterDict({name.replace(".", "/"): p for name, p in named})


def split_fragments(model_parts: list[nn.Module], fragments: int) -> list[Fragment]:
    """The model parts' parameters in ``fragments`` :class:`Fragment` s (:func:`fragment_of`)."""
    named = [(f"{i}/{name}", p) for i, part in enumerate(model_parts) for name, p in part.named_parameters()]
    index = fragment_of([p.numel() for _, p in named], fragments)
    groups: list[list[tuple[str, nn.Parameter]]] = [[] for _ in range(fragments)]
    for (name, p), k in zip(named, index):
        groups[k].append((name, p))
    empty = [k for k, g in enumerate(groups) if not g]
    if empty:
        raise ConfigError(
            f"parallelism.fault_tolerance.semi_sync.fragments={fragments}: fragments {empty} of this "
            f"rank's {len(named)} parameters would be empty; use fewer fragments."
        )
    return [Fragment(g) for g in groups]


class ReplicaGroup(Protocol):
    """What the sync needs of trainer/resilience/fault_tolerance.py's ``FaultTolerance`` (which builds
    :class:`SemiSync`; a protocol, so that neither module imports the other)."""

    manager: Manager
    group_id: int

    def sync_quorum(self) -> None: ...
    def after_sync(self) -> None: ...
    def begin_step(self, loader: DataLoader, tokens_seen: int) -> None: ...
    def metrics(self) -> dict[str, object]: ...


class _QuorumThroughFT:
    """The torchft ``Manager`` as DiLoCo sees it, but with each quorum taken by
    ``FaultTolerance._quorum`` (in a helper thread while the main thread keeps its heartbeat, retried
    while a hung peer may still be killed); every other attribute is the manager's."""

    def __init__(self, ft: ReplicaGroup) -> None:
        self._ft = ft

    def start_quorum(self, *args: object, **kwargs: object) -> None:
        self._ft.sync_quorum()

    def __getattr__(self, name: str) -> object:
        return getattr(self._ft.manager, name)


class SemiSync:
    """torchft's DiLoCo over this rank's model parts: built once the inner optimizer exists; its state
    (weights of the last sync, outer optimizers, sync count) is :class:`SemiSyncState` in checkpoints and
    travels in heals (torchft registers it with the manager)."""

    def __init__(
        self,
        ft: ReplicaGroup,
        cfg: SemiSyncConfig,
        model_parts: list[nn.Module],
        inner_optimizer: torch.optim.Optimizer,
        device: torch.device,
    ) -> None:
        from torchft.local_sgd import DiLoCo

        from trainer.optim import build_optimizer
        from trainer.optim.config import OptimizerConfig

        self.ft, self.cfg = ft, cfg
        self.fragments = split_fragments(model_parts, cfg.fragments)
        o = cfg.outer_optimizer
        outer_cfg = OptimizerConfig(
            name=o.name, lr=o.lr, momentum=o.momentum, nesterov=o.nesterov, weight_decay=0.0
        )
        self.outer = [
            build_optimizer(fragment, outer_cfg, device_type=device.type) for fragment in self.fragments
        ]
        self.inner_optimizer = inner_optimizer
        self.period = cfg.sync_every // cfg.fragments  # inner steps between two fragment syncs
        self.diloco: DiLoCo = DiLoCo(
            _QuorumThroughFT(ft),  # the manager, with its quorum through ft
            list(self.fragments),
            inner_optimizer,
            list(self.outer),
            cfg.sync_every,
            should_quantize=cfg.quantize,
            fragment_sync_delay=cfg.fragment_sync_delay,
            fragment_update_alpha=cfg.fragment_update_alpha,
        )
        self.syncs = 0  # committed syncs of a fragment (= the manager's step)
        self.failed_syncs = 0
        self.last_sync_bytes = 0  # this rank's pseudo-gradient bytes sent at the last sync
        self.last_outer_s = 0.0  # seconds of the last sync (quorum + exchange + outer step)

    def resume(self, step: int) -> None:
        """Place torchft's counters at inner step ``step`` (a fresh run: 0; a resumed checkpoint: its step;
        the sync count comes from :class:`SemiSyncState`)."""
        self.diloco._local_step = step % self.period  # torchft 0.2.0: inner steps since the last sync
        self.ft.manager.load_state_dict({"step": self.syncs, "batches_committed": 0})

    def fragment_bytes(self, index: int) -> int:
        """Bytes of this rank's pseudo-gradient of fragment ``index`` (its local shards)."""
        return sum(
            (p.to_local() if isinstance(p, DTensor) else p).numel() * p.element_size()
            for p in self.fragments[index].parameters()
        )

    def begin_step(self, state: StepState) -> None:
        """This group's share of the step's samples (no quorum between syncs)."""
        self.ft.begin_step(state.loader, state.tokens_seen)

    def before_optimizer_step(self, state: StepState) -> None:
        self.diloco._step_pre_hook(self.inner_optimizer, (), {})  # torchft: no heal reads the weights now

    def after_optimizer_step(self, state: StepState) -> None:
        """torchft's schedule after each inner step (counts it; at a sync point: quorum, exchange, outer
        step); a sync that fails leaves the fragment at the weights of the last sync."""
        import time

        due = self.diloco._local_step + 1 == self.period
        fragment = self.ft.manager.current_step() % len(self.fragments)
        start = time.perf_counter()
        self.diloco._step_post_hook(self.inner_optimizer, (), {})
        if not due:
            return
        self.last_outer_s = time.perf_counter() - start
        self.last_sync_bytes = self.fragment_bytes(fragment)
        if self.ft.manager.current_step() > self.syncs:
            self.syncs = self.ft.manager.current_step()
        else:
            self.failed_syncs += 1
            logger.warning(
                f"replica group {self.ft.group_id}: sync of fragment {fragment} at step {state.step} failed "
                f"({self.ft.manager.errored()}); the fragment is back at the weights of the last sync"
            )
        self.ft.after_sync()

    def metrics(self, state: StepState, device: torch.device) -> dict[str, object]:
        """``ft/*`` entries: the fault-tolerance ones plus syncs, failed syncs, bytes and time of the last."""
        out = self.ft.metrics()
        out.update(
            {
                "ft/syncs": self.syncs,
                "ft/failed_syncs": self.failed_syncs,
                "ft/sync_bytes": self.last_sync_bytes,
                "ft/outer_s": self.last_outer_s,
            }
        )
        return out


class SemiSyncState:
    """DCP Stateful of :class:`SemiSync`: per fragment, its weights at the last sync (as DTensors shaped
    like the live parameters under FSDP/TP, so each rank saves its own shard) and its outer optimizer;
    and the sync count."""

    def __init__(self, semi: SemiSync) -> None:
        from trainer.checkpoint.checkpointer import OptimizerState

        self.semi = semi
        self.outer = [OptimizerState([f], o) for f, o in zip(semi.fragments, semi.outer)]

    def _synced(self, index: int) -> dict[str, torch.Tensor]:
        fragment = self.semi.diloco._fragments[index]
        out: dict[str, torch.Tensor] = {}
        for name, p in self.semi.fragments[index].named_parameters():
            saved = fragment.original_parameters[name]
            if isinstance(p, DTensor):
                out[name] = DTensor.from_local(
                    saved, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride()
                )
            else:
                out[name] = saved
        return out

    def state_dict(self) -> dict[str, object]:
        return {
            "syncs": self.semi.syncs,
            "fragments": [
                {"synced": self._synced(k), "outer": state.state_dict()} for k, state in enumerate(self.outer)
            ],
        }

    def load_state_dict(self, state_dict: dict[str, object]) -> None:
        syncs, fragments = state_dict["syncs"], state_dict["fragments"]
        assert isinstance(syncs, int) and isinstance(fragments, list)  # what state_dict() wrote
        self.semi.syncs = syncs
        for k, (entry, state) in enumerate(zip(fragments, self.outer)):
            saved = self.semi.diloco._fragments[k].original_parameters
            for name, value in entry["synced"].items():
                saved[name].copy_(value.to_local() if isinstance(value, DTensor) else value)
            state.load_state_dict(entry["outer"])


def check_quantize(cfg: SemiSyncConfig, device_type: Optional[str]) -> None:
    """``quantize=true`` needs CUDA and Triton (torchft ignores it silently otherwise): refused by name."""
    if not cfg.quantize:
        return
    if device_type != "cuda":
        raise ConfigError(
            "parallelism.fault_tolerance.semi_sync.quantize=true quantizes the pseudo-gradients with "
            f"torchft's Triton kernels, which run on CUDA only (this run's device: {device_type}). Set "
            "semi_sync.quantize=false."
        )
    try:
        import triton  # noqa: F401
    except ImportError as e:
        raise ConfigError(
            f"parallelism.fault_tolerance.semi_sync.quantize=true needs Triton ({e}); install triton or "
            "set semi_sync.quantize=false."
        ) from e
