"""ZeRO-1: replicate parameters and gradients, shard the optimizer state.

Every parameter has exactly one owner rank in the process group. The owner's inner optimizer
(any ``torch.optim.Optimizer`` class whose state is per parameter: AdamW, SGD, ...) holds that
parameter's state and updates it; afterwards each owner's updated values are exchanged by one
collective over a flat, owner-grouped parameter storage, so every rank holds the full,
identical model again. Compared with a replicated AdamW this divides the
optimizer-state memory (two fp32 moments per parameter) by the group size.

The wrapper is a real ``torch.optim.Optimizer``: ``param_groups`` hold *all* parameters with
their hyperparameters (LR schedulers and gradient clipping act on it as usual, and the values
are copied into the inner optimizer before each step), and ``state`` is the inner optimizer's
state, i.e. only the owned parameters. ``state_dict()`` therefore uses the full parameter
indices but contains state only for the indices this rank owns, which is exactly what
``torch.distributed.checkpoint`` expects of a sharded optimizer; ``consolidated_state_dict()``
gathers the complete state into one plain-optimizer dict, and ``load_state_dict`` reshards any
such dict (from any world size) onto the current owners.

It lives here, with the strategies, and not with the optimizers in ``trainer/optim/``: it is the
seed's data-parallel strategy (ZeRO-1 over the ``dp_replicate`` group, beside ``ddp.py``), it wraps
any optimizer the registry builds, and what it needs to know of one comes in as arguments (the inner
optimizer class and ``cost``, e.g. Muon's ``trainer.optim.muon.muon_cost``), so ``parallelisms/``
never imports the trainer.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from models.errors import ConfigError

ASSIGNMENTS = ("balanced", "round_robin")


def assign_owners(sizes: Sequence[int], world_size: int, assignment: str = "balanced") -> list[int]:
    """Owner rank of each parameter, given each parameter's size in bytes, in flat order.

    ``round_robin``: parameter ``i`` goes to ``i % world_size`` (the seed's rule).
    ``balanced``: parameters sorted by size (largest first, ties by index) each go to the
    currently least-loaded rank (ties to the lowest rank), so owners hold about equal bytes.
    Pure and deterministic: every rank computes the same answer without communicating.
    """
    if assignment == "round_robin":
        return [i % world_size for i in range(len(sizes))]
    if assignment != "balanced":
        raise ConfigError(f"assignment must be one of {ASSIGNMENTS}, got {assignment!r}")
    return _balanced_owners(sizes, [0] * world_size)


def _balanced_owners(sizes: Sequence[int], loads: list[int]) -> list[int]:
    """Greedy largest-first assignment onto ranks already holding ``loads`` bytes (updated in place)."""
    owners = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda j: (-sizes[j], j)):
        rank = min(range(len(loads)), key=lambda r: (loads[r], r))
        owners[i] = rank
        loads[rank] += sizes[i]
    return owners


@dataclass
class _FlatShards:
    """All parameters of one (dtype, device), stored in one flat tensor grouped by owner.

    ``segments[r]`` is rank r's (offset, length) in ``storage``; the parameters are views of
    it, so owner r's updated values are exchanged by one collective on its segment, with no
    packing or unpacking copies and no extra buffer.
    """

    storage: torch.Tensor
    segments: list[tuple[int, int]]


def _state_key(key: Any) -> Any:
    """State-dict parameter keys: indices (possibly stringified), or the parameter names that
    ``torch.distributed.checkpoint``'s ``set_optimizer_state_dict`` passes, like torch.optim."""
    return int(key) if isinstance(key, str) and key.isdigit() else key


def _param_of(entry: Any) -> torch.Tensor:
    """Optimizers accept ``(name, param)`` pairs as well as bare parameters."""
    return entry[1] if isinstance(entry, tuple) else entry


class ShardedOptimizer(torch.optim.Optimizer):
    """Optimizer-state sharding (ZeRO-1) over ``process_group`` around ``optimizer_class``.

    Args:
        params: parameters or param-group dicts, as for any optimizer. Their flat order
            (group by group) defines the parameter indices used for ownership and state dicts.
        optimizer_class: the inner optimizer, e.g. ``torch.optim.AdamW``.
        process_group: the data-parallel group the parameters are replicated over.
        assignment: ``"balanced"`` (default) or ``"round_robin"``, see :func:`assign_owners`.
        average_gradients: all-reduce (average) gradients at the start of ``step``. Off by
            default because DDP already averaged them.
        **defaults: hyperparameters for ``optimizer_class`` (lr, betas, weight_decay, ...).

    Every rank must call ``step`` (it is collective) with the same parameters having gradients.
    At the first step the parameters are re-homed into one flat storage per dtype and device,
    grouped by owner (``p.data`` becomes a view; the Parameter objects stay the same), so the
    exchange after each step is one collective per owner segment with no copies. Code that
    later replaces ``p.data`` (e.g. ``model.to(...)``) is detected and the storage rebuilt.
    Parameters must be plain tensors (not DTensors).
    """

    def __init__(
        self,
        params: Iterable[Any],
        optimizer_class: Callable[..., torch.optim.Optimizer],  # a class, or a partial of one
        process_group: dist.ProcessGroup,
        *,
        assignment: str = "balanced",
        average_gradients: bool = False,
        cost: Optional[Callable[[torch.Tensor, dict[str, Any]], int]] = None,
        **defaults: Any,
    ) -> None:
        if assignment not in ASSIGNMENTS:
            raise ConfigError(f"ShardedOptimizer assignment must be one of {ASSIGNMENTS}, got {assignment!r}")
        self.process_group = process_group
        self.rank = dist.get_rank(process_group)
        self.world_size = dist.get_world_size(process_group)
        self.assignment = assignment
        self.cost = cost  # (param, its group) -> balance weight; default: bytes
        self.average_gradients = average_gradients
        self._optimizer_class = optimizer_class
        self._inner_defaults = defaults
        self._inner: Optional[torch.optim.Optimizer] = None
        self._all_params: list[torch.Tensor] = []  # flat order = state-dict indices
        self._owners: list[int] = []
        self._loads = [0] * self.world_size
        self._flat: Optional[list[_FlatShards]] = None  # built at the first step
        self._flat_ptrs: list[int] = []
        # NCCL: one in-place all-gather per dtype (bandwidth-optimal ring). gloo: one broadcast per
        # owner, all in flight at once; gloo's all-gather is not pipelined and measured ~3x slower
        # than concurrent broadcasts of the same bytes. (Tests, and a rehearsal under a fake group,
        # set it to take either path; before the first step.)
        self.sync_with_all_gather = dist.get_backend(process_group) == dist.Backend.NCCL

        # Normalise the groups and assign every parameter given now in one global pass, so a
        # decay/no-decay split is balanced as a whole rather than group by group.
        groups = list(params)
        if groups and not isinstance(groups[0], dict):
            groups = [{"params": groups}]
        for i, group in enumerate(groups):
            ps = group["params"]
            group = dict(group)
            group["params"] = [ps] if isinstance(ps, torch.Tensor) else list(ps)
            groups[i] = group
        self._pending_owners: Optional[list[int]] = self._assign(
            [_param_of(e) for g in groups for e in g["params"]], [g for g in groups for _ in g["params"]]
        )
        super().__init__(groups, defaults)
        self._pending_owners = None
        assert self._inner is not None
        self.defaults = self._inner.defaults  # complete defaults (betas, eps, ...), not only ours

    # ------------------------------------------------------------------ ownership

    def _assign(self, params: list[torch.Tensor], groups: list[dict[str, Any]]) -> list[int]:
        if self.assignment == "round_robin":
            start = len(self._all_params)
            return [(start + i) % self.world_size for i in range(len(params))]
        # Continues from the current loads; a later add_param_group keeps earlier owners fixed.
        if self.cost is not None:
            return _balanced_owners([self.cost(p, g) for p, g in zip(params, groups)], self._loads)
        return _balanced_owners([p.numel() * p.element_size() for p in params], self._loads)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group: its owned parameters go to the inner optimizer, all of them to ``param_groups``."""
        entries = param_group["params"]
        if isinstance(entries, torch.Tensor):
            entries = [entries]
        elif isinstance(entries, set):
            raise TypeError("optimizer parameters need to be organized in ordered collections, not sets")
        entries = list(entries)
        params = [_param_of(e) for e in entries]
        if self._pending_owners is not None:  # assigned globally in __init__
            owners, self._pending_owners = (
                self._pending_owners[: len(params)],
                self._pending_owners[len(params) :],
            )
        else:
            owners = self._assign(params, [param_group] * len(params))
        inner_group = {k: v for k, v in param_group.items() if k != "params"}
        inner_group["params"] = [e for e, owner in zip(entries, owners) if owner == self.rank]
        if isinstance(param_group.get("names"), list) and len(param_group["names"]) == len(entries):
            # per-parameter names (Muon's) follow their parameters
            inner_group["names"] = [n for n, owner in zip(param_group["names"], owners) if owner == self.rank]
        if self._inner is None:
            self._inner = self._optimizer_class([inner_group], **self._inner_defaults)
        else:
            self._inner.add_param_group(inner_group)
        # The outer group carries the inner optimizer's filled-in hyperparameters (e.g. AdamW's betas).
        outer_group = {
            k: v for k, v in self._inner.param_groups[-1].items() if k not in ("params", "param_names")
        }
        outer_group["params"] = entries
        super().add_param_group(outer_group)
        self._all_params.extend(params)
        self._owners.extend(owners)
        self._flat = None

    def owner_of(self, param_index: int) -> int:
        """Group rank that owns parameter ``param_index`` (flat index over all groups)."""
        return self._owners[param_index]

    def owned_params(self, rank: Optional[int] = None) -> list[torch.Tensor]:
        """Parameters owned by ``rank`` (default: this rank), in flat order."""
        rank = self.rank if rank is None else rank
        return [p for p, owner in zip(self._all_params, self._owners) if owner == rank]

    @property
    def inner_optimizer(self) -> torch.optim.Optimizer:
        """The optimizer instance that sees (and holds state for) this rank's parameters only."""
        assert self._inner is not None
        return self._inner

    # ``state`` is the inner optimizer's dict: one source of truth, and it survives the inner
    # optimizer's load_state_dict replacing its dict. Optimizer.__init__ assigns an empty
    # defaultdict before the inner optimizer exists; that assignment is dropped.
    @property
    def state(self) -> Any:
        inner: Optional[torch.optim.Optimizer] = self.__dict__.get("_inner")
        if inner is None:
            return {}
        return inner.state

    @state.setter
    def state(self, value: Any) -> None:
        inner: Optional[torch.optim.Optimizer] = self.__dict__.get("_inner")
        if inner is not None:
            inner.state = value

    # ------------------------------------------------------------------ step

    # torch's Optimizer.step is overloaded on the closure; one signature here
    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], float]] = None) -> Optional[float]:  # type: ignore[override]
        """(Optionally average gradients,) update owned parameters, then re-replicate all of them."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self.average_gradients:
            self._average_gradients()
        inner = self.inner_optimizer
        # Schedulers and users change the outer groups; the inner optimizer must see it.
        for outer, inner_group in zip(self.param_groups, inner.param_groups):
            for key, value in outer.items():
                if key not in ("params", "param_names"):
                    inner_group[key] = value
        inner.step()
        self._synchronize_parameters()
        return loss

    def _average_gradients(self) -> None:
        """All-reduce every gradient to its group mean, one flat collective per dtype and device."""
        use_avg = dist.get_backend(self.process_group) == dist.Backend.NCCL
        by_kind: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
        for p in self._all_params:
            if p.grad is not None:
                by_kind.setdefault((p.grad.dtype, p.grad.device), []).append(p.grad)
        for grads in by_kind.values():
            flat = _flatten_dense_tensors(grads)
            dist.all_reduce(
                flat, op=dist.ReduceOp.AVG if use_avg else dist.ReduceOp.SUM, group=self.process_group
            )
            if not use_avg:  # gloo: no AVG
                flat.div_(self.world_size)
            for g, synced in zip(grads, _unflatten_dense_tensors(flat, grads)):
                g.copy_(synced)

    def _flatten_parameters(self) -> list[_FlatShards]:
        """Re-home every parameter into a flat per-(dtype, device) storage grouped by owner.

        Each parameter's ``.data`` becomes a view of the storage (as DeepSpeed's ZeRO does), so
        in-place updates by the inner optimizer, ``load_state_dict`` and DDP's broadcast all
        land there. With ``all_gather`` every owner's segment is padded to the longest one.
        """
        kinds: dict[tuple[torch.dtype, torch.device], list[list[torch.Tensor]]] = {}
        for p, owner in zip(self._all_params, self._owners):
            per_rank = kinds.setdefault((p.dtype, p.device), [[] for _ in range(self.world_size)])
            per_rank[owner].append(p)
        flats = []
        for (dtype, device), per_rank in kinds.items():
            sizes = [sum(p.numel() for p in ps) for ps in per_rank]
            if self.sync_with_all_gather:
                segments = [(r * max(sizes), max(sizes)) for r in range(self.world_size)]
            else:
                segments = [(sum(sizes[:r]), sizes[r]) for r in range(self.world_size)]
            storage = torch.zeros(sum(length for _, length in segments), dtype=dtype, device=device)
            with torch.no_grad():
                for (offset, _), ps in zip(segments, per_rank):
                    for p in ps:
                        view = storage[offset : offset + p.numel()].view(p.shape)
                        view.copy_(p)
                        p.data = view
                        offset += p.numel()
            flats.append(_FlatShards(storage, segments))
        return flats

    def _synchronize_parameters(self) -> None:
        """Give every rank the owners' updated values: one collective per owner (or per dtype)."""
        if self.world_size == 1:
            return
        ptrs = [p.data_ptr() for p in self._all_params]
        if self._flat is None or ptrs != self._flat_ptrs:  # first step, or params re-homed (e.g. .to())
            self._flat = self._flatten_parameters()
            self._flat_ptrs = [p.data_ptr() for p in self._all_params]
        # all_gather_single is the newer name of all_gather_into_tensor.
        all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        handles = []
        for flat in self._flat:
            if self.sync_with_all_gather:
                offset, length = flat.segments[self.rank]
                all_gather(flat.storage, flat.storage[offset : offset + length], group=self.process_group)
                continue
            for rank, (offset, length) in enumerate(flat.segments):
                if length > 0:
                    src = dist.get_global_rank(self.process_group, rank)
                    segment = flat.storage[offset : offset + length]
                    handles.append(dist.broadcast(segment, src=src, group=self.process_group, async_op=True))
        for handle in handles:
            handle.wait()

    # ------------------------------------------------------------------ checkpoints

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict holding state for any subset of parameter indices.

        Accepts this rank's own ``state_dict()``, a merged one, or ``consolidated_state_dict()``
        from any world size or assignment (or a plain optimizer's over the same parameters): each
        rank keeps the indices it owns now. An owned trainable parameter without state is an
        error, unless the dict has no state at all (a fresh optimizer).
        """
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups):
            raise ConfigError(
                f"optimizer checkpoint has {len(saved_groups)} param groups, this optimizer has "
                f"{len(self.param_groups)}; build the optimizer with the same groups as when saving"
            )
        for g, (saved, group) in enumerate(zip(saved_groups, self.param_groups)):
            if len(saved["params"]) != len(group["params"]):
                raise ConfigError(
                    f"optimizer checkpoint group {g} has {len(saved['params'])} parameters, this optimizer's "
                    f"has {len(group['params'])}; the model or its param grouping changed since saving"
                )
        saved_state = {_state_key(k): v for k, v in state_dict["state"].items()}
        # Saved groups list the flat indices of their parameters, in order.
        index_of = {id(p): i for i, p in enumerate(self._all_params)}
        saved_index = {}
        for saved, group in zip(saved_groups, self.param_groups):
            for k, entry in zip(saved["params"], group["params"]):
                saved_index[index_of[id(_param_of(entry))]] = _state_key(k)

        inner = self.inner_optimizer
        inner_state: dict[int, Any] = {}
        inner_groups: list[dict[str, Any]] = []
        inner_index = 0
        for saved, inner_group in zip(saved_groups, inner.param_groups):
            indices = []
            for entry in inner_group["params"]:
                flat = index_of[id(_param_of(entry))]
                key = saved_index[flat]
                if key in saved_state:
                    inner_state[inner_index] = saved_state[key]
                elif saved_state and _param_of(entry).requires_grad:
                    raise ConfigError(
                        f"optimizer checkpoint lacks state for parameter {flat} (owned by rank {self.rank} "
                        f"of {self.world_size} under the {self.assignment!r} assignment); it holds state for "
                        f"{len(saved_state)} of {len(self._all_params)} parameters. Save "
                        "consolidated_state_dict() or merge every rank's state_dict() before loading "
                        "under a different world size"
                    )
                indices.append(inner_index)
                inner_index += 1
            hyper = {k: v for k, v in saved.items() if k not in ("params", "param_names")}
            inner_groups.append({**hyper, "params": indices})
        # The inner optimizer casts state to each parameter's device/dtype, as a plain one would.
        inner.load_state_dict({"state": inner_state, "param_groups": inner_groups})
        for saved, group in zip(saved_groups, self.param_groups):
            for key, value in saved.items():
                if key not in ("params", "param_names"):
                    group[key] = copy.deepcopy(value)

    def consolidated_state_dict(self, dst: Optional[int] = None) -> dict[str, Any]:
        """The gathered optimizer checkpoint: state for *all* parameters, as one plain optimizer's.

        Collective. Every rank's shard is copied to CPU and gathered to every rank (``dst=None``)
        or only to group rank ``dst`` (other ranks get ``{}``). The result loads into a plain
        ``optimizer_class`` over the same parameters, or into a ShardedOptimizer of any size.
        """
        local = self.state_dict()
        shard = {
            i: {k: v.detach().cpu() if isinstance(v, torch.Tensor) else v for k, v in s.items()}
            for i, s in local["state"].items()
        }
        gathered: list[Any] = [None] * self.world_size
        if dst is None:
            dist.all_gather_object(gathered, shard, group=self.process_group)
        else:
            is_dst = self.rank == dst
            dist.gather_object(
                shard,
                gathered if is_dst else None,
                dst=dist.get_global_rank(self.process_group, dst),
                group=self.process_group,
            )
            if not is_dst:
                return {}
        merged: dict[int, Any] = {}
        for part in gathered:
            merged.update(part)
        return {"state": dict(sorted(merged.items())), "param_groups": local["param_groups"]}
