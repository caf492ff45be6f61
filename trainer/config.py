"""Typed configuration: Hydra registration, composition, conversion and every non-parallelism check.

Hydra composes ``configs/train.yaml`` with the overrides; every group file extends the
schema registered here (``defaults: [base_<group>, _self_]``) and the whole tree extends
``base_train``, so unknown keys and wrong types fail at composition time with OmegaConf's
own message. ``to_train_config`` then converts the composed tree once into the dataclasses
and ``validate`` checks the cross-field rules, raising ``ConfigError``.

The dataclass schemas (``TrainConfig`` and the run's own groups) are in ``trainer/config_schema.py``;
this module re-exports them with the other packages' group schemas, so ``from trainer.config import
TrainConfig`` names every config type.
"""

from __future__ import annotations

import math
import os
from typing import Any, get_args

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from models import MODEL_SPECS, get_spec
from models.errors import ConfigError, check_choice
from models.spec import ModelArgs, decoder_args
from parallelisms.config import SEMI_SYNC_METHODS, DDPConfig, FSDPConfig, ParallelismConfig
from parallelisms.utils import DTYPES
from trainer.checkpoint.hf import parse_size
from trainer.config_schema import (
    CheckpointConfig,
    CommConfig,
    DataConfig,
    JobConfig,
    MetricsConfig,
    MixtureSource,
    ModelConfig,
    ProfilingConfig,
    SpikeConfig,
    TrainConfig,
    TrainingConfig,
    WandbMode,
)
from trainer.data.batch_ramp import validate_batch_ramp
from trainer.data.seq_warmup import validate_seq_len_warmup
from trainer.eval.config import EvalConfig, validate_eval
from trainer.optim import validate_optimizer
from trainer.optim.config import LRSchedulerConfig, MuonConfig, OptimizerConfig

__all__ = [
    "CheckpointConfig",
    "CommConfig",
    "ConfigError",
    "DataConfig",
    "DDPConfig",
    "FSDPConfig",
    "JobConfig",
    "LRSchedulerConfig",
    "MetricsConfig",
    "MixtureSource",
    "ModelConfig",
    "MuonConfig",
    "OptimizerConfig",
    "ParallelismConfig",
    "ProfilingConfig",
    "SpikeConfig",
    "TrainConfig",
    "TrainingConfig",
    "WandbMode",
    "compose_config",
    "register_configs",
    "to_train_config",
]


_GROUPS: dict[str, type] = {
    "data": DataConfig,
    "optimizer": OptimizerConfig,
    "lr_scheduler": LRSchedulerConfig,
    "parallelism": ParallelismConfig,
    "checkpoint": CheckpointConfig,
    "metrics": MetricsConfig,
    "comm": CommConfig,
    "profiling": ProfilingConfig,
    "eval": EvalConfig,
}


def register_configs() -> None:
    """Register the schemas in Hydra's ConfigStore (idempotent).

    Model presets extend their family's schema, ``base_model_<family>``.
    """
    cs = ConfigStore.instance()
    cs.store(name="base_train", node=TrainConfig)
    for group, schema in _GROUPS.items():
        cs.store(group=group, name=f"base_{group}", node=schema)
    for family, spec in MODEL_SPECS.items():
        cs.store(group="model", name=f"base_model_{family}", node=spec.args_cls)


def _positive(value: float, key: str) -> None:
    if value <= 0:
        raise ConfigError(f"{key}={value} must be positive; set {key} to a value > 0.")


def validate_model(model: ModelArgs) -> None:
    """The preset's family exists, the preset is typed by that family, and the family accepts it."""
    spec = get_spec(model.family)
    if not isinstance(model, spec.args_cls):
        raise ConfigError(
            f"model.family={model.family!r} but the preset {model.name!r} is a {type(model).__name__} "
            f"(schema of another family); pick a {model.family} preset (model=...) instead of overriding "
            f"model.family."
        )
    model.validate()


def _validate_training(t: TrainingConfig, max_seq_len: int) -> None:
    for key in (
        "steps",
        "seq_len",
        "global_batch_size",
        "micro_batch_size",
        "eval_steps",
        "ac_layer_interval",
    ):
        _positive(getattr(t, key), f"training.{key}")
    if t.eval_freq < 0:
        raise ConfigError(f"training.eval_freq={t.eval_freq} must be >= 0 (0 disables evaluation).")
    if t.seq_len > max_seq_len:
        raise ConfigError(
            f"training.seq_len={t.seq_len} exceeds model.max_seq_len={max_seq_len}; "
            f"lower training.seq_len or raise model.max_seq_len."
        )
    check_choice(t.mixed_precision, ("fp32", "bf16"), "training.mixed_precision")
    check_choice(t.activation_checkpoint, ("none", "full", "selective"), "training.activation_checkpoint")
    check_choice(t.device, ("auto", "cpu", "cuda"), "training.device")
    check_choice(t.cpu_gemm, ("auto", "onednn", "torch"), "training.cpu_gemm")
    check_choice(t.ac_selective, ("layer", "op"), "training.ac_selective")
    if t.grad_clip < 0 or math.isnan(t.grad_clip):
        raise ConfigError(f"training.grad_clip={t.grad_clip} must be >= 0 (0 disables clipping).")
    if not t.z_loss_weight >= 0:
        raise ConfigError(
            f"training.z_loss_weight={t.z_loss_weight} must be >= 0 (0 disables the z-loss; PaLM: 1e-4)."
        )
    if isinstance(t.loss_chunk_size, bool) or not isinstance(t.loss_chunk_size, int) or t.loss_chunk_size < 0:
        raise ConfigError(
            f"training.loss_chunk_size={t.loss_chunk_size!r} must be an integer >= 0 (positions of the "
            "sequence per loss chunk; 0 computes the loss on the whole logits)."
        )
    _validate_spike(t.spike)


def _validate_layer_stats(m: MetricsConfig) -> None:
    freq = m.layer_stats_freq
    if freq < 0 or (freq > 0 and freq % m.log_freq != 0):
        raise ConfigError(
            f"metrics.layer_stats_freq={freq} must be 0 (off) or a multiple of metrics.log_freq={m.log_freq} "
            f"(the statistics are written with the logged steps); e.g. metrics.layer_stats_freq={m.log_freq}."
        )


def _validate_spike(s: SpikeConfig) -> None:
    if not s.enable:
        return
    _positive(s.z_threshold, "training.spike.z_threshold")
    _positive(s.max_consecutive, "training.spike.max_consecutive")
    if s.window < 2 or not 2 <= s.warmup <= s.window:
        raise ConfigError(
            f"training.spike.window={s.window}, training.spike.warmup={s.warmup}: a standard deviation "
            "needs 2 <= warmup <= window accepted steps; raise training.spike.window or lower "
            "training.spike.warmup."
        )


def _validate_batch_ramp(cfg: TrainConfig) -> None:
    """``training.batch_ramp``: its stages, and the layouts and features whose per-step sizes are fixed
    at start-up (refused by name)."""
    t = cfg.training
    if not t.batch_ramp:
        return
    validate_batch_ramp(t.batch_ramp, t.global_batch_size)
    refusals = {
        "parallelism.pp > 1": cfg.parallelism.pp > 1,  # the schedule's microbatch count is fixed
        # the replica groups' data rule splits one fixed global batch (trainer/resilience/fault_tolerance.py)
        "parallelism.fault_tolerance.enable=true": cfg.parallelism.fault_tolerance.enable,
        "data.streaming=true": cfg.data.streaming,  # the streamed loader reads a fixed local batch
        # the auxiliary-loss and MTP gradient scales are per fixed step size
        f"model.family={cfg.model.family} (experts)": get_spec(cfg.model.family).has_experts,
    }
    for name, on in refusals.items():
        if on:
            raise ConfigError(
                f"training.batch_ramp with {name}: not supported (its per-step sizes are fixed at start-up). "
                "Set training.batch_ramp=[] or leave that option off."
            )


def _validate_qk_clip(cfg: TrainConfig) -> None:
    tau = cfg.optimizer.qk_clip_tau
    if tau <= 0:
        return
    if cfg.parallelism.cp > 1:
        raise ConfigError(
            f"optimizer.qk_clip_tau={tau} with parallelism.cp={cfg.parallelism.cp}: the per-head max logit "
            "is "
            "measured from local keys only, and a context shard does not hold all of them. Set "
            "optimizer.qk_clip_tau=0 or parallelism.cp=1."
        )
    spec = get_spec(cfg.model.family)
    if not spec.qk_clip:
        raise ConfigError(
            f"optimizer.qk_clip_tau={tau} with model.family={cfg.model.family}: QK-clip is built for Llama's "
            "attention (llama, moe, qwen3 families); this family's attention (multi-head latent attention) "
            "does "
            "not record per-head max logits. Set optimizer.qk_clip_tau=0."
        )
    if spec.qk_norm(cfg.model):
        raise ConfigError(
            f"optimizer.qk_clip_tau={tau} with model.qk_norm=true: the per-head RMSNorm of q and k undoes "
            "any "
            "scaling of their projections, so QK-clip cannot lower the logits. Set optimizer.qk_clip_tau=0."
        )


def _validate_checkpoint(c: CheckpointConfig) -> None:
    check_choice(c.async_mode, ("disabled", "async"), "checkpoint.async_mode")
    _positive(c.interval, "checkpoint.interval")
    if c.keep_latest == 1 or c.keep_latest < 0:
        raise ConfigError(
            f"checkpoint.keep_latest={c.keep_latest}: use 0 (keep all) or >= 2, so that the newest "
            f"complete checkpoint survives while the next one is written."
        )
    if c.keep_every < 0 or (c.keep_every > 0 and c.keep_every % c.interval != 0):
        raise ConfigError(
            f"checkpoint.keep_every={c.keep_every}: use 0 (off) or a multiple of checkpoint.interval="
            f"{c.interval} (the steps it keeps are saved steps), e.g. checkpoint.keep_every={4 * c.interval}."
        )
    if c.load_step < -1:
        raise ConfigError(
            f"checkpoint.load_step={c.load_step}: use -1 (newest complete checkpoint) or a step >= 0."
        )
    if c.load_step >= 0 and not c.enable:
        raise ConfigError(
            f"checkpoint.load_step={c.load_step} resumes from a checkpoint, but checkpoint.enable=false; "
            f"set checkpoint.enable=true (or drop checkpoint.load_step)."
        )
    check_choice(c.hf_dtype, tuple(DTYPES), "checkpoint.hf_dtype")
    if parse_size(c.hf_max_shard_size) <= 0:
        raise ConfigError(f"checkpoint.hf_max_shard_size={c.hf_max_shard_size!r} must be a positive size.")
    if c.initial_load_path is not None and c.initial_load_hf is not None:
        raise ConfigError(
            f"checkpoint.initial_load_path={c.initial_load_path!r} and checkpoint.initial_load_hf="
            f"{c.initial_load_hf!r} both set the starting weights; set only one of them."
        )


def validate(cfg: TrainConfig) -> None:
    """Cross-field checks that need neither the world size nor the mesh. Every parallelism
    option is checked by ``parallelisms.validate.validated_dims`` (one place, before any process group)."""
    validate_model(cfg.model)
    _validate_training(cfg.training, decoder_args(cfg.model).max_seq_len)
    check_choice(cfg.metrics.memory_check, ("error", "warn", "off"), "metrics.memory_check")
    _validate_layer_stats(cfg.metrics)
    if cfg.metrics.memory_ledger and cfg.training.compile:
        raise ConfigError(
            "metrics.memory_ledger=true cannot run with training.compile=true: compiled regions save their "
            "own "
            "tensors, out of sight of autograd's saved-tensor hooks. Measure with training.compile=false, or "
            "set "
            "metrics.memory_ledger=false."
        )
    if cfg.metrics.comm_ledger and cfg.training.compile:
        raise ConfigError(
            "metrics.comm_ledger=true cannot run with training.compile=true: the ledger is a Python dispatch "
            "mode, under which torch.compile compiles nothing. Measure with training.compile=false (the "
            "collectives and their bytes are the same), or set metrics.comm_ledger=false."
        )
    validate_optimizer(cfg.optimizer, cfg.lr_scheduler, cfg.training.steps)
    _validate_qk_clip(cfg)
    _validate_batch_ramp(cfg)
    if cfg.training.seq_len_warmup:
        validate_seq_len_warmup(cfg.training.seq_len_warmup, cfg.training.seq_len)
        if cfg.parallelism.pp > 1:
            raise ConfigError(
                f"training.seq_len_warmup with parallelism.pp={cfg.parallelism.pp}: not supported (the "
                "pipeline's microbatch shapes are fixed at start-up). Set training.seq_len_warmup=[]."
            )
    if get_spec(cfg.model.family).lr_scale(cfg.model) is not None and cfg.optimizer.name != "adamw":
        raise ConfigError(
            f"model.mup.enable=true with optimizer.name={cfg.optimizer.name}: µP's per-group learning rates "
            "are AdamW's (models/mup.py; Muon's orthogonalised update has its own width scaling). Use "
            "optimizer.name=adamw, or model.mup.enable=false."
        )
    if get_spec(cfg.model.family).lr_scale(cfg.model) is not None and cfg.checkpoint.last_save_in_hf:
        raise ConfigError(
            "model.mup.enable=true with checkpoint.last_save_in_hf=true: Hugging Face's Llama / Qwen3 have "
            "no µP multipliers, the exported model would compute other logits. Set "
            "checkpoint.last_save_in_hf=false."
        )
    _validate_checkpoint(cfg.checkpoint)
    if cfg.checkpoint.last_save_in_hf and cfg.parallelism.pp > 1:
        raise ConfigError(
            f"checkpoint.last_save_in_hf=true is not supported with pipeline parallelism (parallelism.pp="
            f"{cfg.parallelism.pp}): no rank holds every stage's weights. Set "
            "checkpoint.last_save_in_hf=false "
            "and export the final checkpoint with `python -m trainer.export_hf "
            "<dump_folder>/checkpoints/step-N "
            "<out_dir>`."
        )
    _positive(cfg.metrics.log_freq, "metrics.log_freq")
    _validate_operations(cfg)
    _validate_data(cfg.data)
    validate_eval(cfg.eval)
    _validate_fault_tolerance(cfg)
    _validate_semi_sync(cfg)
    folder = cfg.job.dump_folder
    if os.path.exists(folder) and not os.path.isdir(folder):
        raise ConfigError(
            f"job.dump_folder={folder!r} is an existing file, not a folder; point job.dump_folder at a "
            f"folder (it is created if missing) or move the file away."
        )


def _validate_operations(cfg: TrainConfig) -> None:
    """Trackers, collective timeouts and profiling."""
    if cfg.metrics.wandb_mode is not None:
        check_choice(cfg.metrics.wandb_mode, get_args(WandbMode), "metrics.wandb_mode")
    _positive(cfg.comm.init_timeout_s, "comm.init_timeout_s")
    _positive(cfg.comm.train_timeout_s, "comm.train_timeout_s")
    if cfg.comm.trace_buffer_size < 0:
        raise ConfigError(
            f"comm.trace_buffer_size={cfg.comm.trace_buffer_size} must be >= 0 (0 turns it off)."
        )
    if cfg.profiling.enable and not cfg.profiling.steps:
        raise ConfigError(
            "profiling.enable=true but profiling.steps is empty; list the steps, e.g. profiling.steps=[5]."
        )
    bad_steps = [s for s in cfg.profiling.steps if s < 1]
    if bad_steps:
        raise ConfigError(
            f"profiling.steps={list(cfg.profiling.steps)}: steps count from 1; drop {bad_steps}."
        )
    _positive(cfg.profiling.top_ops, "profiling.top_ops")


def _validate_semi_sync(cfg: TrainConfig) -> None:
    """``parallelism.fault_tolerance.semi_sync`` (DiLoCo, trainer/resilience/semi_sync.py): its keys and
    the options that need the per-step quorum or a per-step exchange it does not take."""
    from trainer.optim import optimizer_entry
    from trainer.optim.config import OptimizerConfig

    ss, key = cfg.parallelism.fault_tolerance.semi_sync, "parallelism.fault_tolerance.semi_sync"
    check_choice(ss.method, SEMI_SYNC_METHODS, f"{key}.method")
    if ss.method == "none":
        return
    if not cfg.parallelism.fault_tolerance.enable:
        raise ConfigError(
            f"{key}.method={ss.method} runs across replica groups: set "
            "parallelism.fault_tolerance.enable=true (FT_GROUPS=N ./launch.sh does) or semi_sync.method=none."
        )
    if ss.sync_every < 1:
        raise ConfigError(f"{key}.sync_every={ss.sync_every} must be >= 1 (inner steps between syncs).")
    if ss.method == "diloco" and ss.fragments != 1:
        raise ConfigError(
            f"{key}.fragments={ss.fragments} with method=diloco (one fragment: the whole model); use "
            "method=streaming_diloco for fragments."
        )
    if ss.method == "streaming_diloco" and ss.fragments < 2:
        raise ConfigError(f"{key}.fragments={ss.fragments}: method=streaming_diloco needs >= 2 fragments.")
    if ss.sync_every % ss.fragments:
        raise ConfigError(
            f"{key}.sync_every={ss.sync_every} must be a multiple of {key}.fragments={ss.fragments} "
            "(one fragment is synced every sync_every/fragments inner steps)."
        )
    period = ss.sync_every // ss.fragments
    if not 0 <= ss.fragment_sync_delay < period:
        raise ConfigError(
            f"{key}.fragment_sync_delay={ss.fragment_sync_delay} must lie in "
            f"[0, sync_every/fragments={period}): "
            "a fragment's exchange must end before the next fragment's starts."
        )
    if not 0.0 <= ss.fragment_update_alpha <= 1.0:
        raise ConfigError(f"{key}.fragment_update_alpha={ss.fragment_update_alpha} must lie in [0, 1].")
    o = ss.outer_optimizer
    outer = OptimizerConfig(name=o.name, lr=o.lr, momentum=o.momentum, nesterov=o.nesterov, weight_decay=0.0)
    optimizer_entry(o.name).validate(outer)
    if not (math.isfinite(o.lr) and o.lr > 0):
        raise ConfigError(f"{key}.outer_optimizer.lr={o.lr} must be > 0 (DiLoCo: 0.7).")
    if not (math.isfinite(o.momentum) and 0.0 <= o.momentum < 1.0):
        raise ConfigError(f"{key}.outer_optimizer.momentum={o.momentum} must lie in [0, 1) (DiLoCo: 0.9).")
    if o.nesterov and o.momentum == 0.0:
        raise ConfigError(f"{key}.outer_optimizer.nesterov=true needs outer_optimizer.momentum > 0.")
    refusals = {
        # the first step's wait is a quorum, which this mode takes at syncs only
        f"parallelism.fault_tolerance.startup_wait_s={cfg.parallelism.fault_tolerance.startup_wait_s}": (
            cfg.parallelism.fault_tolerance.startup_wait_s > 0
        ),
    }
    for name, on in refusals.items():
        if on:
            raise ConfigError(
                f"{key}.method={ss.method} with {name}: not supported (the groups meet only at syncs). "
                "Leave that option off or set semi_sync.method=none."
            )


def _validate_fault_tolerance(cfg: TrainConfig) -> None:
    """``parallelism.fault_tolerance`` (torchft replica groups, trainer/resilience/fault_tolerance.py): the
    checks that need no environment (the lighthouse address and torchft are checked at the start)."""
    p, ft = cfg.parallelism, cfg.parallelism.fault_tolerance
    if not ft.enable:
        return
    key = "parallelism.fault_tolerance"
    if not 0 <= ft.replica_group_id < p.dp_replicate:
        raise ConfigError(
            f"{key}.replica_group_id={ft.replica_group_id} must lie in [0, parallelism.dp_replicate="
            f"{p.dp_replicate}): each dp_replicate index is one replica group. Set parallelism.dp_replicate "
            "to the number of groups and give each group its index (the launchers do)."
        )
    if not 1 <= ft.min_replicas <= p.dp_replicate:
        raise ConfigError(
            f"{key}.min_replicas={ft.min_replicas} must lie in [1, "
            f"parallelism.dp_replicate={p.dp_replicate}]."
        )
    for name in ("timeout_s", "quorum_timeout_s", "hang_timeout_s", "heartbeat_ms"):
        value = getattr(ft, name)
        if not value > 0:
            raise ConfigError(f"{key}.{name}={value} must be > 0.")
    if ft.startup_wait_s < 0:
        raise ConfigError(f"{key}.startup_wait_s={ft.startup_wait_s} must be >= 0 (0: no wait).")
    if cfg.training.global_batch_size % p.dp_replicate:
        raise ConfigError(
            f"training.global_batch_size={cfg.training.global_batch_size} must be a multiple of "
            f"parallelism.dp_replicate={p.dp_replicate} (each replica group trains an equal share)."
        )
    if p.ddp.impl != "custom":
        raise ConfigError(
            f"{key}.enable=true averages gradients through our bucketed DDP with the torchft collective; "
            f"parallelism.ddp.impl={p.ddp.impl!r} cannot swap it. Set parallelism.ddp.impl=custom."
        )
    if p.ddp.sharded_optimizer:
        raise ConfigError(
            f"{key}.enable=true with parallelism.ddp.sharded_optimizer=true: ZeRO-1 would shard the "
            "optimizer "
            "state over replica groups that may die. Set parallelism.ddp.sharded_optimizer=false (shard "
            "inside "
            "a group with parallelism.dp_shard instead)."
        )
    if cfg.data.streaming:
        raise ConfigError(
            f"{key}.enable=true with data.streaming=true: a streamed corpus is read per rank and cannot move "
            "a "
            "failed group's share to the survivors. Prepare the data (python -m trainer.prepare_data) or set "
            "data.streaming=false."
        )
    num_experts = get_spec(cfg.model.family).num_experts(cfg.model)
    if num_experts:
        raise ConfigError(
            f"{key}.enable=true is not supported for MoE models (model.num_experts={num_experts}): "
            "the "
            "expert load balancer updates its biases from group-local token counts, so replica groups would "
            "diverge. Use a dense model, or train without fault tolerance."
        )
    if cfg.optimizer.qk_clip_tau > 0:
        raise ConfigError(
            f"{key}.enable=true is not supported with optimizer.qk_clip_tau={cfg.optimizer.qk_clip_tau}: "
            "each "
            "replica group would take its max logits from its own batches only and clip different heads, so "
            "the "
            "groups' weights would diverge. Set optimizer.qk_clip_tau=0, or train without fault tolerance."
        )
    if cfg.checkpoint.create_seed:
        raise ConfigError(f"checkpoint.create_seed=true runs one process; set {key}.enable=false for it.")


def _validate_data(d: DataConfig) -> None:
    check_choice(d.source, ("builtin", "text", "json", "jsonl", "parquet", "hub", "tokens"), "data.source")
    if not 0.0 <= d.val_fraction < 1.0:
        raise ConfigError(f"data.val_fraction={d.val_fraction} must lie in [0, 1).")
    if d.prefetch < 0:
        raise ConfigError(f"data.prefetch={d.prefetch} must be >= 0 (0 prepares batches inside the step).")
    if d.streaming and d.source in ("builtin", "tokens"):
        raise ConfigError(
            f"data.streaming=true with data.source={d.source}: only text, json, parquet and hub sources are "
            "streamed (the built-in corpus is small; prepared tokens are read window by window); set "
            "data.streaming=false."
        )
    if d.source != "builtin" and not d.path and not d.sources:
        raise ConfigError(
            f"data.source={d.source} needs data.path=... (or a mixture: "
            f"data.sources=[{{path: ..., weight: ...}}])."
        )
    if d.sources:
        if d.source == "builtin":
            raise ConfigError(
                "data.sources mixes corpora of data.source (tokens, json, text, parquet or hub), not "
                "builtin; "
                "set data.source, e.g. data=tokens data.sources=[...]."
            )
        for i, s in enumerate(d.sources):
            if not s.weight > 0:
                raise ConfigError(
                    f"data.sources[{i}].weight={s.weight} must be > 0; drop the source instead."
                )


def _with_typed_model(dcfg: DictConfig) -> DictConfig:
    """Give an untyped ``model`` node (e.g. a saved ``config.yaml``) its family's schema, picked
    by ``model.family``; composed configs are typed by their preset already."""
    model = dcfg.get("model") if "model" in dcfg else None
    if model is None or not isinstance(model, DictConfig):
        return dcfg
    if issubclass(OmegaConf.get_type(model) or dict, ModelArgs):
        return dcfg
    family = model.get("family")
    if not family:
        raise ConfigError(f"model.family is not set; set it to one of {sorted(MODEL_SPECS)}.")
    typed = OmegaConf.merge(OmegaConf.structured(get_spec(family).args_cls), model)
    dcfg = dcfg.copy()
    dcfg.model = typed
    return dcfg


def to_train_config(dcfg: DictConfig | dict[str, Any]) -> TrainConfig:
    """Convert a composed Hydra config into typed dataclasses and validate it."""
    # A plain copy: Hydra's ``+key=value`` composes with struct mode off on that node, a flag the
    # merge below would inherit, letting an unknown key through; plain values merge strictly.
    plain = OmegaConf.create(
        OmegaConf.to_container(dcfg, resolve=False) if isinstance(dcfg, DictConfig) else dcfg
    )
    assert isinstance(plain, DictConfig)  # created from a mapping
    merged = OmegaConf.merge(OmegaConf.structured(TrainConfig), _with_typed_model(plain))
    missing = sorted(OmegaConf.missing_keys(merged))
    if missing:
        raise ConfigError(
            f"mandatory config value(s) {missing} not set; pass them on the command line, "
            f"e.g. {missing[0]}=..."
        )
    cfg = OmegaConf.to_object(merged)
    assert isinstance(cfg, TrainConfig)  # guaranteed by the structured merge, not user input
    validate(cfg)
    return cfg


def _config_dir() -> str:
    """The Hydra config folder: ``trainer/configs`` inside an installed wheel (the repository's
    ``configs/`` is packaged there, see ``pyproject.toml``), else ``configs/`` of the checkout."""
    package = os.path.dirname(os.path.abspath(__file__))
    packaged = os.path.join(package, "configs")
    if os.path.isfile(os.path.join(packaged, "train.yaml")):
        return packaged
    return os.path.join(os.path.dirname(package), "configs")


# The one place every command (trainer/main.py, trainer.plan, trainer.prepare_data) finds the configs.
CONFIG_DIR = _config_dir()


def config_error(err: Exception) -> ConfigError:
    """A Hydra or OmegaConf composition error as a one-line ``ConfigError`` naming the bad value."""
    from hydra.errors import MissingConfigException, OverrideParseException
    from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException

    if isinstance(err, MissingConfigException) and err.missing_cfg_file and "/" in err.missing_cfg_file:
        group, name = err.missing_cfg_file.rsplit("/", 1)
        options = [o for o in err.options or [] if not o.startswith("base_")]  # not the schemas
        return ConfigError(
            f"{group}={name}: no such preset in the config group {group!r} "
            f"({os.path.join(CONFIG_DIR, group)}); "
            f"available options: {', '.join(options)}."
        )
    cause = err.__cause__ if isinstance(err.__cause__, OmegaConfBaseException) else None
    lines = [ln.strip() for ln in str(err).splitlines() if ln.strip()]
    lines = [
        ln
        for ln in lines
        if not ln.startswith(
            ("Config search path", "provider=", "full_key:", "reference_type=", "object_type=")
        )
    ]
    if isinstance(cause, (ConfigAttributeError, ConfigKeyError)):  # "+key=value" cannot add to a typed group
        lines = [ln for ln in lines if not ln.startswith("To append")]
        lines.append(f"{str(cause).splitlines()[0]}; check the spelling (the keys are in {CONFIG_DIR})")
    elif cause is not None:
        lines.append(str(cause).splitlines()[0])
    key = getattr(err, "full_key", None)
    if isinstance(err, OmegaConfBaseException) and key:
        lines[0] = f"{key}: {lines[0]}"
    if isinstance(err, OverrideParseException) and err.override not in lines[0]:
        lines[0] = f"override {err.override!r}: {lines[0]}"
    message = "; ".join(ln.removeprefix("In 'train': ").rstrip(".") for ln in lines)
    return ConfigError(message + ".")


def compose_dict(*overrides: str) -> DictConfig:
    """Compose ``configs/train.yaml`` with Hydra-style ``overrides``, untyped; ``ConfigError``
    (one line naming the bad override) on an unknown preset or key, a wrong type or bad syntax."""
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    register_configs()
    try:
        with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
            return compose("train", overrides=list(overrides))
    except (HydraException, OmegaConfBaseException) as err:
        raise config_error(err) from err


def compose_config(*overrides: str) -> TrainConfig:
    """Compose ``configs/train.yaml`` with Hydra-style ``overrides`` (e.g. ``"+experiment=debug"``),
    convert and validate -- exactly what ``trainer/main.py`` does, for scripts and notebooks."""
    from omegaconf.errors import OmegaConfBaseException

    dcfg = compose_dict(*overrides)
    try:
        return to_train_config(dcfg)
    except OmegaConfBaseException as err:  # e.g. an interpolation that names no key
        raise config_error(err) from err


def to_yaml(cfg: TrainConfig) -> str:
    """The resolved config as YAML (written to ``<dump_folder>/config.yaml``)."""
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))
