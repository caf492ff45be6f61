"""Experiment trackers besides ``metrics.jsonl``: TensorBoard and (optionally) Weights & Biases.

Both get the same scalars as ``metrics.jsonl``, keyed by the training step, and keep each step
once across restarts. A run that resumes from the checkpoint of step K:

* TensorBoard: the writer opens with ``purge_step=K+1``, so TensorBoard hides the events the
  interrupted attempt wrote after step K and shows the resumed ones instead.
* W&B: every attempt logs into the same W&B run (its id is kept in
  ``<dump_folder>/wandb/meshwright.json`` and the run is resumed). W&B refuses steps lower than
  the ones it already has, so the tracker skips the steps up to the last one it sent before the
  restart: those rows stay from the first attempt (with a bitwise resume, the same losses).
"""

from __future__ import annotations

import json
import logging
import os
import uuid
from typing import TYPE_CHECKING, Any, Optional, Protocol, cast

if TYPE_CHECKING:
    from trainer.config import MetricsConfig, WandbMode

logger = logging.getLogger("meshwright")


class Tracker(Protocol):
    def log(self, record: dict[str, Any], step: int) -> None: ...

    def close(self) -> None: ...


def _scalars(record: dict[str, Any], prefix: str = "") -> dict[str, float]:
    """A record's numbers but ``step``, flattened: nested dicts and lists become ``key/sub`` and ``key/i``."""
    out: dict[str, float] = {}
    for key, value in record.items():
        name = f"{prefix}{key}"
        if not prefix and key == "step":
            continue
        if isinstance(value, dict):
            out.update(_scalars(value, f"{name}/"))
        elif isinstance(value, (list, tuple)):
            out.update(_scalars({str(i): v for i, v in enumerate(value)}, f"{name}/"))
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            out[name] = value
    return out


class TensorBoardTracker:
    """Scalars to ``<dump_folder>/tb/``."""

    def __init__(self, dump_folder: str, resume_step: int) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self._writer = SummaryWriter(log_dir=os.path.join(dump_folder, "tb"), purge_step=resume_step + 1)

    def log(self, record: dict[str, Any], step: int) -> None:
        for key, value in _scalars(record).items():
            self._writer.add_scalar(key, value, step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class WandbTracker:
    """Scalars and the resolved config (``<dump_folder>/config.yaml``) to a W&B run."""

    def __init__(self, cfg: MetricsConfig, dump_folder: str, run_name: str) -> None:
        try:
            import wandb
        except ImportError as e:
            raise ImportError(
                "metrics.wandb=true needs the wandb package: pip install 'meshwright[wandb]' (or set "
                "metrics.wandb=false)"
            ) from e
        folder = os.path.join(dump_folder, "wandb")
        os.makedirs(folder, mode=0o750, exist_ok=True)
        self._state_path = os.path.join(folder, "meshwright.json")
        state = _read_json(self._state_path) or {"run_id": uuid.uuid4().hex[:16], "last_step": 0}
        self._state = state
        self._open_steps: set[int] = set()  # steps this attempt logged (eval rows share a train row's step)
        config = _read_config(os.path.join(dump_folder, "config.yaml"))
        self._run = wandb.init(
            project=cfg.wandb_project,
            entity=cfg.wandb_entity,
            mode=cast("Optional[WandbMode]", cfg.wandb_mode),  # one of them: trainer.config.validate
            dir=dump_folder,
            id=state["run_id"],
            name=run_name,
            resume="allow",
            config=config,
        )
        if state["last_step"]:
            logger.info(
                f"W&B run {state['run_id']} resumed; steps up to {state['last_step']} are already in it"
            )
        _write_json(self._state_path, state)

    def log(self, record: dict[str, Any], step: int) -> None:
        if step <= self._state["last_step"] and step not in self._open_steps:
            return  # sent by an earlier attempt of this run
        self._run.log(_scalars(record), step=step)
        self._open_steps.add(step)
        if step > self._state["last_step"]:
            self._state["last_step"] = step
            _write_json(self._state_path, self._state)

    def close(self) -> None:
        self._run.finish()


def build_trackers(cfg: MetricsConfig, dump_folder: str, resume_step: int, run_name: str) -> list[Tracker]:
    """The trackers ``cfg`` (``metrics.*``) turns on; call on the writer rank only."""
    trackers: list[Tracker] = []
    if cfg.tensorboard:
        trackers.append(TensorBoardTracker(dump_folder, resume_step))
    if cfg.wandb:
        trackers.append(WandbTracker(cfg, dump_folder, run_name))
    return trackers


def truncate_jsonl(path: str, resume_step: int) -> int:
    """Drop the records after ``resume_step`` from ``metrics.jsonl`` (atomically); return how many."""
    if not os.path.exists(path):
        return 0
    with open(path, encoding="utf-8") as f:
        lines = f.readlines()
    keep = []
    for line in lines:
        try:
            if json.loads(line).get("step", 0) <= resume_step:
                keep.append(line if line.endswith("\n") else line + "\n")
        except json.JSONDecodeError:  # a line cut by a kill: drop it
            continue
    if len(keep) != len(lines):
        tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
        with open(tmp, "w", encoding="utf-8") as f:
            f.writelines(keep)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    return len(lines) - len(keep)


def _read_json(path: str) -> Optional[dict[str, Any]]:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError):
        return None


def _write_json(path: str, data: dict[str, Any]) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(data, f)
    os.replace(tmp, path)


def _read_config(path: str) -> dict[str, Any]:
    from omegaconf import OmegaConf

    try:
        return cast("dict[str, Any]", OmegaConf.to_container(OmegaConf.load(path), resolve=True))  # a mapping
    except (OSError, ValueError):
        return {}
