"""The rehearsed trainer (``trainer/rehearse.py``): the real ``Trainer`` with the points that need values
or real I/O answered (``trainer.rehearse.REPLACED``), the synthetic loader and document ids that stand
for the data, the answer to float8's host read of its precomputed scales, and ``StateProbe``, the step
hook that measures the model-state bytes of a rehearsed step. Nothing here changes what the real code
computes; ``trainer/rehearse.py`` runs the steps under its instruments and compares them with the plan."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional, Union

import torch
from torch import nn

from trainer.data.windows import Batch
from trainer.step import StepBatch, StepState
from trainer.train import Trainer

if TYPE_CHECKING:
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker

    from trainer.config import TrainConfig

__all__ = ["RehearsalTrainer", "StateProbe", "SyntheticLoader", "local_bytes"]


class SyntheticLoader:
    """The training loader's place in a rehearsal: token ids of the real shapes (fake tensors)."""

    def __init__(self, batch: int, seq_len: int, vocab_size: int) -> None:
        self.batch, self.seq_len, self.vocab_size = batch, seq_len, vocab_size

    def next_batch(self) -> Batch:
        tokens = torch.randint(0, self.vocab_size, (self.batch, self.seq_len + 1))
        return Batch(tokens[:, :-1], tokens[:, 1:])

    def pop_metrics(self) -> dict[str, float]:
        return {}

    def state_dict(self) -> dict[str, Union[int, bool]]:
        """What the map-style loader saves (``trainer/data/loader.py``: its counters; REPLACED)."""
        return {"samples_seen": 0, "global_batch_size": 0, "seed": 0, "shuffle": True, "num_windows": 0}

    def load_state_dict(self, state_dict: dict[str, Union[int, bool]]) -> None:
        pass


@dataclass(frozen=True)
class _DocumentIds:
    """The tokenizer's place in a rehearsal: the ids that start documents (block-causal positions);
    fake token ids have no values, so which ids they are changes no shape."""

    bos_id: int = 1
    eos_id: int = 2


class _Float8ScalesAnswered:
    """A step hook after ``Float8ScaleHook``: the host read of each precomputed float8 scale (torchao
    0.18's ``WeightWithDynamicFloat8CastTensor.__tensor_flatten__`` tests ``if self._precomputed_scale``)
    is answered as a real run answers it -- nonzero: the scale is float8's max over an amax clamped to
    >= 1e-12 -- through the fake tensor's ``item_memo`` (what ``aten._local_scalar_dense`` returns for a
    fake tensor that has one). Nothing else reads the value; the scale's bytes and its all-reduce are
    traced as they are."""

    def __init__(self, parts: list[nn.Module]) -> None:
        self.parts = parts

    def begin_step(self, _state: object) -> None:
        from torch._subclasses.fake_tensor import FakeTensor
        from torch.distributed.tensor import DTensor

        for part in self.parts:
            for p in part.parameters():
                local = p._local_tensor if isinstance(p, DTensor) else p
                scale = getattr(local, "_precomputed_scale", None)
                if isinstance(scale, FakeTensor):
                    scale.item_memo = float(torch.finfo(torch.float8_e4m3fn).max)


class RehearsalTrainer(Trainer):
    """The real ``Trainer`` with the points that need values or real I/O answered
    (``trainer.rehearse.REPLACED``): the model, optimizer and hooks are built inside ``fake``
    (FakeTensorMode), the mesh and the ``parallelize`` steps before materialisation outside it (they
    read mesh coordinates)."""

    def __init__(self, cfg: TrainConfig, fake: FakeTensorMode, backend: str = "nccl") -> None:
        self.fake = fake
        self.backend = backend  # the planned cluster's: the fake group has none of its own
        self.probe: Optional[StateProbe] = None  # set while steps are rehearsed
        super().__init__(cfg)

    def _load_data(self) -> None:
        self.tokenizer = _DocumentIds()  # type: ignore[assignment]  # what block-causal positions read
        t = self.cfg.training
        self.train_loader = SyntheticLoader(self.local_batch_size, t.seq_len, self.cfg.model.vocab_size)  # type: ignore[assignment]
        self.step_shape.steady()  # the steady state (see REPLACED)
        self.val_loader, self.named_val_loaders, self.task_evaluator = None, {}, None

    def _build_operations(self) -> None:
        pass  # the preemption agreement builds a gloo group: no peers exist under the fake group

    def _write_run_folder(self) -> None:
        self.log_folder = self.cfg.job.dump_folder  # nothing is written

    def _init_weights(self, model: nn.Module) -> None:
        pass  # fake tensors have no values to initialise

    def _build_model(self) -> dict[str, torch.Size]:
        with self._fake_materialisation():
            full_shapes = super()._build_model()
        self._balance_routing()
        if self.pipeline is not None:
            from trainer.rehearse_pp import answer_schedule_vote

            answer_schedule_vote(self.pipeline)
        return full_shapes

    def _balance_routing(self) -> None:
        """Mixture-of-experts layers route balanced (copy j to expert j mod E, ``REPLACED``): fake
        tensors have no values to choose experts by, and the token counts per expert, the dispatch
        splits of expert parallelism and the experts' group sizes must be known on the host."""
        if self.spec.moe_layers is None:
            return
        for part in self.model_parts:
            for _, moe in self.spec.moe_layers(part):
                moe.balanced_routing = True

    @contextlib.contextmanager
    def _fake_materialisation(self) -> Iterator[None]:
        """``to_empty`` (the materialisation in ``parallelize``) inside ``fake``; TP, AC and FSDP before
        it stay outside, where DTensor can compute shard offsets from the mesh coordinates."""
        original = nn.Module.to_empty
        fake = self.fake

        def to_empty(
            module: nn.Module, *, device: Union[str, torch.device], recurse: bool = True
        ) -> nn.Module:
            with fake:
                return original(module, device=device, recurse=recurse)

        nn.Module.to_empty = to_empty  # type: ignore[method-assign]
        try:
            yield
        finally:
            nn.Module.to_empty = original  # type: ignore[method-assign]

    def _build_optimizer(self) -> None:
        from parallelisms.sharded_optimizer import ShardedOptimizer

        with self.fake:
            super()._build_optimizer()
        if isinstance(self.optimizer, ShardedOptimizer):  # ZeRO-1 re-replicates as on the planned backend
            self.optimizer.sync_with_all_gather = self.backend == "nccl"

    def _build_checkpointer(self, full_shapes: dict[str, torch.Size]) -> None:
        """The run's ``Checkpointer`` without what needs peers (the disk check's broadcast, the async
        save's gloo group) and without a load; ``_checkpoint_rows`` (``trainer/rehearse.py``) plans its
        save (REPLACED)."""
        quiet = dataclasses.replace(
            self.cfg.checkpoint, enable=False, async_mode="disabled", create_seed=False, last_save_in_hf=False
        )
        self.checkpointer = self._make_checkpointer(quiet, full_shapes)

    def _build_metrics(self) -> None:
        from parallelisms.float8 import Float8ScaleHook
        from trainer.hooks import StepHooks

        with self.fake:
            self._build_hooks()
        if self.hooks.of_type(Float8ScaleHook) is not None:  # answered after the precompute (REPLACED)
            self.hooks = StepHooks([*self.hooks.hooks, _Float8ScalesAnswered(self.model_parts)])

    def _log_summary(self) -> None:
        pass

    def _check_finite(self, s: StepState) -> None:
        pass  # fake tensors have no values: the step is taken as finite

    def _forward_loss_sum(self, batch: StepBatch) -> torch.Tensor:
        loss = super()._forward_loss_sum(batch)
        if self.probe is not None:
            self.probe.record_saved()
        return loss


def local_bytes(tensors: Iterable[Optional[torch.Tensor]]) -> float:
    """Bytes of the distinct tensors (a DTensor counts its local shard; tied weights count once)."""
    from torch.distributed.tensor import DTensor

    seen: dict[int, float] = {}
    for t in tensors:
        if t is None:
            continue
        local = t._local_tensor if isinstance(t, DTensor) else t
        seen[id(local)] = float(local.numel() * local.element_size())
    return sum(seen.values())


class StateProbe:
    """A step hook: the model-state bytes at the instant they are defined (gradients complete, before
    the optimizer step; optimizer state after it)."""

    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer
        self.grads = 0.0
        self.optimizer = 0.0
        self.saved = 0.0  # the most forward-allocated bytes live when a model part's forward returns
        self.flops = 0.0  # matmul and attention FLOPs per step
        self.axes: dict[str, str] = {}  # axis -> the name it is compared under (``_canonical_axes``)
        self.tracker: Optional[MemTracker] = None

    def record_saved(self) -> None:
        """The forward (and the loss) of a microbatch returned: the forward-allocated bytes still live
        are what backward will read (saved activations, the loss's log-softmax), the memory ledger's
        and the planner's term; the most over the step's microbatches is kept."""
        if self.tracker is not None:
            snap = self.tracker.get_tracker_snapshot("current")
            live = next(iter(snap.values()), {}) if snap else {}
            acts = float(sum(v for k, v in live.items() if str(getattr(k, "value", k)) == "Activation"))
            self.saved = max(self.saved, acts)

    def forward_done(self, module: nn.Module, inputs: object, output: object) -> None:
        self.record_saved()  # a pipeline stage's forward (the last stage's loss follows inside torch)

    def before_optimizer_step(self, state: StepState) -> None:
        self.grads = local_bytes(p.grad for p in self.trainer.parameters)

    def after_optimizer_step(self, state: StepState) -> None:
        opt = self.trainer.optimizer.state.values()
        self.optimizer = local_bytes(v for s in opt for v in s.values() if isinstance(v, torch.Tensor))
