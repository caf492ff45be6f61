"""Parallel degrees and the DeviceMesh they describe.

``ParallelDims(...)`` checks the degrees against the world size on construction; every other
layout check (model divisibility, pipeline, context/expert parallel and DDP / FSDP options,
combinations not supported) lives in ``parallelisms/validate.py``, whose ``validated_dims`` builds
the ``ParallelDims`` of a run once, BEFORE any process group exists, so a bad layout fails fast on
every rank with one ``ConfigError`` naming both numbers and the fix.

``build_mesh`` then creates the mesh once, in the fixed order ``pp, dp_replicate, dp_shard,
cp, tp`` (outermost first: TP innermost so it stays inside a node, since torchrun ranks are
node-contiguous) plus the flattened views

- ``dp``          = dp_replicate x dp_shard   (data loading: ranks that see different batches)
- ``dp_shard_cp`` = dp_shard x cp             (FSDP parameter sharding)
- ``dp_cp``       = dp_replicate x dp_shard x cp (loss and gradient-norm reductions)
- ``dp_replicate_cp`` = dp_replicate x cp     (DDP under context parallel; only built when used)

and answers sub-meshes by name (``get_mesh("dp_shard_cp")``) and this rank's coordinates
(``dp_rank``, ``pp_rank``, ...). Nobody else slices the mesh or recomputes a rank by hand.

Expert parallel (``ep > 1``) carves the ``ep`` axis out of ``dp_shard x cp``: the mesh then has
``dp_shard`` split in two real dims, ``dp_shard_mod_ep`` (outer) x ``dp_shard_in_ep`` (inner, so an
ep group stays as close as possible), and the extra views

- ``dp_shard``  = dp_shard_mod_ep x dp_shard_in_ep (the same ranks as without ep)
- ``ep``        = dp_shard_in_ep x cp             (experts sharded; tokens all_to_all'd)

Dense parameters keep FSDP on ``dp_shard_cp``; expert parameters are sharded over ``ep`` and
FSDP-sharded over ``dp_shard_mod_ep`` = dp_shard x cp / ep (``expert_fsdp_mesh``; HSDP: replicated
over ``dp_replicate`` too).
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field
from typing import Optional

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from models.errors import ConfigError

# The mesh axes, outermost first: the only copy of the order (the planner and the checkpoint marker read it).
MESH_DIM_NAMES: tuple[str, ...] = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
# Every degree of a layout (ep is carved out of dp_shard x cp, not a mesh axis of its own).
DEGREE_NAMES: tuple[str, ...] = (*MESH_DIM_NAMES, "ep")
DP_REPLICATE_CP = "dp_replicate_cp"  # the DDP view under context parallel
# With expert parallel dp_shard is split into (dp_shard / (ep / cp), ep / cp).
EP_MESH_DIM_NAMES: tuple[str, ...] = ("pp", "dp_replicate", "dp_shard_mod_ep", "dp_shard_in_ep", "cp", "tp")
# Flattened views: name -> the mesh dims they merge.
FLAT_VIEWS: dict[str, tuple[str, ...]] = {
    "dp": ("dp_replicate", "dp_shard"),
    "dp_shard_cp": ("dp_shard", "cp"),
    "dp_cp": ("dp_replicate", "dp_shard", "cp"),
}
# Built only when a run needs it (DDP with context parallel), to spare every other run a group.
OPTIONAL_VIEWS: dict[str, tuple[str, ...]] = {DP_REPLICATE_CP: ("dp_replicate", "cp")}


def cp_chunks(cp: int, load_balance: str) -> int:
    """How many equal chunks context parallel cuts each sequence into (``parallelism.cp_load_balance``):
    ``headtail`` 2*cp (rank r holds chunks r and 2cp-1-r, which balances causal attention work),
    ``none`` cp (rank r holds the r-th). ``context_parallel.shard_indices`` cuts by it."""
    return 2 * cp if load_balance == "headtail" else cp


def seq_len_divisor(cp: int, tp: int, load_balance: str, sequence_parallel: bool) -> int:
    """What every sequence the model runs on must be a multiple of in length: the context-parallel
    chunks (``cp_chunks``; nothing is cut without cp) and, under sequence parallelism, cp*tp (each
    rank's S/cp tokens are split again over tp). The one copy of the rule: ``validate_cp`` checks
    ``training.seq_len`` against it, the trainer pads evaluation rows to it."""
    chunks = cp_chunks(cp, load_balance) if cp > 1 else 1
    sp = tp if tp > 1 and sequence_parallel else 1
    return math.lcm(chunks, cp * sp)


@dataclass
class ParallelDims:
    """Degrees of every parallel axis for one run (keyword construction; validated on construction)."""

    dp_replicate: int = 1
    dp_shard: int = -1
    cp: int = 1
    tp: int = 1
    pp: int = 1
    ep: int = 1
    world_size: int = 1
    _mesh: Optional[DeviceMesh] = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name in ("dp_replicate", "cp", "tp", "pp", "ep"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"parallelism.{name}={value!r} must be an integer >= 1.")
        if self.world_size < 1:
            raise ConfigError(f"world size {self.world_size} must be >= 1.")
        if self.dp_shard == 0 or self.dp_shard < -1:
            raise ConfigError(
                f"parallelism.dp_shard={self.dp_shard} must be >= 1, or -1 to use what is left of the world."
            )
        others = self.dp_replicate * self.cp * self.tp * self.pp
        if self.dp_shard == -1:
            if self.world_size % others != 0:
                raise ConfigError(
                    f"world size {self.world_size} is not divisible by dp_replicate*cp*tp*pp = {others} "
                    f"(parallelism.dp_replicate={self.dp_replicate}, parallelism.cp={self.cp}, "
                    f"parallelism.tp={self.tp}, parallelism.pp={self.pp}); change these degrees so that "
                    "their "
                    f"product divides {self.world_size}, or launch a multiple of {others} processes."
                )
            self.dp_shard = self.world_size // others
        product = others * self.dp_shard
        if product != self.world_size:
            raise ConfigError(
                f"parallel degrees multiply to {product} (parallelism.dp_replicate={self.dp_replicate} x "
                f"dp_shard={self.dp_shard} x cp={self.cp} x tp={self.tp} x pp={self.pp}) but the world "
                f"size is {self.world_size}; make the product equal the number of processes "
                f"(e.g. set parallelism.dp_shard=-1 to fill it, or launch {product} processes)."
            )
        if self.ep > 1:
            shard_cp = self.dp_shard * self.cp
            if shard_cp % self.ep != 0 or self.ep % self.cp != 0:
                raise ConfigError(
                    f"parallelism.ep={self.ep} must divide dp_shard*cp = {self.dp_shard}*{self.cp} = "
                    f"{shard_cp} "
                    f"(and be a multiple of cp={self.cp}): experts are carved out of the FSDP axes, not of "
                    f"dp_replicate, tp or pp. Choose an ep that divides {shard_cp}, or raise "
                    "parallelism.dp_shard."
                )

    # -- derived sizes ----------------------------------------------------------------
    @property
    def dp(self) -> int:
        """Data-parallel degree: number of different batches per step."""
        return self.dp_replicate * self.dp_shard

    @property
    def dp_cp(self) -> int:
        """Ranks over which the loss and gradients are reduced (data x context)."""
        return self.dp * self.cp

    @property
    def ddp_enabled(self) -> bool:
        """Pure replication (DDP) on the replicate axis (times cp: parameters are replicated there too)."""
        return self.dp_replicate > 1 and self.dp_shard == 1

    @property
    def fsdp_enabled(self) -> bool:
        """FSDP (or HSDP when dp_replicate > 1) on the shard(+cp) axis; with dp_shard = 1 and
        dp_replicate = 1, context parallel alone shards the parameters over cp."""
        return (self.dp_shard > 1 or self.cp > 1) and not self.ddp_enabled

    @property
    def hsdp_enabled(self) -> bool:
        return self.fsdp_enabled and self.dp_replicate > 1

    def seq_len_divisor(self, load_balance: str, sequence_parallel: bool) -> int:
        """``seq_len_divisor`` of this layout's cp and tp."""
        return seq_len_divisor(self.cp, self.tp, load_balance, sequence_parallel)

    def grad_accum_steps(self, global_batch_size: int, micro_batch_size: int) -> int:
        """Microbatches per optimizer step on each dp rank; validated."""
        per_step = micro_batch_size * self.dp
        if global_batch_size % per_step != 0:
            raise ConfigError(
                f"training.global_batch_size={global_batch_size} is not divisible by "
                f"micro_batch_size x dp = {micro_batch_size} x {self.dp} = {per_step}; "
                f"set training.global_batch_size to a multiple of {per_step} "
                f"(e.g. {max(per_step, global_batch_size // per_step * per_step)})."
            )
        return global_batch_size // per_step

    def local_batch_size(self, global_batch_size: int) -> int:
        """Sequences one data-parallel rank processes per optimizer step."""
        return global_batch_size // self.dp

    # -- coordinates ------------------------------------------------------------------
    def coordinates(self, rank: int) -> dict[str, int]:
        """``rank``'s index on every mesh dim and flattened view, in the mesh's row-major order.

        The one place the layout order is spelled out; ``build_mesh`` checks that the mesh
        agrees, so this is usable before any process group (e.g. to shard data early).
        """
        coords: dict[str, int] = {}
        rest = rank
        for name in reversed(self.mesh_dim_names):  # innermost first
            size = self.axis_size(name)
            coords[name] = rest % size
            rest //= size
        for view, dims in {**self.flat_views, **OPTIONAL_VIEWS}.items():
            index = 0
            for name in dims:
                index = index * self.axis_size(name) + coords[name]
            coords[view] = index
        return coords

    @property
    def mesh_dim_names(self) -> tuple[str, ...]:
        """The real dims of the world mesh, outermost first (dp_shard split in two under ep)."""
        return EP_MESH_DIM_NAMES if self.ep > 1 else MESH_DIM_NAMES

    @property
    def flat_views(self) -> dict[str, tuple[str, ...]]:
        """Flattened views: name -> the real mesh dims they merge."""
        if self.ep == 1:
            return FLAT_VIEWS
        shard = ("dp_shard_mod_ep", "dp_shard_in_ep")
        views = {
            view: tuple(d for name in dims for d in (shard if name == "dp_shard" else (name,)))
            for view, dims in FLAT_VIEWS.items()
        }
        return {"dp_shard": shard, **views, "ep": ("dp_shard_in_ep", "cp")}

    def axis_size(self, name: str) -> int:
        """Size of a real mesh dim or flattened view."""
        if name == "dp_shard_in_ep":
            return self.ep // self.cp
        if name == "dp_shard_mod_ep":
            return self.dp_shard * self.cp // self.ep
        if name in self.flat_views and name not in MESH_DIM_NAMES and name != "ep":
            return math.prod(self.axis_size(d) for d in self.flat_views[name])
        return getattr(self, name)

    def dp_rank_of(self, rank: int) -> int:
        """Data-parallel rank (which batch shard) of a global rank."""
        return self.coordinates(rank)["dp"]

    # -- mesh -------------------------------------------------------------------------
    def build_mesh(self, device_type: str) -> DeviceMesh:
        """Create the world mesh once (call after init_process_group) with the flattened views."""
        if self._mesh is not None:
            return self._mesh
        names = self.mesh_dim_names
        shape = tuple(self.axis_size(name) for name in names)
        mesh = init_device_mesh(device_type, shape, mesh_dim_names=names)
        # Flattened views are registered on the root mesh and can then be sliced by name.
        views = dict(self.flat_views)
        if self.ddp_enabled and self.cp > 1:
            views.update(OPTIONAL_VIEWS)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Slicing a flattened dim")
            for view, dims in views.items():
                mesh[dims]._flatten(view)
        self._mesh = mesh
        coords = self.coordinates(mesh.get_rank())
        for name in (*names, *views):
            if self.get_mesh(name).get_local_rank() != coords[name]:
                raise RuntimeError(f"mesh layout disagrees with ParallelDims.coordinates on {name!r}")
        return mesh

    @property
    def mesh(self) -> DeviceMesh:
        """The world mesh (after ``build_mesh``)."""
        if self._mesh is None:
            raise RuntimeError("ParallelDims.build_mesh() has not been called yet")
        return self._mesh

    def get_mesh(self, *names: str) -> DeviceMesh:
        """Sub-mesh by dim names, including the flattened views (e.g. ``get_mesh("dp_replicate",
        "dp_shard_cp")``).

        torch warns that slicing flattened dims from the root mesh "will be deprecated"; it
        is still the supported way in this torch version, so the warning is silenced here,
        in the one place that does it.
        """
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Slicing a flattened dim")
            return self.mesh[names[0]] if len(names) == 1 else self.mesh[names]

    @property
    def fsdp_mesh(self) -> DeviceMesh:
        """Where FSDP shards: ``dp_shard_cp``, or 2-D (``dp_replicate``, ``dp_shard_cp``) for HSDP."""
        return (
            self.get_mesh("dp_replicate", "dp_shard_cp")
            if self.dp_replicate > 1
            else self.get_mesh("dp_shard_cp")
        )

    @property
    def ddp_mesh(self) -> DeviceMesh:
        """Where DDP averages gradients: ``dp_replicate``, or ``dp_replicate_cp`` under context parallel
        (the cp ranks of a replica hold the same parameters and different tokens)."""
        return self.get_mesh(DP_REPLICATE_CP) if self.cp > 1 else self.get_mesh("dp_replicate")

    @property
    def cp_mesh(self) -> DeviceMesh:
        """The context-parallel axis."""
        return self.get_mesh("cp")

    @property
    def expert_fsdp_mesh(self) -> DeviceMesh:
        """Where FSDP shards expert parameters under ep: ``dp_shard_mod_ep`` (dp_shard x cp / ep), or
        2-D (``dp_replicate``, ``dp_shard_mod_ep``) for HSDP. The experts' own ``ep`` axis is their DTensor
        mesh."""
        return (
            self.get_mesh("dp_replicate", "dp_shard_mod_ep")
            if self.dp_replicate > 1
            else self.get_mesh("dp_shard_mod_ep")
        )

    @property
    def loss_mesh(self) -> DeviceMesh:
        """Ranks whose token counts and losses add up to the global batch (``dp_cp``)."""
        return self.get_mesh("dp_cp")

    @property
    def dp_rank(self) -> int:
        """This rank's data-parallel index (from the mesh)."""
        return self.get_mesh("dp").get_local_rank()

    @property
    def pp_rank(self) -> int:
        return self.get_mesh("pp").get_local_rank()
