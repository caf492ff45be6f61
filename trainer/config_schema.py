"""The dataclass schemas of the run's own config groups (``job``, ``data``, ``checkpoint``, ``metrics``,
``comm``, ``profiling``, ``training``) and of the whole tree, ``TrainConfig``, with their defaults.

``trainer/config.py`` registers them with Hydra, composes, converts and validates, and re-exports every
name here (``from trainer.config import TrainConfig`` is the public spelling). The groups whose schemas
live with their packages are imported: ``parallelisms/config.py``, ``trainer/optim/config.py``,
``trainer/eval/config.py``. Defaults are written twice, here and in the group files;
``tests/trainer/test_config_defaults.py`` holds them equal (a non-default option's own settings are
listed there).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional

from omegaconf import MISSING

from models.spec import ModelArgs
from parallelisms.config import ParallelismConfig
from parallelisms.float8 import Float8Config
from trainer.data.batch_ramp import BatchStage
from trainer.data.seq_warmup import SeqLenStage
from trainer.eval.config import EvalConfig
from trainer.optim.config import LRSchedulerConfig, OptimizerConfig

__all__ = [
    "CheckpointConfig",
    "CommConfig",
    "DataConfig",
    "JobConfig",
    "MetricsConfig",
    "MixtureSource",
    "ModelConfig",
    "ProfilingConfig",
    "SpikeConfig",
    "TrainConfig",
    "TrainingConfig",
    "WandbMode",
]


# The ``model`` group's type: every family's args class extends it (``models/spec.py``), and
# each family's class is registered as the schema ``base_model_<family>`` that its presets
# extend, so a preset is typed by its own family (unknown keys and wrong types still fail at
# composition) and the rest of the config does not depend on which family it is.
ModelConfig = ModelArgs


@dataclass
class MixtureSource:
    """One entry of ``data.sources``: a corpus and its sampling weight."""

    path: str = MISSING  # a prepared folder (data.source=tokens) or what data.source reads
    weight: float = 1.0  # relative share of the samples (normalised over all sources)


@dataclass
class DataConfig:
    source: str = "builtin"  # builtin | text | json | parquet | hub | tokens (prepared folder)
    path: Optional[str] = None  # local file, glob or directory; dataset name for hub; folder for tokens
    name: Optional[str] = None  # hub dataset config name
    split: str = "train"  # split to read (local files and hub)
    text_field: str = "text"  # column holding the document text
    tokenizer: str = "byte"  # "byte" or a path to a HF tokenizer.json
    val_fraction: float = 0.01  # share of documents held out for validation
    max_documents: Optional[int] = None  # cap on documents read; None = all
    shuffle: bool = True  # shuffle training windows each epoch (seeded)
    streaming: bool = False  # tokenize and pack on the fly, per dp rank (text/json/parquet/hub)
    pack: bool = True  # pack documents into full windows; false = one padded window per document
    sources: list[MixtureSource] = field(default_factory=list)  # weighted mixture; replaces path
    prefetch: int = 2  # batches prepared ahead in a background thread; 0 = in the step


@dataclass
class CheckpointConfig:
    enable: bool = False  # save DCP checkpoints and resume from the newest one
    folder: str = "checkpoints"  # relative to job.dump_folder
    interval: int = 500  # steps between saves
    keep_latest: int = 0  # 0 = keep all, else >= 2
    keep_every: int = 0  # with keep_latest: also keep every step that is a multiple of this (0 = off)
    async_mode: str = "disabled"  # disabled | async
    load_step: int = -1  # -1 = newest complete checkpoint
    save_final: bool = True
    initial_load_path: Optional[str] = None  # DCP step-N folder to start from when the run has none
    initial_load_model_only: bool = True  # with initial_load_path: weights only (fresh optimizer, step 0)
    initial_load_hf: Optional[str] = (
        None  # Hugging Face folder (Llama, Mixtral, Qwen3-MoE) to start from when the run has none
    )
    create_seed: bool = False  # write model-only step-0 (one process) and exit
    last_save_in_hf: bool = False  # also write the final weights as a HF folder <folder>/step-N-hf
    hf_dtype: str = "float32"  # dtype of the weights last_save_in_hf writes: float32 | bfloat16 | float16
    hf_max_shard_size: str = "5GB"  # largest safetensors file last_save_in_hf writes (5GB, 500MB, bytes)


# metrics.wandb_mode's values (a plain str in the schema: OmegaConf has no Literal fields)
WandbMode = Literal["online", "offline", "disabled"]


@dataclass
class MetricsConfig:
    log_freq: int = 10
    tensorboard: bool = True
    jsonl: bool = True
    wandb: bool = False  # also log to Weights & Biases (pip install 'meshwright[wandb]')
    wandb_project: str = "meshwright"
    wandb_entity: Optional[str] = None  # W&B team or user; None = the account's default
    wandb_mode: Optional[str] = None  # online | offline | disabled; None = W&B's default (WANDB_MODE)
    # bytes/calls of every collective of each logged step, per rank (trainer/observe/comm_ledger.py)
    comm_ledger: bool = False
    # bytes saved for backward, model states and buffers of each logged step, per rank
    # (trainer/observe/memory_ledger.py)
    memory_ledger: bool = False
    # per block, embedding and head: grad norm, param norm, update/param ratio every N steps (a multiple of
    # log_freq; trainer/observe/layer_stats.py); 0 = off
    layer_stats_freq: int = 0
    # error | warn | off: plan this rank's memory at start-up and stop (or warn) when it exceeds the device /
    # host RAM
    memory_check: str = "error"


@dataclass
class CommConfig:
    init_timeout_s: float = 600.0  # collective timeout until the first step of this process ends
    train_timeout_s: float = 300.0  # collective timeout from then on
    trace_buffer_size: int = 20000  # flight-recorder entries per rank (TORCH_FR_BUFFER_SIZE); 0 = off


@dataclass
class ProfilingConfig:
    enable: bool = False  # torch.profiler traces of the chosen steps into <dump_folder>/profile/step-N/
    steps: list[int] = field(default_factory=lambda: [10])  # steps to profile (each on its own)
    top_ops: int = 30  # rows of the per-rank top-ops table
    memory_snapshot: bool = True  # on CUDA, also a memory snapshot of each profiled step


@dataclass
class SpikeConfig:
    """``training.spike.*``: skip a step whose loss or pre-clip gradient norm is an outlier against the
    last accepted steps (``trainer/stability.py`` states the rule)."""

    enable: bool = False
    window: int = 128  # accepted steps whose loss and grad norm make the running mean and std
    warmup: int = 20  # accepted steps in the window before a step can be judged
    z_threshold: float = 6.0  # a step is skipped when (value - mean) / std exceeds this, for either figure
    max_consecutive: int = 5  # this many skips in a row stop the run


@dataclass
class TrainingConfig:
    steps: int = 100
    seed: int = 0
    seq_len: int = 256
    global_batch_size: int = 16  # sequences per optimizer step across all dp ranks
    micro_batch_size: int = 4  # sequences per forward/backward per dp rank
    grad_clip: float = 1.0  # max global grad norm; <= 0 disables clipping
    mixed_precision: str = "fp32"  # fp32 | bf16 (autocast)
    compile: bool = False
    activation_checkpoint: str = "none"  # none | full | selective
    ac_selective: str = "layer"  # selective: layer (every k-th block) | op (save matmul outputs)
    ac_layer_interval: int = 2  # selective layer: checkpoint every k-th block
    deterministic: bool = False
    device: str = "auto"  # auto | cpu | cuda
    cpu_gemm: str = "auto"  # auto (onednn on x86-64) | onednn | torch: fp32 CPU GEMMs (models/cpu_gemm.py)
    eval_freq: int = 0  # steps between evaluations; 0 = never
    eval_steps: int = 4  # validation batches per evaluation
    # batch-size warmup (trainer/data/batch_ramp.py): stages {global_batch_size, until_step | until_tokens},
    # then global_batch_size; [] = off
    batch_ramp: list[BatchStage] = field(default_factory=list)
    # sequence-length warmup (trainer/data/seq_warmup.py): stages {seq_len, until_step}, each seq_len
    # dividing seq_len; the final windows are split; [] = off
    seq_len_warmup: list[SeqLenStage] = field(default_factory=list)
    z_loss_weight: float = 0.0  # weight x mean log Z^2 of the output logits added to the loss (PaLM); 0 = off
    # the loss runs the output head over this many positions of the sequence at a time, recomputed in
    # backward, so the (B, S, V) logits are never materialised (trainer/step.py); 0 = off
    loss_chunk_size: int = 0
    spike: SpikeConfig = field(default_factory=SpikeConfig)  # loss-spike skipping (off by default)
    # float8 / MXFP8 linears through torchao (parallelisms/float8.py)
    float8: Float8Config = field(default_factory=Float8Config)


@dataclass
class JobConfig:
    name: str = "run"
    dump_folder: str = "outputs/${job.name}"  # identical on every rank: no timestamps


@dataclass
class TrainConfig:
    job: JobConfig = field(default_factory=JobConfig)
    model: ModelArgs = field(default_factory=ModelArgs)  # a family's args class (see ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    lr_scheduler: LRSchedulerConfig = field(default_factory=LRSchedulerConfig)
    parallelism: ParallelismConfig = field(default_factory=ParallelismConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    comm: CommConfig = field(default_factory=CommConfig)
    profiling: ProfilingConfig = field(default_factory=ProfilingConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)  # downstream tasks (trainer/eval/)
