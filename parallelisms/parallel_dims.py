"""Parallel degrees, their validation, and the DeviceMesh they describe.

``ParallelDims`` is built from the config and the world size BEFORE any process group
exists, so a bad layout fails fast on every rank with one ``ConfigError`` naming both
numbers and the fix. ``build_mesh`` then creates the mesh in the fixed order
``pp, dp_replicate, dp_shard, cp, tp`` (outermost first: TP innermost so it stays inside
a node, since torchrun ranks are node-contiguous) plus the flattened views

- ``dp``          = dp_replicate x dp_shard   (data loading: ranks that see different batches)
- ``dp_shard_cp`` = dp_shard x cp             (FSDP parameter sharding)
- ``dp_cp``       = dp_replicate x dp_shard x cp (loss and gradient-norm reductions)
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from models.errors import ConfigError
from models.llama import LlamaArgs

MESH_DIM_NAMES: tuple[str, ...] = ("pp", "dp_replicate", "dp_shard", "cp", "tp")


@dataclass
class ParallelDims:
    """Degrees of every parallel axis for one run; validated on construction."""

    dp_replicate: int
    dp_shard: int
    cp: int
    tp: int
    pp: int
    ep: int
    world_size: int

    def __post_init__(self) -> None:
        for name in ("dp_replicate", "cp", "tp", "pp", "ep"):
            value = getattr(self, name)
            if value < 1:
                raise ConfigError(f"parallelism.{name}={value} must be >= 1.")
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
            dp_cp = self.dp_replicate * self.dp_shard * self.cp
            if dp_cp % self.ep != 0:
                raise ConfigError(
                    f"parallelism.ep={self.ep} must divide dp_replicate*dp_shard*cp = {dp_cp} "
                    f"(experts are carved out of the data/context axes); choose an ep that divides {dp_cp}."
                )

    # -- derived sizes ----------------------------------------------------------------
    @property
    def dp(self) -> int:
        """Data-parallel degree: number of different batches per step."""
        return self.dp_replicate * self.dp_shard

    @property
    def dp_cp(self) -> int:
        return self.dp * self.cp

    @property
    def ddp_enabled(self) -> bool:
        """Pure replication (DDP) on the replicate axis."""
        return self.dp_replicate > 1 and self.dp_shard == 1 and self.cp == 1

    @property
    def fsdp_enabled(self) -> bool:
        """FSDP (or HSDP when dp_replicate > 1) on the shard(+cp) axis."""
        return self.dp_shard > 1 or self.cp > 1

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

    # -- validation against the model ------------------------------------------------
    def validate_model(self, args: LlamaArgs, *, seq_len: int, sequence_parallel: bool) -> None:
        """Model- and sequence-dependent checks (head counts, layers, sequence length)."""
        if self.tp > 1:
            for key, value in (
                ("model.n_heads", args.n_heads),
                ("model.n_kv_heads", args.kv_heads),
                ("model FFN hidden size", args.hidden_dim),
                ("model.vocab_size", args.vocab_size),
            ):
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
        if self.cp > 1 and seq_len % (2 * self.cp) != 0:
            raise ConfigError(
                f"training.seq_len={seq_len} is not divisible by 2*cp = {2 * self.cp} (context parallel "
                f"splits each sequence into 2*cp load-balanced chunks); change seq_len or parallelism.cp."
            )
        if self.pp > args.n_layers:
            raise ConfigError(
                f"parallelism.pp={self.pp} exceeds model.n_layers={args.n_layers}: every pipeline stage needs "
                f"at least one block; use pp <= {args.n_layers}."
            )
        if self.ep > 1:
            raise ConfigError(
                f"parallelism.ep={self.ep} needs a mixture-of-experts model; the dense Llama has no experts. "
                f"Set parallelism.ep=1."
            )

    # -- mesh -------------------------------------------------------------------------
    def build_mesh(self, device_type: str) -> DeviceMesh:
        """Create the world mesh (call after init_process_group) with the flattened views."""
        shape = tuple(getattr(self, name) for name in MESH_DIM_NAMES)
        mesh = init_device_mesh(device_type, shape, mesh_dim_names=MESH_DIM_NAMES)
        # Flattened views are registered on the root mesh and can then be sliced by name.
        mesh["dp_replicate", "dp_shard"]._flatten("dp")
        mesh["dp_shard", "cp"]._flatten("dp_shard_cp")
        mesh["dp_replicate", "dp_shard", "cp"]._flatten("dp_cp")
        return mesh


def mesh_view(mesh: DeviceMesh, *names: str) -> DeviceMesh:
    """Slice ``mesh`` by dim names, including the flattened views built by ``build_mesh``.

    torch warns that slicing flattened dims from the root mesh "will be deprecated"; it
    is still the supported way in this torch version, so the warning is silenced here,
    in the one place that does it.
    """
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Slicing a flattened dim")
        return mesh[names[0]] if len(names) == 1 else mesh[names]
