"""The rehearsal's pipeline-parallel answers (``trainer/rehearse.py``): which ranks a PP preset
rehearses by default, and the one exchange of torch's schedule that needs values.

The stages carry static shapes from the config (``parallelisms.pipeline_parallel.StageShapes``), so
torch infers no shapes and exchanges no objects. What remains is the first step's vote of torch
>= 2.13's schedules (``_warmup_p2p``): each stage sends whether its shapes are static (1) or must
be inferred (0), the product travels along the pipeline and back, and every rank reads it with
``.item()`` -- a host read that fake tensors cannot answer, over a process group that moves no data.
Every rank computes its vote from the same config, so the outcome is every stage's own vote: the
rehearsal computes that and sets the mode without the exchange (the votes are four bytes per
boundary, once per run, and are not counted).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from parallelisms.pipeline_parallel import Pipeline

__all__ = ["answer_schedule_vote", "default_ranks"]


def default_ranks(world: int, pp: int) -> list[int]:
    """The ranks a preset rehearses by default: the first and the last rank of the first and of the
    last pipeline stage (pp is the outermost mesh dim: stage ``s`` holds ranks ``s * world / pp``
    to ``(s + 1) * world / pp - 1``); without pipeline parallelism, the first and the last rank."""
    per_stage = world // pp
    return sorted({0, per_stage - 1, world - per_stage, world - 1})


def answer_schedule_vote(pipeline: Pipeline) -> None:
    """Replace the first step's static/dynamic vote of ``pipeline``'s torch schedule by its outcome
    computed on this rank (see the module docstring). A torch without the vote needs no answer."""
    schedule = pipeline.schedule
    if not hasattr(schedule, "_warmup_p2p"):
        return
    from torch.distributed.pipelining._utils import InferenceMode

    def vote(stages: list[object], has_backward: bool, p2p_done: bool) -> None:
        for stage in stages:
            meta = stage._user_meta  # type: ignore[attr-defined]
            if InferenceMode.needs_dynamic(meta, has_backward):
                index = stage.stage_index  # type: ignore[attr-defined]
                raise RuntimeError(
                    f"pipeline stage {index} has no complete static shapes, so torch would infer them "
                    "by exchanging objects between ranks, which a rehearsal cannot; build its "
                    "PipelineStage with input_args and output_args (parallelisms/pipeline_parallel.py)."
                )
            stage._inference_mode = InferenceMode.STATIC  # type: ignore[attr-defined]

    answer: Callable[[list[object], bool, bool], None] = vote
    schedule._warmup_p2p = answer
