"""Fault-tolerant data parallelism (torchft): the trainer's side.

``parallelism.fault_tolerance.enable=true`` turns every ``dp_replicate`` index into a *replica
group*: its own torchrun (own world, process group and mesh, any layout inside), started by the
launchers (``FT_GROUPS=N ./launch.sh``, ``FT=1 sbatch slurm/train.sbatch``; both run
``trainer/resilience/supervisor.py``). The groups meet only through torchft: a lighthouse and one
``Manager`` per rank. Every step:

1. ``begin_step``: a *synchronous* quorum (``use_async_quorum=False``: torchft's asynchronous quorum
   reads ``state_dict`` from its own thread, which races FSDP's backward). A group that is behind
   (restarted, or new) heals here, before its forward pass, from a live peer over HTTP: model,
   optimizer, LR schedule, step, tokens seen (= the data position) and RNG; the transfer is
   authenticated with the job's secret and loaded weights-only, and a quorum member outside the
   job is refused (trainer/resilience/trust.py).
2. Data: the position is the number of samples *committed* so far, ``tokens_seen / seq_len``. A
   step with ``n`` participating groups trains samples ``[pos, pos + n*b)``; the participant of
   quorum rank ``r`` reads ``[pos + r*b, pos + (r+1)*b)`` (``b`` = global batch / dp_replicate, split
   over the group's dp ranks as usual). A discarded step does not move ``pos``, so its samples are
   retried: no sample is trained twice or skipped, whatever groups come and go; only the step at
   which a sample is trained depends on the failures.
3. Loss: normalised by the target tokens of all participants (one cross-group SUM), gradients
   averaged over the participants (parallelisms/fault_tolerance.py).
4. ``should_commit``: every rank of every surviving group agrees whether the step completed; if a
   peer failed during it, the step is discarded (gradients dropped, step not counted) and retried
   with the next quorum.

``semi_sync.method=diloco|streaming_diloco`` (trainer/resilience/semi_sync.py) replaces 1-4 between syncs:
no quorum, no cross-group collective; each group trains its own share of the data and writes its own
checkpoints; the groups meet at the syncs only.

DCP checkpoints are written by the group of quorum rank 0 only (DCP is collective inside a
group); when every group is lost, the launchers restart them all and they resume from the newest
checkpoint exactly as a plain run does (the torchft step comes from ``train_state.step``).

Supervision: the main thread touches ``<dump>/replica_group_<g>/heartbeat/rank<R>`` every step;
the launcher's supervisor kills a group whose heartbeat stalls (a hung or SIGSTOPped rank) and
restarts it, like a crashed one, with a fresh torchrun (new rendezvous store and port).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import signal
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Optional

import torch
from torch.distributed.tensor import DTensor

from models.errors import ConfigError
from parallelisms.config import ParallelismConfig
from parallelisms.fault_tolerance import ManagedReducer, allreduce_gradients

if TYPE_CHECKING:
    from torchft import Manager
    from torchft._torchft import ManagerServer
    from torchft.process_group import ProcessGroup

    from trainer.config import TrainConfig
    from trainer.resilience.semi_sync import SemiSync
    from trainer.step import StepState

logger = logging.getLogger("meshwright")

LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"
HEARTBEAT_DIR = "heartbeat"
# Test-only: seconds every step sleeps (a tiny model's step is ~50 ms; the failure tests need the
# survivors still training while a killed group restarts, as a real model's steps would). Never set it in
# runs.
STEP_DELAY_ENV = "MESHWRIGHT_TEST_FT_STEP_DELAY_S"
# Test-only: "<group>@<step>": rank 0 of that replica group SIGKILLs itself at the end of the forward
# pass of its first step >= <step> (once per run folder), so the other groups are inside that step's
# gradient all-reduce when it disappears.
KILL_ENV = "MESHWRIGHT_TEST_FT_KILL_AT"
# Set by the launchers' supervisor: this group process's incarnation (0: the job's first; > 0: a restart,
# which under semi_sync joins the live groups at their next sync, trainer/resilience/semi_sync.py).
ATTEMPT_ENV = "MESHWRIGHT_FT_ATTEMPT"


def group_folder(dump_folder: str, group_id: int) -> str:
    """Where a replica group writes its config.yaml, metrics.jsonl, tb/ and heartbeats."""
    return os.path.join(dump_folder, f"replica_group_{group_id}")


def group_parallelism(p: ParallelismConfig) -> ParallelismConfig:
    """The layout inside one replica group: ``dp_replicate`` is the number of groups, so 1 inside."""
    if not p.fault_tolerance.enable:
        return p
    return dataclasses.replace(p, dp_replicate=1)


def group_batch_size(p: ParallelismConfig, global_batch_size: int) -> int:
    """Sequences one replica group trains per step (the whole global batch without fault tolerance)."""
    return global_batch_size // p.dp_replicate if p.fault_tolerance.enable else global_batch_size


def _lighthouse(address: Optional[str]) -> str:
    address = address or os.environ.get(LIGHTHOUSE_ENV)
    if not address:
        raise ConfigError(
            "parallelism.fault_tolerance.enable=true needs the lighthouse address: set "
            "parallelism.fault_tolerance.lighthouse=http://host:port or $TORCHFT_LIGHTHOUSE (the launchers "
            "start torchft_lighthouse and set it)."
        )
    return address


def check_environment(cfg: TrainConfig) -> None:
    """What needs the environment (before any process group): the lighthouse address and torchft."""
    ft = cfg.parallelism.fault_tolerance
    if not ft.enable:
        return
    _lighthouse(ft.lighthouse)
    try:
        import torchft  # noqa: F401
    except ImportError as e:
        raise ConfigError(
            f"parallelism.fault_tolerance.enable=true needs torchft ({e}); pip install 'meshwright[ft]'."
        ) from e
    from trainer.resilience.trust import read_secret

    read_secret()
    from trainer.resilience.semi_sync import check_quantize

    device = cfg.training.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    check_quantize(ft.semi_sync, device)


@contextlib.contextmanager
def _manager_server_bound_to(host: str) -> Iterator[None]:
    """torchft 0.2.0's ``Manager`` starts its gRPC ``ManagerServer`` on ``[::]:<port>`` (every interface),
    with no way to say otherwise: while the Manager is built, its module's ``ManagerServer`` is a
    wrapper that binds ``host`` instead (the same port; restored on exit; main thread, before any
    other torchft call of this process)."""
    import torchft.manager as torchft_manager

    original = torchft_manager.ManagerServer

    def bound(
        *,
        replica_id: str,
        lighthouse_addr: str,
        hostname: str,
        bind: str,
        store_addr: str,
        world_size: int,
        heartbeat_interval: timedelta,
        connect_timeout: timedelta,
        quorum_retries: int,
    ) -> ManagerServer:
        port = bind.rsplit(":", 1)[1]
        return original(
            replica_id=replica_id,
            lighthouse_addr=lighthouse_addr,
            hostname=hostname,
            bind=f"{'[' + host + ']' if ':' in host else host}:{port}",
            store_addr=store_addr,
            world_size=world_size,
            heartbeat_interval=heartbeat_interval,
            connect_timeout=connect_timeout,
            quorum_retries=quorum_retries,
        )

    torchft_manager.ManagerServer = bound
    try:
        yield
    finally:
        torchft_manager.ManagerServer = original


def make_manager(
    *,
    pg: ProcessGroup,
    group_id: int,
    num_groups: int,
    secret: bytes,
    timeout: timedelta,
    quorum_timeout: timedelta,
    connect_timeout: timedelta,
    heartbeat_interval: timedelta,
    min_replica_size: int,
    rank: int,
    world_size: int,
    lighthouse_addr: str,
    store_addr: Optional[str] = None,
    store_port: Optional[int] = None,
) -> Manager:
    """torchft's ``Manager`` for one rank of replica group ``group_id`` of ``num_groups``, with the
    trust rules of trainer/resilience/trust.py: heals through :class:`AuthenticatedTransport` (the job's
    secret, the node's announced address, weights-only loading), torchft's manager server on that
    address too, and every quorum checked against the job's groups (:class:`MemberCheckingClient`)."""
    from torchft import Manager

    from trainer.resilience.trust import (
        AuthenticatedTransport,
        MemberCheckingClient,
        announced_address,
        replica_id,
    )

    host = announced_address()
    transport = AuthenticatedTransport(
        secret=secret, group_id=group_id, num_groups=num_groups, timeout=timeout, address=host
    )
    with _manager_server_bound_to(host):
        manager = Manager(
            pg=pg,
            load_state_dict=None,
            state_dict=None,
            use_async_quorum=False,
            timeout=timeout,
            replica_id=replica_id(group_id),
            hostname=host,
            init_sync=False,
            checkpoint_transport=transport,
            quorum_timeout=quorum_timeout,
            connect_timeout=connect_timeout,
            heartbeat_interval=heartbeat_interval,
            min_replica_size=min_replica_size,
            rank=rank,
            world_size=world_size,
            lighthouse_addr=lighthouse_addr,
            store_addr=store_addr,
            store_port=store_port,
        )
    # torchft 0.2.0 asks its group's manager server for each quorum through this (private) client.
    manager._client = MemberCheckingClient(manager._client, num_groups, group_id)
    logger.info(
        f"replica group {group_id}: heal server {transport.metadata()} (HMAC under the job's secret), "
        f"torchft manager server on {host}"
    )
    return manager


def _tree_local(value: Any) -> Any:
    """DTensors -> their local tensors (the payload crosses processes; a mesh does not pickle)."""
    if isinstance(value, DTensor):
        return value.to_local()
    if isinstance(value, dict):
        return {k: _tree_local(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_tree_local(v) for v in value)
    return value


class FaultTolerance:
    """One rank's torchft ``Manager`` plus what the trainer asks of it each step."""

    def __init__(
        self, cfg: TrainConfig, *, rank: int, world_size: int, device: torch.device, dump_folder: str
    ) -> None:
        from torchft.process_group import ProcessGroupGloo, ProcessGroupNCCL

        from trainer.resilience import trust

        ft = cfg.parallelism.fault_tolerance
        self.cfg = ft
        self.group_id = ft.replica_group_id
        self.rank = rank
        self.seq_len = cfg.training.seq_len
        self.batch_size = group_batch_size(cfg.parallelism, cfg.training.global_batch_size)
        timeout = timedelta(seconds=ft.timeout_s)
        pg = ProcessGroupNCCL(timeout=timeout) if device.type == "cuda" else ProcessGroupGloo(timeout=timeout)
        store_addr: Optional[str] = None  # torchrun's store (MASTER_ADDR/MASTER_PORT)
        store_port: Optional[int] = None
        if "MASTER_ADDR" not in os.environ:  # plain `python trainer/main.py`: a store of our own
            from torch.distributed import TCPStore

            self._store = TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
            store_addr, store_port = "localhost", self._store.port
        self.manager = make_manager(
            pg=pg,
            group_id=self.group_id,
            num_groups=cfg.parallelism.dp_replicate,
            secret=trust.read_secret(),
            min_replica_size=ft.min_replicas,
            timeout=timeout,
            quorum_timeout=timedelta(seconds=ft.quorum_timeout_s),
            connect_timeout=timedelta(seconds=max(ft.timeout_s, 30.0)),
            rank=rank,
            world_size=world_size,
            lighthouse_addr=_lighthouse(ft.lighthouse),
            heartbeat_interval=timedelta(milliseconds=ft.heartbeat_ms),
            store_addr=store_addr,
            store_port=store_port,
        )
        self.reducer = ManagedReducer(self.manager)
        self.semi_sync_cfg = ft.semi_sync if ft.semi_sync.method != "none" else None
        self.semi: Optional[SemiSync] = None  # built once the optimizer exists (build_semi_sync)
        self.folder = group_folder(dump_folder, self.group_id)
        self._beat = os.path.join(self.folder, HEARTBEAT_DIR, f"rank{rank}")
        os.makedirs(os.path.dirname(self._beat), mode=0o750, exist_ok=True)
        self.beat("setup")
        self._parts: list[torch.nn.Module] = []
        self._trainer: Any = None
        self.num_participants = 1
        self.participating_rank = 0
        self.discarded_steps = 0
        self.data_position = 0  # samples committed before the current step (the same in every group)
        self.last_heal_s: Optional[float] = None  # seconds the last heal took (quorum + transfer + load)
        self._healed = False
        self._quorum_s = 0.0
        self._test_delay_s = float(os.environ.get(STEP_DELAY_ENV, "0") or 0)
        self.num_groups = cfg.parallelism.dp_replicate
        self._startup_wait_s = ft.startup_wait_s  # spent once, at this process's first step
        # enough quorum timeouts to outlast a hung peer until the supervisor kills it
        self._quorum_attempts = 2 + int(ft.hang_timeout_s // ft.quorum_timeout_s)
        self.attempt = int(os.environ.get(ATTEMPT_ENV, "0") or 0)  # semi_sync: > 0 joins at the next sync
        # semi_sync: how long a restarted group looks for live groups to join before resuming on its own
        self.join_timeout_s = 2 * ft.hang_timeout_s

    # -- wiring ---------------------------------------------------------------------
    @property
    def replica_reducer(self) -> Optional[ManagedReducer]:
        """The per-step gradient collective over the groups (None under semi_sync: no per-step exchange)."""
        return None if self.semi_sync_cfg is not None else self.reducer

    def build_semi_sync(
        self, model_parts: list[torch.nn.Module], optimizer: torch.optim.Optimizer, device: torch.device
    ) -> Optional[SemiSync]:
        """``semi_sync.method != none``: torchft's DiLoCo over the model parts and the inner optimizer."""
        if self.semi_sync_cfg is None:
            return None
        from trainer.resilience.semi_sync import SemiSync

        self.semi = SemiSync(self, self.semi_sync_cfg, model_parts, optimizer, device)
        return self.semi

    def attach(self, trainer: Any) -> None:
        """Register the healing payload and take the step from a resumed checkpoint."""
        self._trainer = trainer
        self.manager.register_state_dict_fn("meshwright", self._load_state_dict, self._state_dict)
        samples = trainer.state.tokens_seen // self.seq_len
        if self.semi is not None:
            self.semi.resume()
        else:
            self.manager.load_state_dict(
                {"step": trainer.state.step, "batches_committed": samples // self.batch_size}
            )
        kill = os.environ.get(KILL_ENV, "")
        if kill and int(kill.split("@")[0]) == self.group_id and self.rank == 0:
            at = int(kill.split("@")[1])
            done = os.path.join(self.folder, "test_kill_done")

            def die(module: Any, args: Any, output: Any) -> None:
                if trainer.state.step + 1 >= at and module.training and not os.path.exists(done):
                    open(done, "w").close()
                    logger.warning(
                        f"{KILL_ENV}={kill}: replica group {self.group_id} kills itself (test hook)"
                    )
                    os.kill(os.getpid(), signal.SIGKILL)

            trainer.model_parts[0].register_forward_hook(die)

    def _state_dict(self) -> dict[str, Any]:
        t = self._trainer
        rng = {"cpu": torch.get_rng_state()}
        if torch.cuda.is_available():
            rng["cuda"] = torch.cuda.get_rng_state()
        return {
            "model": [_tree_local(part.state_dict()) for part in t.model_parts],
            "optimizer": _tree_local(t.optimizer.state_dict()),
            "lr_scheduler": t.lr_scheduler.state_dict(),
            "train": {"step": t.state.step, "tokens_seen": t.state.tokens_seen},
            "rng": rng,
        }

    def _load_state_dict(self, sd: dict[str, Any]) -> None:
        """Apply a live peer's state (called by torchft from the main thread, inside start_quorum)."""
        t = self._trainer
        with torch.no_grad():
            for part, received in zip(t.model_parts, sd["model"]):
                for name, value in part.state_dict().items():
                    local = value.to_local() if isinstance(value, DTensor) else value
                    local.copy_(received[name])
        t.optimizer.load_state_dict(self._rewrap_optimizer(sd["optimizer"]))
        t.lr_scheduler.load_state_dict(sd["lr_scheduler"])
        t.state.step = int(sd["train"]["step"])
        t.state.tokens_seen = int(sd["train"]["tokens_seen"])
        torch.set_rng_state(sd["rng"]["cpu"])
        if "cuda" in sd["rng"] and torch.cuda.is_available():
            torch.cuda.set_rng_state(sd["rng"]["cuda"])
        self._healed = True

    def _rewrap_optimizer(self, sd: dict[str, Any]) -> dict[str, Any]:
        """The peer's optimizer state (local tensors) as DTensors shaped like this rank's parameters."""
        params = [p for group in self._trainer.optimizer.param_groups for p in group["params"]]
        state = {}
        for index, entry in sd["state"].items():
            p = params[int(index)]
            if isinstance(p, DTensor):
                entry = {
                    k: DTensor.from_local(
                        v, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride()
                    )
                    if isinstance(v, torch.Tensor) and v.shape == p.to_local().shape and v.dim() > 0
                    else v
                    for k, v in entry.items()
                }
            state[index] = entry
        return {**sd, "state": state}

    # -- per step -------------------------------------------------------------------
    def beat(self, phase: str = "step") -> None:
        """Progress mark read by the launcher's supervisor (main thread only: a hung rank stops beating).
        The hang watchdog watches "step" marks only (setup is bounded by comm.init_timeout_s)."""
        tmp = f"{self._beat}.tmp"
        try:
            os.makedirs(os.path.dirname(tmp), mode=0o750, exist_ok=True)
            with open(tmp, "w", encoding="utf-8") as f:
                f.write(f"{time.time()} {phase} {os.getpid()}\n")
            os.replace(tmp, self._beat)
        except OSError as e:  # a full or vanished disk must not stop training; the watchdog will notice
            logger.warning(f"heartbeat {self._beat}: {e}")

    def begin_step(self, loader: Any, tokens_seen: int) -> None:
        """Quorum (healing first if this group is behind), then point the loader at this group's share."""
        self.beat()
        if self._test_delay_s > 0:
            time.sleep(self._test_delay_s)
        if self.semi is not None:  # no quorum between syncs; SemiSync.begin_step places the data
            return
        start = time.perf_counter()
        self._quorum()  # synchronous: heals and applies the state here
        if self._startup_wait_s > 0:  # first step: rather every group than a lone start and heals later
            deadline = time.monotonic() + self._startup_wait_s
            while self.manager.num_participants() < self.num_groups and time.monotonic() < deadline:
                time.sleep(0.5)
                self.beat()
                self._quorum()
            self._startup_wait_s = 0.0
        self._quorum_s = time.perf_counter() - start
        from trainer.resilience.trust import UntrustedPeerError

        error = self.manager.errored()
        refused = getattr(error, "original_exception", None)
        if isinstance(refused, UntrustedPeerError):  # nothing was loaded: stop with the state we had
            raise RuntimeError(f"{refused} (this group stops; its supervisor restarts it)") from refused
        if self._healed:
            self._healed = False
            self.last_heal_s = self._quorum_s
            tokens_seen = self._trainer.state.tokens_seen
            logger.info(
                f"replica group {self.group_id}: healed from a live peer at step {self._trainer.state.step} "
                f"in {self._quorum_s:.2f}s"
            )
        self.num_participants = max(self.manager.num_participants(), 1)
        rank = self.manager.participating_rank()
        self.participating_rank = 0 if rank is None else int(rank)
        committed = tokens_seen // self.seq_len
        self.data_position = committed
        loader.seek(
            committed + self.participating_rank * self.batch_size,
            stride=self.num_participants * self.batch_size,
        )

    def sync_quorum(self) -> bool:
        """The quorum of a semi-synchronous sync (torchft's DiLoCo asks for it); a lagging group heals
        (returns whether it did)."""
        start = time.perf_counter()
        self._quorum()
        self._quorum_s = time.perf_counter() - start
        from trainer.resilience.trust import UntrustedPeerError

        refused = getattr(self.manager.errored(), "original_exception", None)
        if isinstance(refused, UntrustedPeerError):  # nothing was loaded: stop with the state we had
            raise RuntimeError(f"{refused} (this group stops; its supervisor restarts it)") from refused
        if self._healed:
            self._healed = False
            self.last_heal_s = self._quorum_s
            logger.info(
                f"replica group {self.group_id}: healed from a live peer at step {self._trainer.state.step} "
                f"in {self._quorum_s:.2f}s"
            )
            return True
        return False

    def trainer_state(self) -> _TrainerProgress:
        """The trainer's step, data position and LR schedule, as a joining group aligns them."""
        return _TrainerProgress(self)

    def after_sync(self) -> None:
        """The quorum of the sync just taken: its participants and this group's rank in it."""
        self.num_participants = max(self.manager.num_participants(), 1)
        rank = self.manager.participating_rank()
        self.participating_rank = 0 if rank is None else int(rank)

    def _quorum(self) -> None:
        """``Manager.start_quorum`` (synchronous; a heal is applied inside it while this thread only
        waits), run in a helper thread so that the main thread keeps marking its heartbeat: waiting for
        a quorum is not a hang. A quorum that times out is asked again, up to ``quorum_attempts``
        times: a hung peer that still heartbeats blocks the lighthouse (it wants more than half of the
        heartbeating groups) until the supervisor's hang watchdog has killed it."""
        from concurrent.futures import ThreadPoolExecutor

        from trainer.resilience.trust import UntrustedPeerError

        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="meshwright-quorum") as pool:
            for attempt in range(1, self._quorum_attempts + 1):
                future = pool.submit(self.manager.start_quorum)
                while not future.done():
                    try:
                        future.result(timeout=0.5)
                    except Exception:  # still waiting (wait timeout), or failed: decided below
                        pass
                    if not future.done():
                        self.beat()
                error = future.exception()
                if error is None:
                    return
                if attempt == self._quorum_attempts:
                    raise error
                if isinstance(error, UntrustedPeerError):
                    logger.error(str(error))
                logger.warning(
                    f"replica group {self.group_id}: quorum attempt {attempt} failed ({error}); again"
                )
                # torchft keeps the failed quorum's future and re-raises it on the next start_quorum:
                # drop it (a private attribute of torchft 0.2.0's Manager).
                self.manager._quorum_future = None

    def sum_over_groups(self, value: torch.Tensor) -> torch.Tensor:
        """SUM of ``value`` over this step's replica groups (rank r with rank r); local on failure."""
        out = value.detach().clone()
        self.reducer.all_reduce(out).wait()
        return out

    def sync_gradients(self, model: Any, parameters: list[torch.nn.Parameter]) -> None:
        """Average gradients over the groups unless the DDP wrapper already did (in its buckets)."""
        from parallelisms.ddp import BucketedDDP

        if not isinstance(model, BucketedDDP):
            allreduce_gradients(parameters, self.reducer)

    def should_commit(self) -> bool:
        """Whether every participant completed the step (collective within the group); counts discards."""
        if self.manager.should_commit():
            return True
        self.discarded_steps += 1
        logger.warning(
            f"replica group {self.group_id}: step discarded (a replica group failed during it: "
            f"{self.manager.errored()}); retrying with the next quorum"
        )
        return False

    @property
    def step_tokens(self) -> int:
        """Tokens the committed step trained over all participating groups (semi_sync: every group's
        share of the step, the data position's advance)."""
        if self.semi is not None:
            return self.semi.step_tokens
        return self.num_participants * self.batch_size * self.seq_len

    @property
    def writes_checkpoints(self) -> bool:
        """Quorum rank 0's group writes the DCP checkpoints (a collective inside the group); under
        semi_sync every group writes its own (their inner states differ)."""
        return self.semi is not None or self.participating_rank == 0

    @property
    def checkpoint_root(self) -> Optional[str]:
        """Where this group's checkpoints live when it keeps its own (semi_sync): its group folder."""
        return self.folder if self.semi_sync_cfg is not None else None

    def state_digest(self) -> str:
        """SHA-256 of this rank's weights and optimizer state (local shards), to compare replica groups
        bit for bit (equal digests in every group's metrics = identical replicas)."""
        import hashlib

        digest = hashlib.sha256()
        tensors = [v for part in self._trainer.model_parts for v in _tree_local(part.state_dict()).values()]
        for entry in _tree_local(self._trainer.optimizer.state_dict())["state"].values():
            tensors += [v for _, v in sorted(entry.items()) if isinstance(v, torch.Tensor)]
        for t in tensors:
            digest.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
        return digest.hexdigest()[:16]

    def metrics(self) -> dict[str, Any]:
        """``ft/*`` entries of a metrics record."""
        out: dict[str, Any] = {
            "ft/state_sha": self.state_digest(),
            "ft/participants": self.num_participants,
            "ft/data_position": self.data_position,
            "ft/discarded_steps": self.discarded_steps,
            "ft/quorum_s": self._quorum_s,
            "ft/replica_group": self.group_id,
            "ft/cross_group_bytes": self.reducer.sent_bytes,  # payload this rank all-reduced across groups
        }
        if self.last_heal_s is not None:
            out["ft/heal_s"] = self.last_heal_s
            self.last_heal_s = None
        return out

    def close(self) -> None:
        self.beat("done")
        try:
            self.manager.shutdown(wait=False)
        except Exception as e:  # shutting down after a failure: nothing left to save
            logger.warning(f"torchft manager shutdown: {e}")


class _TrainerProgress:
    """The trainer's counters for :class:`trainer.resilience.semi_sync.SemiSync` (a joining group takes its
    peers' step, with the LR schedule at that step, and data position)."""

    def __init__(self, ft: FaultTolerance) -> None:
        self._ft = ft

    @property
    def step(self) -> int:
        return int(self._ft._trainer.state.step)

    @property
    def tokens_seen(self) -> int:
        return int(self._ft._trainer.state.tokens_seen)

    def set_progress(self, step: int, tokens_seen: int) -> None:
        t = self._ft._trainer
        if step != t.state.step:
            t.state.step = step
            t.lr_scheduler.last_epoch = step
            t.lr_scheduler.sync_lr()
        t.state.tokens_seen = tokens_seen


class FaultToleranceHook:
    """:class:`FaultTolerance` at the step's hook points (``trainer/hooks.py``): the quorum before the
    batch, the token count and the gradient mean over the replica groups, and the commit decision."""

    def __init__(self, ft: FaultTolerance, model: Any, parameters: list[torch.nn.Parameter]) -> None:
        self.ft = ft
        self.model = model  # the gradient mean is skipped when the DDP wrapper's buckets did it
        self.parameters = parameters

    def begin_step(self, state: StepState) -> None:
        """Quorum (a lagging group heals here) and this group's data share."""
        self.ft.begin_step(state.loader, state.tokens_seen)

    def count_tokens(self, state: StepState) -> None:
        """The tokens of every replica group in the step; their gradients average over ``replicas``."""
        assert state.num_tokens is not None  # set by the trainer before this point
        state.num_tokens = self.ft.sum_over_groups(state.num_tokens)
        state.replicas = self.ft.num_participants

    def after_backward(self, state: StepState) -> None:
        self.ft.sync_gradients(self.model, self.parameters)

    def after_clip(self, state: StepState) -> None:
        """The loss over the groups; a group that failed in this step: every survivor drops it."""
        assert state.loss_sum is not None
        state.loss_sum = self.ft.sum_over_groups(state.loss_sum)
        if not self.ft.should_commit():
            state.discard = True

    def metrics(self, state: StepState, device: torch.device) -> dict[str, Any]:
        """Participants, discarded steps, heal time, replica digest (``ft/*``)."""
        return self.ft.metrics()
