"""Parallel degrees, all layout validation, and the DeviceMesh they describe.

``ParallelDims.from_config`` is called once, from the config and the world size, BEFORE any
process group exists: every parallelism check lives here (degrees, model divisibility,
pipeline options, DDP / FSDP options, combinations not supported), so a bad layout fails
fast on every rank with one ``ConfigError`` naming both numbers and the fix.

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
from typing import Any, Optional

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from models.errors import ConfigError
from models.spec import ModelSpec
from parallelisms.config import ParallelismConfig

MESH_DIM_NAMES: tuple[str, ...] = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
# With expert parallel dp_shard is split into (dp_shard / (ep / cp), ep / cp).
EP_MESH_DIM_NAMES: tuple[str, ...] = ("pp", "dp_replicate", "dp_shard_mod_ep", "dp_shard_in_ep", "cp", "tp")
# Flattened views: name -> the mesh dims they merge.
FLAT_VIEWS: dict[str, tuple[str, ...]] = {
    "dp": ("dp_replicate", "dp_shard"),
    "dp_shard_cp": ("dp_shard", "cp"),
    "dp_cp": ("dp_replicate", "dp_shard", "cp"),
}
# Built only when a run needs it (DDP with context parallel), to spare every other run a group.
OPTIONAL_VIEWS: dict[str, tuple[str, ...]] = {"dp_replicate_cp": ("dp_replicate", "cp")}
_FLOAT_DTYPES = ("float32", "bfloat16", "float16")


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
                    f"parallelism.tp={self.tp}, parallelism.pp={self.pp}); change these degrees so that their "
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
                    f"parallelism.ep={self.ep} must divide dp_shard*cp = {self.dp_shard}*{self.cp} = {shard_cp} "
                    f"(and be a multiple of cp={self.cp}): experts are carved out of the FSDP axes, not of "
                    f"dp_replicate, tp or pp. Choose an ep that divides {shard_cp}, or raise parallelism.dp_shard."
                )

    # -- construction from the config, with every check --------------------------------
    @classmethod
    def from_config(
        cls,
        cfg: ParallelismConfig,
        world_size: int,
        *,
        spec: ModelSpec,
        model_args: Any,
        seq_len: int,
        global_batch_size: int,
        micro_batch_size: int,
        compile: bool = False,
        device_type: str = "cpu",
    ) -> ParallelDims:
        """Degrees from ``cfg`` and every layout check against the model, batch and device."""
        dims = cls(
            dp_replicate=cfg.dp_replicate, dp_shard=cfg.dp_shard, cp=cfg.cp, tp=cfg.tp, pp=cfg.pp, ep=cfg.ep,
            world_size=world_size,
        )  # fmt: skip
        dims.validate_options(cfg, compile=compile, device_type=device_type)
        dims.validate_model(spec, model_args, seq_len=seq_len, sequence_parallel=cfg.sequence_parallel)
        from parallelisms.context_parallel import validate_cp

        validate_cp(
            cp=dims.cp, cp_impl=cfg.cp_impl, load_balance=cfg.cp_load_balance, tp=dims.tp,
            sequence_parallel=cfg.sequence_parallel, seq_len=seq_len, device_type=device_type,
            attention_mask=getattr(model_args, "attention_mask", "causal"),
        )  # fmt: skip
        dims.grad_accum_steps(global_batch_size, micro_batch_size)
        if dims.ep > 1 or getattr(model_args, "num_experts", 0) > 0:
            from parallelisms.expert_parallel import validate_ep

            validate_ep(spec, model_args, dims, compile=compile, device_type=device_type)
        if dims.pp > 1:
            from parallelisms.pipeline_split import validate_pp

            validate_pp(
                spec, model_args, cfg, pp=dims.pp, local_batch_size=global_batch_size // dims.dp,
                micro_batch_size=micro_batch_size, compile=compile,
            )  # fmt: skip
        return dims

    def validate_options(self, cfg: ParallelismConfig, *, compile: bool, device_type: str) -> None:
        """DDP / FSDP / TP options and the combinations that are not supported."""
        _choices(cfg.ddp.impl, ("custom", "torch"), "parallelism.ddp.impl")
        if not (math.isfinite(cfg.ddp.bucket_mb) and cfg.ddp.bucket_mb > 0):
            raise ConfigError(
                f"parallelism.ddp.bucket_mb={cfg.ddp.bucket_mb} must be a number > 0 (e.g. 25)."
            )
        if cfg.ddp.grad_dtype is not None:
            _choices(cfg.ddp.grad_dtype, _FLOAT_DTYPES, "parallelism.ddp.grad_dtype")
        for key in ("param_dtype", "reduce_dtype"):
            _choices(getattr(cfg.fsdp, key), _FLOAT_DTYPES, f"parallelism.fsdp.{key}")
        if cfg.fsdp.cpu_offload and device_type != "cuda":
            raise ConfigError(
                "parallelism.fsdp.cpu_offload=true offloads GPU memory to the host; on a CPU run the "
                "parameters already live there. Set parallelism.fsdp.cpu_offload=false."
            )
        if self.cp > 1 and cfg.ddp.sharded_optimizer and self.ddp_enabled:
            raise ConfigError(
                f"parallelism.ddp.sharded_optimizer=true with parallelism.cp={self.cp} is not supported (ZeRO-1 "
                f"shards optimizer state over dp_replicate only); with context parallel use FSDP "
                f"(parallelism.dp_shard > 1, or dp_replicate=1: FSDP then shards over cp), or set "
                f"sharded_optimizer=false."
            )
        if self.cp > 1 and self.pp > 1 and cfg.pp_schedule.lower() in ("interleavedzerobubble", "zbvzerobubble"):
            raise ConfigError(
                f"parallelism.pp_schedule={cfg.pp_schedule} with parallelism.cp={self.cp} is not supported: "
                f"zero-bubble schedules split backward into input and weight passes, and the context-parallel "
                f"attention's reduce-scatter of dK/dV is not verified under that split; use 1F1B, GPipe or "
                f"Interleaved1F1B."
            )
        if cfg.ddp.sharded_optimizer and self.tp > 1:
            raise ConfigError(
                f"parallelism.ddp.sharded_optimizer=true with parallelism.tp={self.tp} is not supported (the "
                f"ZeRO-1 optimizer flattens plain tensors, not tensor-parallel shards); with TP use FSDP "
                f"(parallelism.dp_shard > 1), which shards the optimizer state too, or set sharded_optimizer=false."
            )
        if cfg.ddp.impl == "torch" and self.tp > 1:
            raise ConfigError(
                f"parallelism.ddp.impl=torch with parallelism.tp={self.tp}: torch's DistributedDataParallel "
                f"does not accept tensor-parallel (DTensor) parameters; use parallelism.ddp.impl=custom, or "
                f"FSDP (parallelism.dp_shard > 1)."
            )
        if self.tp > 1:
            _validate_tp_options(cfg, compile=compile, device_type=device_type)

    def validate_model(self, spec: ModelSpec, args: Any, *, seq_len: int, sequence_parallel: bool) -> None:
        """Model- and sequence-dependent checks (head counts, layers, sequence length, experts)."""
        if self.tp > 1:
            for key, value in spec.tp_divisible(args).items():
                if value % self.tp != 0:
                    raise ConfigError(
                        f"{key}={value} is not divisible by parallelism.tp={self.tp}; tensor parallelism "
                        f"splits it evenly across ranks: choose a tp that divides {value}."
                    )
            if sequence_parallel and seq_len % self.tp != 0:
                raise ConfigError(
                    f"training.seq_len={seq_len} is not divisible by parallelism.tp={self.tp}, which "
                    f"sequence parallelism needs; change seq_len or set parallelism.sequence_parallel=false."
                )
        if self.pp > args.n_layers:
            raise ConfigError(
                f"parallelism.pp={self.pp} exceeds model.n_layers={args.n_layers}: every pipeline stage needs "
                f"at least one block; use pp <= {args.n_layers}."
            )
        if self.ep > 1 and getattr(args, "num_experts", 0) < 1:
            raise ConfigError(
                f"parallelism.ep={self.ep} needs a mixture-of-experts model; the {spec.family} family has no "
                f"experts. Set parallelism.ep=1."
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
        views = {view: tuple(d for name in dims for d in (shard if name == "dp_shard" else (name,)))
                 for view, dims in FLAT_VIEWS.items()}  # fmt: skip
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
        """Sub-mesh by dim names, including the flattened views (e.g. ``get_mesh("dp_replicate", "dp_shard_cp")``).

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
        return self.get_mesh("dp_replicate_cp") if self.cp > 1 else self.get_mesh("dp_replicate")

    @property
    def cp_mesh(self) -> DeviceMesh:
        """The context-parallel axis."""
        return self.get_mesh("cp")

    @property
    def expert_fsdp_mesh(self) -> DeviceMesh:
        """Where FSDP shards expert parameters under ep: ``dp_shard_mod_ep`` (dp_shard x cp / ep), or
        2-D (``dp_replicate``, ``dp_shard_mod_ep``) for HSDP. The experts' own ``ep`` axis is their DTensor mesh."""
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


def _validate_tp_options(cfg: ParallelismConfig, *, compile: bool, device_type: str) -> None:
    """``async_tp`` needs CUDA, compile and sequence parallel."""
    if not cfg.async_tp:
        return
    if device_type != "cuda":
        raise ConfigError(
            f"parallelism.async_tp=true needs CUDA GPUs (symmetric memory between the tp ranks), "
            f"but this run is on {device_type!r}. Set parallelism.async_tp=false."
        )
    if not compile:
        raise ConfigError(
            "parallelism.async_tp=true is an Inductor rewrite of the compiled graph; it needs "
            "training.compile=true. Set training.compile=true or parallelism.async_tp=false."
        )
    if not cfg.sequence_parallel:
        raise ConfigError(
            "parallelism.async_tp=true overlaps sequence parallel's all_gather / reduce_scatter with "
            "the matmuls; set parallelism.sequence_parallel=true or parallelism.async_tp=false."
        )


def _choices(value: Any, allowed: tuple[str, ...], key: str) -> None:
    if value not in allowed:
        raise ConfigError(f"{key}={value!r} is not one of {list(allowed)}; set {key} to one of them.")
