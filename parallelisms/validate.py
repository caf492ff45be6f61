"""Every layout and option check of a run, in one place, before any process group exists.

``validated_dims`` builds the run's ``ParallelDims`` (degrees against the world size) and runs the
checks below once: DDP / FSDP / TP options and unsupported combinations (``validate_options``),
model divisibility (``validate_model``), context parallel (``validate_cp``), expert parallel
(``validate_ep``) and pipeline options (``validate_pp``). Each raises one ``ConfigError`` naming
the value and the fix. The strategy files apply a layout; they do not check it.
"""

from __future__ import annotations

import math

import torch

from models.errors import ConfigError, check_choice
from models.spec import ModelArgs, ModelSpec, decoder_args, expert_args
from parallelisms.config import ParallelismConfig
from parallelisms.parallel_dims import ParallelDims, cp_chunks, seq_len_divisor
from parallelisms.pipeline_split import (
    ZERO_BUBBLE,
    canonical_schedule,
    num_microbatches,
    schedule_kind,
    stage_names,
    stages_per_rank,
)

__all__ = [
    "CP_IMPLS",
    "CP_LOAD_BALANCE",
    "DDP_IMPLS",
    "validate_cp",
    "validate_ddp",
    "validate_ep",
    "validate_model",
    "validate_options",
    "validate_pp",
    "validated_dims",
]

CP_IMPLS = ("allgather", "ring")
CP_LOAD_BALANCE = ("headtail", "none")
_FLOAT_DTYPES = ("float32", "bfloat16", "float16")
DDP_IMPLS = ("custom", "torch")


def validated_dims(
    cfg: ParallelismConfig,
    world_size: int,
    *,
    spec: ModelSpec,
    model_args: ModelArgs,
    seq_len: int,
    global_batch_size: int,
    micro_batch_size: int,
    compile: bool = False,
    device_type: str = "cpu",
) -> ParallelDims:
    """The ``ParallelDims`` of a run: degrees from ``cfg`` and every layout check against the model,
    batch and device, once, before any process group exists."""
    dims = ParallelDims(
        dp_replicate=cfg.dp_replicate,
        dp_shard=cfg.dp_shard,
        cp=cfg.cp,
        tp=cfg.tp,
        pp=cfg.pp,
        ep=cfg.ep,
        world_size=world_size,
    )
    validate_options(dims, cfg, compile=compile, device_type=device_type)
    validate_model(dims, spec, model_args, seq_len=seq_len, sequence_parallel=cfg.sequence_parallel)
    validate_cp(
        cp=dims.cp,
        cp_impl=cfg.cp_impl,
        load_balance=cfg.cp_load_balance,
        tp=dims.tp,
        sequence_parallel=cfg.sequence_parallel,
        seq_len=seq_len,
        device_type=device_type,
        attention_mask=spec.attention_mask(model_args),
        sequential_state=spec.sequential_state,
    )
    dims.grad_accum_steps(global_batch_size, micro_batch_size)
    if dims.ep > 1 or spec.num_experts(model_args) > 0:
        validate_ep(spec, model_args, dims, compile=compile, device_type=device_type)
    if dims.pp > 1:
        validate_pp(
            spec,
            model_args,
            cfg,
            pp=dims.pp,
            local_batch_size=global_batch_size // dims.dp,
            micro_batch_size=micro_batch_size,
            compile=compile,
        )
    return dims


def validate_options(dims: ParallelDims, cfg: ParallelismConfig, *, compile: bool, device_type: str) -> None:
    """DDP / FSDP / TP options and the combinations that are not supported."""
    validate_ddp(cfg.ddp.impl, cfg.ddp.bucket_mb)
    if cfg.ddp.grad_dtype is not None:
        check_choice(cfg.ddp.grad_dtype, _FLOAT_DTYPES, "parallelism.ddp.grad_dtype")
    for key in ("param_dtype", "reduce_dtype"):
        check_choice(getattr(cfg.fsdp, key), _FLOAT_DTYPES, f"parallelism.fsdp.{key}")
    if cfg.fsdp.cpu_offload and device_type != "cuda":
        raise ConfigError(
            "parallelism.fsdp.cpu_offload=true offloads GPU memory to the host; on a CPU run the "
            "parameters already live there. Set parallelism.fsdp.cpu_offload=false."
        )
    if dims.cp > 1 and cfg.ddp.sharded_optimizer and dims.ddp_enabled:
        raise ConfigError(
            f"parallelism.ddp.sharded_optimizer=true with parallelism.cp={dims.cp} is not supported (ZeRO-1 "
            f"shards optimizer state over dp_replicate only); with context parallel use FSDP "
            f"(parallelism.dp_shard > 1, or dp_replicate=1: FSDP then shards over cp), or set "
            f"sharded_optimizer=false."
        )
    if dims.cp > 1 and dims.pp > 1 and cfg.pp_schedule.lower() in ("interleavedzerobubble", "zbvzerobubble"):
        raise ConfigError(
            f"parallelism.pp_schedule={cfg.pp_schedule} with parallelism.cp={dims.cp} is not supported: "
            f"zero-bubble schedules split backward into input and weight passes, and the context-parallel "
            f"attention's reduce-scatter of dK/dV is not verified under that split; use 1F1B, GPipe or "
            f"Interleaved1F1B."
        )
    if cfg.ddp.sharded_optimizer and dims.tp > 1:
        raise ConfigError(
            f"parallelism.ddp.sharded_optimizer=true with parallelism.tp={dims.tp} is not supported (the "
            f"ZeRO-1 optimizer flattens plain tensors, not tensor-parallel shards); with TP use FSDP "
            "(parallelism.dp_shard > 1), which shards the optimizer state too, or set "
            "sharded_optimizer=false."
        )
    if cfg.ddp.impl == "torch" and dims.tp > 1:
        raise ConfigError(
            f"parallelism.ddp.impl=torch with parallelism.tp={dims.tp}: torch's DistributedDataParallel "
            f"does not accept tensor-parallel (DTensor) parameters; use parallelism.ddp.impl=custom, or "
            f"FSDP (parallelism.dp_shard > 1)."
        )
    if dims.tp > 1:
        _validate_tp_options(cfg, compile=compile, device_type=device_type)


def validate_model(
    dims: ParallelDims, spec: ModelSpec, args: ModelArgs, *, seq_len: int, sequence_parallel: bool
) -> None:
    """Model- and sequence-dependent checks (head counts, layers, sequence length, experts)."""
    if dims.tp > 1 and not spec.tp_plan:
        raise ConfigError(
            f"parallelism.tp={dims.tp}: the {spec.family} family has no tensor-parallel plan yet "
            "(ModelSpec.tp_plan is empty); set parallelism.tp=1."
        )
    if dims.tp > 1:
        for key, value in spec.tp_divisible(args).items():
            if value % dims.tp != 0:
                raise ConfigError(
                    f"{key}={value} is not divisible by parallelism.tp={dims.tp}; tensor parallelism "
                    f"splits it evenly across ranks: choose a tp that divides {value}."
                )
        if sequence_parallel and seq_len % dims.tp != 0:
            raise ConfigError(
                f"training.seq_len={seq_len} is not divisible by parallelism.tp={dims.tp}, which "
                f"sequence parallelism needs; change seq_len or set parallelism.sequence_parallel=false."
            )
    n_layers = decoder_args(args).n_layers
    if dims.pp > n_layers:
        raise ConfigError(
            f"parallelism.pp={dims.pp} exceeds model.n_layers={n_layers}: every pipeline stage needs "
            f"at least one block; use pp <= {n_layers}."
        )
    if dims.ep > 1 and spec.num_experts(args) < 1:
        raise ConfigError(
            f"parallelism.ep={dims.ep} needs a mixture-of-experts model; the {spec.family} family has no "
            f"experts. Set parallelism.ep=1."
        )
    _validate_mtp(dims, spec.mtp_depth(args))


def _validate_mtp(dims: ParallelDims, depth: int) -> None:
    """Multi-token prediction runs with every layout but pipeline parallelism: its modules need the
    embedding of the input tokens AND the output head, and under PP the first stage owns one, the last
    the other, and the last stage does not receive the input tokens (it would need them and the
    embedding's weight, with its gradient combined across the two stages). Rejected rather than
    half-supported. TP shards the MTP modules by the family's plan; CP shards the shifted ids and targets
    built on the whole sequence (``models.deepseek_v3.model.mtp_targets``)."""
    if depth and dims.pp > 1:
        raise ConfigError(
            f"model.mtp_depth={depth} with parallelism.pp={dims.pp} is not supported: multi-token prediction "
            "needs the input tokens, their embedding and the output head on one stage. Set "
            "model.mtp_depth=0 "
            f"or parallelism.pp=1."
        )


def validate_ddp(impl: str, bucket_mb: float) -> None:
    """``parallelism.ddp.{impl,bucket_mb}``: the one copy of the DDP option checks (also run by
    ``apply_ddp`` and ``BucketedDDP`` for callers that skip ``validated_dims``)."""
    check_choice(impl, DDP_IMPLS, "parallelism.ddp.impl")
    if not (math.isfinite(bucket_mb) and bucket_mb > 0):
        raise ConfigError(f"parallelism.ddp.bucket_mb={bucket_mb} must be a number > 0 (e.g. 25).")


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


def validate_cp(
    *,
    cp: int,
    cp_impl: str,
    load_balance: str,
    tp: int,
    sequence_parallel: bool,
    seq_len: int,
    device_type: str,
    attention_mask: str,
    sequential_state: bool = False,
) -> None:
    """Check the context-parallel options against the sequence, device and mask; ``sequential_state``:
    the model's token mixers carry a state along the sequence (``ModelSpec.sequential_state``)."""
    if cp_impl not in CP_IMPLS:
        raise ConfigError(f"parallelism.cp_impl={cp_impl!r} is not one of {list(CP_IMPLS)}; use allgather.")
    if load_balance not in CP_LOAD_BALANCE:
        raise ConfigError(
            f"parallelism.cp_load_balance={load_balance!r} is not one of {list(CP_LOAD_BALANCE)}; "
            "use headtail (zigzag, balanced causal work) or none (contiguous chunks)."
        )
    if cp == 1:
        return
    if sequential_state and (load_balance != "none" or cp_impl != "allgather"):
        raise ConfigError(
            f"parallelism.cp_load_balance={load_balance}, cp_impl={cp_impl}: this model's linear-attention "
            "layers hand their recurrent state from each cp rank to the next, which needs each rank's slice "
            "contiguous and in order; set parallelism.cp_load_balance=none and parallelism.cp_impl=allgather."
        )
    chunks = cp_chunks(cp, load_balance)
    if seq_len % chunks != 0:
        raise ConfigError(
            f"training.seq_len={seq_len} is not divisible by {chunks} = "
            f"{'2*cp' if load_balance == 'headtail' else 'cp'} (parallelism.cp={cp}, cp_load_balance="
            f"{load_balance} cuts each sequence into {chunks} chunks); choose a seq_len that is a multiple "
            f"of {chunks}, or change parallelism.cp."
        )
    divisor = seq_len_divisor(cp, tp, load_balance, sequence_parallel)
    if seq_len % divisor != 0:  # what is left of the rule past the chunks: sequence parallel's cp*tp
        raise ConfigError(
            f"training.seq_len={seq_len} / parallelism.cp={cp} = {seq_len // cp} local tokens are not "
            f"divisible by parallelism.tp={tp}, which sequence parallelism needs; choose a seq_len that is a "
            f"multiple of {divisor}, "
            f"or set parallelism.sequence_parallel=false."
        )
    if cp_impl == "ring":
        if device_type != "cuda":
            raise ConfigError(
                f"parallelism.cp_impl=ring runs torch's experimental ring attention, which needs CUDA "
                f"(NCCL and flash / memory-efficient SDPA); this run is on {device_type}. Use "
                f"parallelism.cp_impl=allgather, which works on every device and backend."
            )
        if attention_mask != "causal":
            raise ConfigError(
                f"parallelism.cp_impl=ring supports only model.attention_mask=causal (torch's ring attention "
                f"has no document mask), got {attention_mask}; use parallelism.cp_impl=allgather for "
                f"block_causal."
            )


def validate_ep(
    spec: ModelSpec, args: ModelArgs, dims: ParallelDims, *, compile: bool, device_type: str
) -> None:
    """Expert counts and grouped-mm override against the layout and device (``ConfigError``)."""
    num_experts = spec.num_experts(args)
    if dims.ep > 1:
        if not spec.has_experts:
            raise ConfigError(
                f"parallelism.ep={dims.ep} needs a mixture-of-experts model; the {spec.family} family has "
                "none. "
                f"Set parallelism.ep=1 or pick an MoE preset (model=moe_debug)."
            )
        if num_experts % dims.ep != 0:
            raise ConfigError(
                f"model.num_experts={num_experts} is not divisible by parallelism.ep={dims.ep}: each ep rank "
                f"holds num_experts / ep whole experts. Choose an ep that divides {num_experts}."
            )
        if dims.cp > 1:
            raise ConfigError(
                f"parallelism.ep={dims.ep} with parallelism.cp={dims.cp} is not supported yet; set cp=1."
            )
        if compile:
            raise ConfigError(
                f"training.compile=true with parallelism.ep={dims.ep} is not supported yet (the all_to_all "
                f"splits are synchronised to the host inside each block); set training.compile=false."
            )
    mode = expert_args(args).grouped_mm if spec.has_experts else "auto"
    if mode == "on":
        if not hasattr(torch, "_grouped_mm"):
            raise ConfigError(
                f"model.grouped_mm=on but torch {torch.__version__} has no torch._grouped_mm; use "
                f"model.grouped_mm=auto or off (batched matmul fallback)."
            )
        if device_type == "cuda" and torch.cuda.is_available():
            capability = torch.cuda.get_device_capability()
            if capability < (8, 0):
                raise ConfigError(
                    "model.grouped_mm=on needs a GPU of compute capability >= 8.0 for torch._grouped_mm; "
                    "this "
                    f"one is {capability[0]}.{capability[1]}. Use model.grouped_mm=auto or off."
                )


def validate_pp(
    spec: ModelSpec,
    args: ModelArgs,
    cfg: ParallelismConfig,
    *,
    pp: int,
    local_batch_size: int,
    micro_batch_size: int,
    compile: bool = False,
) -> None:
    """Check every pipeline option against the model and batch; raise ``ConfigError`` naming the fix.

    Pure: ``validated_dims`` calls it before any process group exists.
    ``local_batch_size`` is the number of sequences one data-parallel rank processes per
    optimizer step (global batch / dp); ``compile`` is ``training.compile``.
    """
    if pp <= 1:
        return
    schedule = canonical_schedule(cfg.pp_schedule)
    if compile and schedule in ZERO_BUBBLE:
        raise ConfigError(
            f"parallelism.pp_schedule={schedule} splits backward into input and weight gradients, which "
            "torch "
            f"cannot do through compiled blocks; set training.compile=false or use 1F1B / Interleaved1F1B."
        )
    if spec.ties_embeddings(args):
        raise ConfigError(
            f"model.tie_embeddings=true cannot be pipelined (parallelism.pp={pp}): the embedding lives on "
            "the "
            "first stage and the output head on the last, so one shared weight would need its gradient "
            "summed "
            f"across stages. Set model.tie_embeddings=false or parallelism.pp=1."
        )
    _validate_stages_per_rank(cfg, schedule)
    stage_names(spec, args, cfg, pp * stages_per_rank(cfg))
    _validate_microbatches(cfg, schedule, pp, local_batch_size, micro_batch_size)


def _validate_stages_per_rank(cfg: ParallelismConfig, schedule: str) -> None:
    v = cfg.pp_stages_per_rank
    if v is None:
        return
    low, high, text = {"single": (1, 1, "1"), "loop": (2, None, "2 or more"), "v": (2, 2, "2")}[
        schedule_kind(schedule)
    ]
    if isinstance(v, bool) or not isinstance(v, int) or v < low or (high is not None and v > high):
        raise ConfigError(
            f"parallelism.pp_stages_per_rank={v!r} does not fit parallelism.pp_schedule={schedule}, which "
            "needs "
            f"{text} virtual stages per rank (GPipe / 1F1B: 1; interleaved schedules: 2 or more; "
            "ZBVZeroBubble: "
            f"2). Set pp_stages_per_rank={low}, or null to use that default."
        )


def _validate_microbatches(
    cfg: ParallelismConfig, schedule: str, pp: int, local_batch_size: int, micro_batch_size: int
) -> None:
    if cfg.pp_microbatches is None and (micro_batch_size < 1 or local_batch_size % micro_batch_size != 0):
        raise ConfigError(
            f"the local batch of {local_batch_size} sequences (global batch / dp) is not divisible by "
            f"training.micro_batch_size={micro_batch_size}; change either, or set "
            "parallelism.pp_microbatches."
        )
    m = num_microbatches(cfg, local_batch_size=local_batch_size, micro_batch_size=micro_batch_size)
    if isinstance(m, bool) or not isinstance(m, int) or m < pp:
        raise ConfigError(
            f"{m!r} pipeline microbatches (parallelism.pp_microbatches, or local batch {local_batch_size} / "
            f"training.micro_batch_size {micro_batch_size}) is fewer than parallelism.pp={pp} stages, so a "
            f"stage would always idle; use at least {pp} (e.g. lower training.micro_batch_size)."
        )
    if local_batch_size % m != 0:
        raise ConfigError(
            f"parallelism.pp_microbatches={m} does not divide the local batch of {local_batch_size} "
            "sequences "
            f"(global batch / dp); choose a divisor of {local_batch_size} that is >= {pp}."
        )
    if schedule_kind(schedule) == "loop" and m % max(1, m // pp) != 0:
        raise ConfigError(
            f"parallelism.pp_schedule={schedule} with {m} microbatches and pp={pp} needs the microbatches to "
            "be "
            f"a multiple of the number of rounds max(1, M // pp) = {m // pp}; use a multiple of {pp}."
        )
