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
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from models.errors import ConfigError

if TYPE_CHECKING:
    from torch.distributed.distributed_c10d import Work
    from torchft import Manager
    from torchft.local_sgd import DiLoCo

    from parallelisms.config import SemiSyncConfig
    from trainer.data.loader import DataLoader
    from trainer.step import StepState

logger = logging.getLogger("meshwright")

# Test-only: "<group>": rank 0 of that group SIGKILLs itself inside its first sync once the test has
# created <group folder>/test_kill_in_sync_arm (after the quorum, before the exchange; once per run
# folder). Never set it in runs.
# Each group's log of its syncs (trainer/resilience/semi_sync.py SemiSync._log_sync), in its folder.
SYNC_LOG = "syncs.jsonl"
KILL_IN_SYNC_ENV = "MESHWRIGHT_TEST_FT_KILL_IN_SYNC"


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
    num_groups: int
    batch_size: int
    seq_len: int
    join_timeout_s: float
    attempt: int
    rank: int
    folder: str

    def sync_quorum(self) -> bool: ...
    def after_sync(self) -> None: ...
    def begin_step(self, loader: DataLoader, tokens_seen: int) -> None: ...
    def metrics(self) -> dict[str, object]: ...
    def trainer_state(self) -> TrainerView: ...


class TrainerView(Protocol):
    """The trainer's counters and schedule a joining group aligns with its peers'."""

    @property
    def step(self) -> int: ...
    @property
    def tokens_seen(self) -> int: ...
    def set_progress(self, step: int, tokens_seen: int) -> None: ...


class _QuorumThroughFT:
    """The torchft ``Manager`` as DiLoCo sees it, with its quorum taken by :meth:`SemiSync.quorum` (through
    ``FaultTolerance._quorum``: in a helper thread while the main thread keeps its heartbeat, retried while
    a hung peer may still be killed) and this group's vote in ``should_commit``; every other attribute is
    the manager's."""

    def __init__(self, semi: SemiSync) -> None:
        self._semi = semi

    def start_quorum(self, *args: object, **kwargs: object) -> None:
        self._semi.quorum()

    def should_commit(self, *args: object, **kwargs: object) -> bool:
        return self._semi.should_commit()

    def allreduce(
        self,
        tensor: torch.Tensor,
        should_quantize: bool = False,
        reduce_op: dist.ReduceOp.RedOpType = dist.ReduceOp.AVG,
    ) -> Work:
        """``Manager.allreduce``, its bytes counted (:meth:`SemiSync.count`)."""
        self._semi.count(tensor)
        return self._semi.ft.manager.allreduce(tensor, should_quantize=should_quantize, reduce_op=reduce_op)

    def __getattr__(self, name: str) -> object:
        return getattr(self._semi.ft.manager, name)


class SemiSync:
    """torchft's DiLoCo over this rank's model parts, run as a step hook: built once the inner optimizer
    exists; its state (weights of the last sync, outer optimizers, sync count, the window's data slots) is
    :class:`SemiSyncState` in checkpoints and travels in heals (registered with the manager).

    Data rule (``fragment_sync_delay=0``): the inner steps between two syncs form a *window*, trained by
    the ``n`` groups of the quorum that opened it (the last sync's; at the start, every group); at each
    step the window's groups read ``n*b`` samples from the data position, the group of quorum rank ``r``
    the ``r``-th ``b`` of them. A sync commits only if every group that opened its window takes part
    (each votes in ``should_commit``); then the window's samples count and the position is where the
    window ended. Otherwise torchft drops the window (the fragment goes back to the weights of the last
    sync) and the data position goes back to the window's start: its samples are trained again, by the
    groups of the failed sync's quorum. So each sample is in exactly one committed window.

    A restarted group (``$MESHWRIGHT_FT_ATTEMPT > 0``, set by the supervisor) does not train until it
    has joined the live groups at their next sync: it asks for quorums (as if at sync count 0, so that
    any live group that has synced is ahead and it heals from it: weights, inner and outer optimizer
    state, weights of the last sync, step, data position), takes part in that sync's exchange, and trains
    the next window with them. When every group is restarting (all were lost), none is ahead: each
    resumes from its own checkpoint."""

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
        self.device = device
        self.period = cfg.sync_every // cfg.fragments  # inner steps between two fragment syncs
        self.diloco: DiLoCo = DiLoCo(
            _QuorumThroughFT(self),  # the manager, with its quorum and vote through us
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
        self.last_sync_bytes = 0  # bytes this rank all-reduced with the other groups at the last sync
        self._sync_bytes = 0
        self.total_bytes = 0  # ... at every sync of this process
        self.last_outer_s = 0.0  # seconds of the last sync (quorum + exchange + outer step)
        # the window: groups that opened it, this group's slot, the data position (samples) at its start
        self.window_groups, self.slot, self.window_start = ft.num_groups, ft.group_id, 0
        self.step_groups = ft.num_groups  # window_groups of the step being trained (its token count)
        self.opener = True  # this process took part in opening the current window
        self.joining = ft.attempt > 0  # a restarted process: it joins the live groups at their next sync
        self._vote_no: Optional[str] = None
        self._healed = False
        self.local_step = 0  # inner steps since the last sync, as a checkpoint holds it (resume)
        self.data_position = 0  # samples: the data position at the start of the step
        self._rewind_to: Optional[int] = None  # samples: a failed sync's window start, applied next step
        self._status = torch.zeros(4, dtype=torch.float64)  # openers, joiners, openers' step and position
        ft.manager.register_state_dict_fn("meshwright_semi_sync", self._load_window, self._window)

    # -- heal payload: the window ------------------------------------------------------
    def _window(self) -> dict[str, int]:
        return {"groups": self.window_groups, "start": self.window_start, "syncs": self.syncs}

    def _load_window(self, sd: dict[str, int]) -> None:
        self.window_groups, self.window_start, self.syncs = sd["groups"], sd["start"], sd["syncs"]
        self.step_groups = self.window_groups

    def resume(self) -> None:
        """Place torchft's counters (a fresh run: 0; a resumed checkpoint: the inner steps since its last
        sync and the sync count, from :class:`SemiSyncState`). A restarted group asks as if at sync 0, so
        that a live group that has synced is ahead of it."""
        self.diloco._local_step = self.local_step  # torchft 0.2.0: inner steps since the last sync
        self.ft.manager.load_state_dict({"step": 0 if self.joining else self.syncs, "batches_committed": 0})

    # -- the sync ----------------------------------------------------------------------
    def count(self, tensor: torch.Tensor) -> None:
        """Bytes this rank hands to torchft for the other groups (an all-reduce's payload) at the current
        sync (the communication ledger, ``metrics.comm_ledger``, sees the same all-reduces over
        ``replica_groups``)."""
        nbytes = tensor.numel() * tensor.element_size()
        self._sync_bytes += nbytes
        self.total_bytes += nbytes

    def quorum(self) -> None:
        """The sync's quorum (a lagging group heals in it), then one small all-reduce over its members:
        how many opened the window, how many are joining, and the openers' step and position (for a
        joiner that did not heal). A sync that misses an opener is voted down (:meth:`should_commit`)."""
        self._healed = self.ft.sync_quorum()
        trainer = self.ft.trainer_state()
        opener = 1.0 if self.opener and not self.joining else 0.0
        self._status.copy_(
            torch.tensor([opener, float(self.joining), opener * trainer.step, opener * trainer.tokens_seen])
        )
        status = self._status.to(self.device)
        self._sync_bytes = 0
        self.count(status)
        self.ft.manager.allreduce(status, reduce_op=dist.ReduceOp.SUM).wait()
        self._status.copy_(status.cpu())
        present = int(self._status[0].item())
        self._vote_no = None
        if self.opener and not self.joining and present < self.window_groups:
            self._vote_no = (
                f"{self.window_groups - present} of the {self.window_groups} groups that opened this window "
                "are missing: the window is dropped and its samples trained again"
            )
        if not self.joining:
            _test_kill_in_sync(self.ft)

    def should_commit(self) -> bool:
        if self._vote_no is not None:
            self.ft.manager.report_error(RuntimeError(self._vote_no))
        return bool(self.ft.manager.should_commit())

    def _after_sync(self, fragment: int, step: int, start: float) -> None:
        """Count the sync (committed or not), set the next window, and note a failed window's rewind."""
        import time

        self.last_outer_s = time.perf_counter() - start
        self.last_sync_bytes = self._sync_bytes
        committed = self.ft.manager.current_step() > self.syncs
        self._log_sync(
            {
                "step": step,
                "sync": self.syncs,
                "fragment": fragment,
                "window_start": self.window_start,
                "window_groups": self.window_groups,
                "committed": committed,
                "participants": int(self.ft.manager.num_participants()),
                "bytes": self._sync_bytes,
                "seconds": round(self.last_outer_s, 6),
            }
        )
        if committed:
            self.syncs = self.ft.manager.current_step()
            self.window_start += self.period * self.window_groups * self.ft.batch_size
        else:
            self.failed_syncs += 1
            self._rewind_to = self.window_start
            logger.warning(
                f"replica group {self.ft.group_id}: sync of fragment {fragment} at step {step} failed "
                f"({self.ft.manager.errored()}); the fragment is back at the weights of the last sync and "
                f"the data position back at {self.window_start} samples"
            )
        self.window_groups = max(int(self.ft.manager.num_participants()), 1)
        rank = self.ft.manager.participating_rank()
        self.slot = 0 if rank is None else int(rank)
        self.opener = True
        self.ft.after_sync()

    def _log_sync(self, record: dict[str, object]) -> None:
        """One line of ``<group folder>/syncs.jsonl`` (rank 0; appended, kept across restarts): each
        sync's window (its data start and groups), whether it committed, its bytes and seconds."""
        import json
        import os

        if self.ft.rank != 0:
            return
        path = os.path.join(self.ft.folder, SYNC_LOG)
        try:
            with open(path, "a", encoding="utf-8") as f:
                f.write(json.dumps(record) + "\n")
        except OSError as e:  # a full disk must not stop training
            logger.warning(f"{path}: {e}")

    def _join(self) -> None:
        """A restarted group: quorums until it meets live groups at their sync (healing from them), then
        that sync's exchange and the rest of the peers' sync step; alone or among restarting groups
        only, it resumes from its own state."""
        import time

        deadline = time.monotonic() + self.ft.join_timeout_s
        while True:
            self.quorum()
            openers, joiners = int(self._status[0].item()), int(self._status[1].item())
            if openers > 0:
                break  # live groups at their sync: take part in it
            if joiners == self.ft.num_groups or time.monotonic() > deadline:
                self.joining = False  # every group restarted (or none is left): resume from our state
                self.ft.manager.load_state_dict({"step": self.syncs, "batches_committed": 0})
                logger.info(f"replica group {self.ft.group_id}: no live group to join; resuming on its own")
                return
            time.sleep(0.2)
        trainer = self.ft.trainer_state()
        if not self._healed:  # the peers had not synced yet: take their counters
            trainer.set_progress(
                int(self._status[2].item()) // openers, int(self._status[3].item()) // openers
            )
        # the peers' sync step: its sync (this group's pseudo-gradient is the healed copy of a peer's),
        # then the step's counters as the peers' trainers advance them
        self.joining, self.opener = False, False
        self.step_groups = self.window_groups
        fragment = self.ft.manager.current_step() % len(self.fragments)
        start = time.perf_counter()
        self.diloco._fragments[fragment].prepare_sync()
        delay = self.cfg.fragment_sync_delay
        if delay == 0:
            self.diloco._fragments[fragment].perform_sync()
            self.diloco._local_step = 0
        else:  # the peers apply the exchange `delay` inner steps later: torchft's schedule does it here too
            self.diloco._local_step = self.period - delay
        trainer.set_progress(
            trainer.step + 1, trainer.tokens_seen + self.step_groups * self.ft.batch_size * self.ft.seq_len
        )
        if delay == 0:
            self._after_sync(fragment, trainer.step, start)
        logger.info(f"replica group {self.ft.group_id}: joined the live groups at step {trainer.step}")

    # -- step hook points --------------------------------------------------------------
    def begin_step(self, state: StepState) -> None:
        """A restarted group joins first; a failed sync's rewind; then this group's slot of the step's
        samples (no quorum between syncs)."""
        self.ft.begin_step(state.loader, state.tokens_seen)
        trainer = self.ft.trainer_state()
        if self.joining:
            self._join()
        if self._rewind_to is not None:
            trainer.set_progress(trainer.step, self._rewind_to * self.ft.seq_len)
            self._rewind_to = None
        position = trainer.tokens_seen // self.ft.seq_len
        if self.diloco._local_step == 0:
            self.window_start = position
        self.step_groups = self.window_groups
        b = self.ft.batch_size
        state.loader.seek(position + self.slot * b, stride=self.window_groups * b)
        self.data_position = position

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
        if due:
            self._after_sync(fragment, state.step, start)

    @property
    def step_tokens(self) -> int:
        """Tokens of the step just trained by the window's groups (the data position's advance)."""
        return self.step_groups * self.ft.batch_size * self.ft.seq_len

    def outer_digest(self) -> str:
        """SHA-256 of the weights of the last sync and the outer optimizers' state (equal in every group)."""
        import hashlib

        digest = hashlib.sha256()
        for k, fragment in enumerate(self.diloco._fragments):
            for name in sorted(fragment.original_parameters):
                digest.update(
                    fragment.original_parameters[name].contiguous().view(torch.uint8).numpy().tobytes()
                )
            for entry in self.outer[k].state.values():
                for _, v in sorted(entry.items()):
                    if isinstance(v, torch.Tensor):
                        local = v.to_local() if isinstance(v, DTensor) else v
                        digest.update(local.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
        return digest.hexdigest()[:16]

    def metrics(self, state: StepState, device: torch.device) -> dict[str, object]:
        """``ft/*`` entries: the fault-tolerance ones plus the syncs, the window and the outer state."""
        out = self.ft.metrics()
        out.update(
            {
                "ft/syncs": self.syncs,
                "ft/failed_syncs": self.failed_syncs,
                "ft/sync_bytes": self.last_sync_bytes,
                "ft/outer_s": self.last_outer_s,
                "ft/outer_sha": self.outer_digest(),
                "ft/cross_group_bytes": self.total_bytes,
                "ft/data_position": self.data_position,
                "ft/window": [self.window_start, self.window_groups, self.slot],
            }
        )
        return out


class SkippedStepCounter:
    """A step hook after spike skipping's (``training.spike``): a step it skipped takes no optimizer step
    but counts as an inner step of torchft's schedule (a sync included when it is due), so every group
    reaches its syncs after as many steps, whichever skipped."""

    def __init__(self, semi: SemiSync) -> None:
        self.semi = semi

    def after_clip(self, state: StepState) -> None:
        if state.skipped is not None:
            self.semi.after_optimizer_step(state)


class SemiSyncState:
    """DCP Stateful of :class:`SemiSync`: per fragment, its weights at the last sync (as DTensors shaped
    like the live parameters under FSDP/TP, so each rank saves its own shard) and its outer optimizer;
    and the sync count."""

    def __init__(self, semi: SemiSync) -> None:
        from trainer.checkpoint.contents import OptimizerState

        self.semi = semi
        self.outer = [OptimizerState([f], o) for f, o in zip(semi.fragments, semi.outer)]

    def _synced(self, index: int) -> dict[str, torch.Tensor]:
        fragment = self.semi.diloco._fragments[index]
        out: dict[str, torch.Tensor] = {}
        for name, p in self.semi.fragments[index].named_parameters():
            saved = fragment.original_parameters[name]
            if isinstance(p, DTensor):
                out[name] = DTensor.from_local(
                    saved.to(p.to_local().device),  # DCP saves a DTensor from its mesh's device
                    p.device_mesh,
                    p.placements,
                    run_check=False,
                    shape=p.shape,
                    stride=p.stride(),
                )
            else:
                out[name] = saved
        return out

    def state_dict(self) -> dict[str, object]:
        semi = self.semi
        return {
            "syncs": semi.syncs,
            "window": [
                semi.window_groups,
                semi.slot,
                semi.window_start,
                semi.failed_syncs,
                semi.diloco._local_step,
            ],
            "fragments": [
                {"synced": self._synced(k), "outer": state.state_dict()} for k, state in enumerate(self.outer)
            ],
        }

    def load_state_dict(self, state_dict: dict[str, object]) -> None:
        syncs, window, fragments = state_dict["syncs"], state_dict["window"], state_dict["fragments"]
        assert isinstance(syncs, int) and isinstance(window, list) and isinstance(fragments, list)
        self.semi.syncs = syncs
        semi = self.semi
        semi.window_groups, semi.slot, semi.window_start, semi.failed_syncs, semi.local_step = window
        self.semi.step_groups = self.semi.window_groups
        for k, (entry, state) in enumerate(zip(fragments, self.outer)):
            saved = self.semi.diloco._fragments[k].original_parameters
            for name, value in entry["synced"].items():
                saved[name].copy_(value.to_local() if isinstance(value, DTensor) else value)
            state.load_state_dict(entry["outer"])


def _test_kill_in_sync(ft: ReplicaGroup) -> None:
    """``$MESHWRIGHT_TEST_FT_KILL_IN_SYNC=<group>`` (tests only): rank 0 of that group SIGKILLs itself in its
    first sync after ``<group folder>/test_kill_in_sync_arm`` exists, after the quorum and before the
    exchange (once per run folder)."""
    import os
    import signal

    spec = os.environ.get(KILL_IN_SYNC_ENV, "")
    if not spec or int(spec) != ft.group_id or ft.rank != 0:
        return
    done, arm = (
        os.path.join(ft.folder, name) for name in ("test_kill_in_sync_done", "test_kill_in_sync_arm")
    )
    if os.path.exists(done) or not os.path.exists(arm):
        return
    open(done, "w").close()
    logger.warning(
        f"{KILL_IN_SYNC_ENV}={spec}: replica group {ft.group_id} kills itself in a sync (test hook)"
    )
    os.kill(os.getpid(), signal.SIGKILL)


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
