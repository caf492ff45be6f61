"""Muon in every layout: each weight matrix is orthogonalised whole, once per step, by one owner rank.

Muon (momentum, then a Newton-Schulz orthogonalisation of the update) needs the *whole*
matrix, while FSDP (Shard(0) slices), TP (row/column slices), EP (expert stacks) and PP
(stages) leave each rank a piece of it. ``Muon`` below keeps torch.optim.Muon's arithmetic
(``torch/optim/_muon.py``: momentum ``lerp``, Nesterov, ``_zeropower_via_newtonschulz``,
``_adjust_lr``, decoupled weight decay) and adds the distribution:

* **Units.** Every Muon parameter is split into matrices: a 2-D weight is one unit, a 3-D
  expert stack ``(E, m, n)`` is E units (Muon per expert).
* **Pieces.** What every rank holds of a unit is found once, from the parameter's mesh and
  placements (``parallelisms.utils.piece_of``: per dimension, the indices a rank holds, as
  ``distribute_tensor`` would leave them; any placement: Shard, Replicate, the strided shards
  of FSDP over TP), as positions in the unit: a slice when contiguous, else an index.
* **Owners.** One rank per unit, among the ranks holding a piece of it (so PP stages own their
  own units), chosen largest-first onto the least-loaded rank by Newton-Schulz FLOPs
  ``m * n * min(m, n)``; every rank computes the same answer. When every rank of the group
  holds the same parameters (any layout without pipeline stages) each rank derives the others'
  pieces from the meshes and placements, without communicating (a rehearsal under a fake
  process group so plans what the real run does); pipeline stages hold different parameters,
  so there the pieces are exchanged once (one ``all_gather_object``).
* **Primaries.** Identical pieces (replicas: DDP, HSDP's replicate axis, the dp axis of TP)
  form a group; one member, the *primary* (the unit's owner when it holds the piece, else the
  lowest rank), keeps the momentum of that piece and sends the Nesterov update. So under DDP
  the owner keeps the whole momentum and receives nothing; under FSDP/TP the momentum is
  sharded like the parameter.
* **Exchange.** One ``all_to_all_single`` carries every primary's pieces to their owners, the
  owners run Newton-Schulz, and one more ``all_to_all_single`` returns to every holder (all
  replicas included) its piece of the orthogonalised update; each holder then applies weight
  decay and the update to its own piece. Two collectives per step, whatever the number of
  matrices.

Units, pieces, owners, primaries and the exchange's element counts are ``muon_plan.py``'s (the
plan, computed once); this file keeps the Newton-Schulz iteration, the exchange and the optimizer.

Parameters without Muon (``use_muon=False`` groups: embeddings, output head, norms, biases) are
stepped by an inner ``torch.optim.AdamW`` that shares this optimizer's ``state``; AdamW is
elementwise, so it runs on the local pieces of any layout.

The state is per parameter, under the parameter (``momentum_buffer``; AdamW's ``exp_avg``,
``exp_avg_sq``, ``step``), shaped like the parameter (a DTensor when it is one), so the
flattened DCP names ``state.<fqn>.momentum_buffer`` are the same in every layout.

From the config (the bottom of this file): :func:`build_muon` is the registry's builder
(``trainer/optim/__init__.py``), :func:`muon_param_groups` splits the parameters,
:func:`validate_muon_config` checks ``optimizer.muon.*`` and :func:`muon_cost` weights ZeRO-1's
owners (the ``ShardedOptimizer`` in ``parallelisms/`` takes it as an argument).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, Optional, cast

import torch
import torch.distributed as dist
from torch import Tensor, nn

from models.common import unwrapped_name
from models.errors import ConfigError, check_choice
from models.spec import StackedExperts
from parallelisms.sharded_optimizer import ShardedOptimizer
from parallelisms.utils import Positions
from trainer.optim.adamw import LRScale, impl_kwargs
from trainer.optim.config import DEFAULT_NS_COEFFICIENTS
from trainer.optim.muon_plan import _count, _local, _Plan, ns_flops

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor

    from trainer.optim.config import MuonConfig, OptimizerConfig

NS_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}  # optimizer.muon.ns_dtype
ADJUST_LR_FNS = ("match_rms_adamw", "original")  # optimizer.muon.adjust_lr_fn (see adjusted_lr)
_ADAMW_KEYS = ("lr", "betas", "eps", "weight_decay")


def zeropower_via_newtonschulz(
    grad: Tensor,
    ns_coefficients: Sequence[float],
    ns_steps: int,
    eps: float,
    dtype: torch.dtype = torch.bfloat16,
) -> Tensor:
    """torch.optim.Muon's Newton-Schulz iteration (``torch.optim._muon._zeropower_via_newtonschulz``,
    the same operations in the same order) in ``dtype``: bfloat16 is torch's (bitwise equal to it);
    float32 is the same iteration without the bf16 rounding (used by the parity tests)."""
    a, b, c = ns_coefficients
    ortho = grad.to(dtype)
    tall = grad.size(0) > grad.size(1)
    if tall:
        ortho = ortho.T
    ortho.div_(ortho.norm().clamp(min=eps))  # spectral norm <= Frobenius norm <= 1
    for _ in range(ns_steps):
        gram = ortho @ ortho.T
        gram_update = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        ortho = torch.addmm(ortho, gram_update, ortho, beta=a)
    return ortho.T if tall else ortho


def adjusted_lr(lr: float, adjust_lr_fn: str, shape: Sequence[int]) -> float:
    """torch.optim.Muon's per-matrix LR: ``original`` = lr * sqrt(max(1, A/B)); ``match_rms_adamw``
    = lr * 0.2 * sqrt(max(A, B)) (Moonlight: the update's RMS matches AdamW's)."""
    rows, cols = shape[-2:]
    if adjust_lr_fn == "match_rms_adamw":
        return lr * (0.2 * math.sqrt(max(rows, cols)))  # torch's order of operations (bitwise)
    return lr * math.sqrt(max(1, rows / cols))


def ns_step_flops(rows: int, cols: int) -> int:
    """FLOPs of one Newton-Schulz iteration on an (rows, cols) matrix (m = min, n = max dim):
    X X^T (2 m^2 n), gram @ gram (2 m^3), update @ X (2 m^2 n)."""
    m, n = min(rows, cols), max(rows, cols)
    return 4 * m * m * n + 2 * m**3


# --------------------------------------------------------------------------------------------
# The exchange: pieces packed by position, one all_to_all_single
# --------------------------------------------------------------------------------------------


def _exchange(
    send: Tensor, send_counts: list[int], recv_counts: list[int], group: Optional[dist.ProcessGroup]
) -> Tensor:
    """One all_to_all_single (the identity on one rank)."""
    if group is None or len(send_counts) == 1:
        return send
    recv = send.new_empty(sum(recv_counts))
    dist.all_to_all_single(recv, send, recv_counts, send_counts, group=group)
    return recv


def _take(t: Tensor, pos: Positions) -> Tensor:
    return t[pos] if isinstance(pos, slice) else t.index_select(0, pos.to(t.device))


def _put(t: Tensor, pos: Positions, values: Tensor) -> None:
    if isinstance(pos, slice):
        t[pos] = values
    else:
        t.index_copy_(0, pos.to(t.device), values)


# --------------------------------------------------------------------------------------------
# The optimizer
# --------------------------------------------------------------------------------------------


class Muon(torch.optim.Optimizer):
    """Muon for the ``use_muon=True`` groups, AdamW for the others, over any parallel layout.

    Args:
        params: param-group dicts; each has ``use_muon`` and ``names`` (the parameters' names,
            the same on every rank: they key the units) besides the hyperparameters.
        process_group: the group over which Muon parameters are split or replicated (the world
            group; None = everything is local, as on one process or inside ZeRO-1's owners).
        ns_dtype: the dtype of the Newton-Schulz iteration (torch's is bfloat16).
        adamw_kwargs: AdamW implementation switches (``foreach`` / ``fused``).
        symmetric: every rank of ``process_group`` holds the same parameters (every layout but
            pipeline stages): each rank derives the others' pieces from the meshes and placements.
            False (the safe default): the pieces are exchanged once (one ``all_gather_object``).
        **defaults: Muon hyperparameters (lr, weight_decay, momentum, nesterov, ns_coefficients,
            ns_steps, eps, adjust_lr_fn) and AdamW's (betas, eps) for groups that lack them.

    ``step`` is collective over ``process_group``: every rank calls it.
    """

    def __init__(
        self,
        params: Iterable[dict[str, Any]],
        process_group: Optional[dist.ProcessGroup] = None,
        *,
        ns_dtype: torch.dtype = torch.bfloat16,
        adamw_kwargs: Optional[dict[str, Any]] = None,
        symmetric: bool = False,
        **defaults: Any,
    ) -> None:
        defaults.setdefault("use_muon", False)
        self.symmetric = symmetric
        self.process_group = (
            process_group if process_group is not None and dist.get_world_size(process_group) > 1 else None
        )
        self.ns_dtype = ns_dtype
        self._adamw_kwargs = adamw_kwargs or {}
        self._adamw: Optional[torch.optim.AdamW] = None
        self._plan: Optional[_Plan] = None
        self.ns_calls = 0  # Newton-Schulz orthogonalisations run on this rank (all steps)
        self._names: dict[int, str] = {}  # id(param) -> name; kept out of param_groups (and checkpoints)
        super().__init__(list(params), defaults)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """As torch's; a Muon group's ``names`` key the units (kept here, not in the group: they
        describe the layout, not a hyperparameter); non-Muon groups also go to the inner AdamW."""
        param_group = dict(param_group)
        names = param_group.pop("names", None)
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        if group["use_muon"]:
            if names is None or len(names) != len(group["params"]):
                raise ValueError("a Muon group needs 'names': one name per parameter, the same on every rank")
            self._names.update({id(p): n for p, n in zip(group["params"], names)})
            self._plan = None
            return
        inner = {"params": group["params"], **{k: group[k] for k in _ADAMW_KEYS if k in group}}
        if self._adamw is None:
            self._adamw = torch.optim.AdamW([inner], **self._adamw_kwargs)
        else:
            self._adamw.add_param_group(inner)

    # -- plan -----------------------------------------------------------------------------------

    def plan(self) -> _Plan:
        """Units, owners and exchange sizes (derived; or, unless ``symmetric``, collective the first
        time: one all_gather_object)."""
        if self._plan is None:
            named = [(self._names[id(p)], p) for g in self.param_groups if g["use_muon"] for p in g["params"]]
            self._plan = _Plan(named, self.process_group, exchange=not self.symmetric)
        return self._plan

    def owner_balance(self) -> float:
        """max / mean Newton-Schulz FLOPs over the ranks (1.0 = perfectly balanced)."""
        flops = self.plan().flops_per_rank
        mean = sum(flops) / len(flops)
        return max(flops) / mean if mean else 1.0

    # -- step -----------------------------------------------------------------------------------

    # torch's Optimizer.step is overloaded on the closure; one signature here
    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], float]] = None) -> Optional[float]:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._adamw is not None:
            self._step_adamw()
        if any(g["use_muon"] for g in self.param_groups):
            self._step_muon()
        return loss

    def _step_adamw(self) -> None:
        assert self._adamw is not None
        self._adamw.state = self.state  # one state dict (load_state_dict replaces ours)
        inner = iter(self._adamw.param_groups)
        for g in self.param_groups:
            if not g["use_muon"]:
                target = next(inner)
                for k in _ADAMW_KEYS:
                    target[k] = g[k]
        self._adamw.step()

    @property
    def _param_ids(self) -> dict[str, int]:
        return {name: pid for pid, name in self._names.items()}

    def _group_of(self) -> dict[int, dict[str, Any]]:
        return {id(p): g for g in self.param_groups if g["use_muon"] for p in g["params"]}

    def _step_muon(self) -> None:
        plan = self.plan()
        groups = self._group_of()
        # 1. primaries: momentum and the Nesterov update of their pieces, packed by owner.
        updates = {
            id(lp.param): self._nesterov_update(lp.param, groups[id(lp.param)]).reshape(-1)
            for lp in plan.local
            if lp.primary
        }
        outgoing: list[list[Tensor]] = [[] for _ in range(plan.world)]
        for i, lp, local_pos, _ in plan.pieces:
            if lp.primary:
                outgoing[plan.units[i].owner].append(_take(updates[id(lp.param)], local_pos))
        send = self._cat(outgoing)
        received = _exchange(send, plan.send_counts(), plan.recv_counts(), self.process_group)
        # 2. owners: assemble each unit whole, orthogonalise, cut it into every holder's piece.
        ortho = self._orthogonalise(received, plan, groups)
        back = _exchange(self._cat(ortho), plan.return_counts(), plan.update_counts(), self.process_group)
        # 3. every holder: weight decay and its piece of the update.
        self._apply(back, plan, groups)

    def _nesterov_update(self, p: Tensor, g: dict[str, Any]) -> Tensor:
        grad = p.grad
        if grad is None:
            grad = torch.zeros_like(p)
        elif hasattr(grad, "placements"):  # a DTensor gradient, of a DTensor parameter
            dgrad, dparam = cast("DTensor", grad), cast("DTensor", p)
            if dgrad.placements != dparam.placements:
                grad = dgrad.redistribute(dparam.device_mesh, dparam.placements)
        state = self.state[p]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(p)
        buf, grad = _local(state["momentum_buffer"]), _local(grad)
        buf.lerp_(grad, 1 - g["momentum"])
        return grad.lerp(buf, g["momentum"]) if g["nesterov"] else buf

    def _cat(self, per_rank: list[list[Tensor]]) -> Tensor:
        flat = [t for ts in per_rank for t in ts]
        if not flat:
            return torch.empty(0, dtype=self._dtype(), device=self._device())
        return torch.cat(flat)

    def _dtype(self) -> torch.dtype:
        return next((p.dtype for g in self.param_groups for p in g["params"]), torch.float32)

    def _device(self) -> torch.device:
        return next((_local(p).device for g in self.param_groups for p in g["params"]), torch.device("cpu"))

    def _orthogonalise(
        self, received: Tensor, plan: _Plan, groups: dict[int, dict[str, Any]]
    ) -> list[list[Tensor]]:
        # ``received`` is ordered by sending rank, then by unit (canonical order) within it.
        offsets = [0] * plan.world
        for r, n in enumerate(plan.recv_counts()[:-1]):
            offsets[r + 1] = offsets[r] + n
        positions = plan.positions
        out: list[list[Tensor]] = [[] for _ in range(plan.world)]
        ids = self._param_ids
        for unit in plan.owned():
            g = groups[ids[unit.key[0]]]
            full = received.new_zeros(unit.rows * unit.cols)
            for sig, primary in sorted(unit.primaries.items(), key=lambda kv: kv[1]):
                n = unit.counts[sig]
                _put(full, positions[(unit.key, sig)], received[offsets[primary] : offsets[primary] + n])
                offsets[primary] += n
            self.ns_calls += 1
            ortho = zeropower_via_newtonschulz(
                full.view(unit.rows, unit.cols), g["ns_coefficients"], g["ns_steps"], g["eps"], self.ns_dtype
            ).reshape(-1)
            for rank, sig in sorted(unit.holders.items()):
                out[rank].append(_take(ortho, positions[(unit.key, sig)]).to(received.dtype))
        return out

    def _apply(self, back: Tensor, plan: _Plan, groups: dict[int, dict[str, Any]]) -> None:
        offsets = [0] * plan.world
        for r, n in enumerate(plan.update_counts()[:-1]):
            offsets[r + 1] = offsets[r] + n
        flat_updates = {
            id(lp.param): torch.empty(_local(lp.param).numel(), dtype=back.dtype, device=back.device)
            for lp in plan.local
        }
        for i, lp, local_pos, unit_pos in plan.pieces:
            owner, n = plan.units[i].owner, _count(unit_pos)
            _put(flat_updates[id(lp.param)], local_pos, back[offsets[owner] : offsets[owner] + n])
            offsets[owner] += n
        for lp in plan.local:
            g = groups[id(lp.param)]
            local = _local(lp.param)
            flat_update = flat_updates[id(lp.param)]
            local.mul_(1 - g["lr"] * g["weight_decay"])
            local.add_(
                flat_update.view_as(local), alpha=-adjusted_lr(g["lr"], g["adjust_lr_fn"], lp.param.shape)
            )


# --------------------------------------------------------------------------------------------
# From the config: checks, parameter groups, the builder, ZeRO-1's owner weights
# --------------------------------------------------------------------------------------------


def validate_muon_config(o: OptimizerConfig) -> None:
    """The ``optimizer.muon.*`` checks (``optimizer.name=muon`` only)."""
    m: MuonConfig = o.muon
    check_choice(m.adjust_lr_fn, ADJUST_LR_FNS, "optimizer.muon.adjust_lr_fn")
    check_choice(m.ns_dtype, tuple(NS_DTYPES), "optimizer.muon.ns_dtype")
    if not (math.isfinite(m.lr) and m.lr > 0):
        raise ConfigError(
            f"optimizer.muon.lr={m.lr} must be a finite number > 0 (e.g. optimizer.muon.lr=3e-4)."
        )
    if not math.isfinite(m.weight_decay) or m.weight_decay < 0:
        raise ConfigError(f"optimizer.muon.weight_decay={m.weight_decay} must be a finite number >= 0.")
    if not 0.0 <= m.momentum < 1.0:
        raise ConfigError(f"optimizer.muon.momentum={m.momentum} must lie in [0, 1) (e.g. 0.95).")
    if not 1 <= m.ns_steps < 100:
        raise ConfigError(f"optimizer.muon.ns_steps={m.ns_steps} must lie in [1, 99] (e.g. 5).")
    if len(m.ns_coefficients) != 3:
        example = ",".join(f"{c:.4f}" for c in DEFAULT_NS_COEFFICIENTS)
        raise ConfigError(
            f"optimizer.muon.ns_coefficients={list(m.ns_coefficients)} must be three numbers (a, b, c), "
            f"e.g. [{example}]."
        )
    if not (math.isfinite(m.eps) and m.eps > 0):
        raise ConfigError(f"optimizer.muon.eps={m.eps} must be a finite number > 0 (e.g. 1e-7).")


def muon_param_groups(
    model: nn.Module | list[nn.Module], cfg: OptimizerConfig, adamw_modules: tuple[str, ...]
) -> list[dict[str, Any]]:
    """Muon for every matrix (2-D weight) and stack of expert matrices (a ``StackedExperts``' 3-D
    weights) outside ``adamw_modules`` (the embedding and the output head, e.g.
    ``spec.first_modules + spec.last_modules``); AdamW for those, for other >2-D weights (a depthwise
    convolution's (C, 1, K) kernels: no matrix to orthogonalise) and for every 1-D parameter.
    Each group carries its own hyperparameters and the parameters' names (they key Muon's units)."""
    parts = model if isinstance(model, list) else [model]
    named: dict[torch.Tensor, str] = {}
    for part in parts:
        for name, param in part.named_parameters():
            if param.requires_grad:
                named.setdefault(param, unwrapped_name(name))
    stacked = {
        id(p)
        for part in parts
        for m in part.modules()
        if isinstance(m, StackedExperts)
        for p in m.parameters()
    }
    muon, decay, no_decay = [], [], []
    for p, name in named.items():
        if p.ndim < 2:
            no_decay.append((name, p))
        elif name.split(".", 1)[0] in adamw_modules or (p.ndim > 2 and id(p) not in stacked):
            decay.append((name, p))
        else:
            muon.append((name, p))
    m = cfg.muon
    groups = [
        {
            "params": [p for _, p in muon],
            "names": [n for n, _ in muon],
            "use_muon": True,
            "lr": m.lr,
            "weight_decay": m.weight_decay,
            "momentum": m.momentum,
            "nesterov": m.nesterov,
            "ns_steps": m.ns_steps,
            "ns_coefficients": tuple(m.ns_coefficients),
            "eps": m.eps,
            "adjust_lr_fn": m.adjust_lr_fn,
        },
        *(
            {
                "params": [p for _, p in named],
                "names": [n for n, _ in named],
                "use_muon": False,
                "lr": cfg.lr,
                "betas": tuple(cfg.betas),
                "eps": cfg.eps,
                "weight_decay": weight_decay,
            }
            for named, weight_decay in ((decay, cfg.weight_decay), (no_decay, 0.0))
        ),
    ]
    return [g for g in groups if g["params"]]


def build_muon(
    parts: list[nn.Module],
    cfg: OptimizerConfig,
    *,
    device_type: str,
    shard_mesh: Optional[DeviceMesh],
    adamw_modules: tuple[str, ...],
    layout: frozenset[str] = frozenset(),
    lr_scale: Optional[LRScale] = None,
) -> torch.optim.Optimizer:
    """Muon + AdamW (:func:`muon_param_groups`). With ``shard_mesh`` it is the ZeRO-1
    ShardedOptimizer's inner optimizer (each owner orthogonalises its whole matrices); without,
    Muon spreads its matrices over the world group's ranks, each rank deriving the others' pieces
    when the run's ``layout`` is known and has no pipeline stages (else they are exchanged).
    ``lr_scale`` (µP's per-parameter LR factors) is refused: see ``models/mup.py``."""
    if lr_scale is not None:
        raise ConfigError(
            "optimizer.name=muon with model.mup.enable=true: µP's per-width AdamW learning rates do not "
            "apply to Muon's orthogonalised updates; use optimizer.name=adamw (or model.mup.enable=false)."
        )
    groups = muon_param_groups(parts, cfg, adamw_modules)
    kwargs: dict[str, Any] = {
        "ns_dtype": NS_DTYPES[cfg.muon.ns_dtype],
        "adamw_kwargs": impl_kwargs(cfg, device_type),
    }
    if shard_mesh is not None:
        # ns_dtype / adamw_kwargs configure the inner optimizer, they are no group hyperparameters
        inner = functools.partial(Muon, **kwargs)
        return ShardedOptimizer(groups, inner, shard_mesh.get_group(), cost=muon_cost)
    group = dist.group.WORLD if dist.is_available() and dist.is_initialized() else None
    return Muon(groups, group, symmetric=bool(layout) and "pp" not in layout, **kwargs)


def muon_cost(p: torch.Tensor, group: dict[str, Any]) -> int:
    """ZeRO-1 owner balance under Muon: Newton-Schulz FLOPs for Muon matrices, bytes otherwise."""
    if group.get("use_muon"):
        stack = p.shape[0] if p.ndim == 3 else 1
        return stack * ns_flops(p.shape[-2], p.shape[-1])
    return p.numel() * p.element_size()
