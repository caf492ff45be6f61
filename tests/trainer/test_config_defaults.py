"""Config defaults are stated twice, in the dataclass schemas (trainer/config_schema.py,
parallelisms/config.py, trainer/eval/config.py) and in the YAML group files (configs/): what a user gets
is the YAML, what code that builds a config without Hydra gets is the dataclass. Every key a group file
sets must agree with the dataclass default, except the settings that are the point of a non-default
option (listed below, short and explicit).

Not checked here: model presets and experiments (they choose their values on purpose; each family's
args dataclass is only a schema for them), and the cluster group's machine presets other than the
planner's default one (``h100_node``, which ``ClusterConfig``'s defaults restate).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator
from typing import Any

import pytest
import yaml
from omegaconf import OmegaConf

from trainer.config import CONFIG_DIR, TrainConfig, compose_dict
from trainer.planner.cluster import ClusterConfig

# What a non-default option file is for: keys whose value differs from the dataclass default on purpose.
OPTION_SETTINGS: dict[str, dict[str, Any]] = {
    "data/hub.yaml": {"source": "hub"},
    "data/jsonl.yaml": {"source": "json"},
    "data/parquet.yaml": {"source": "parquet"},
    "data/text.yaml": {"source": "text"},
    "data/tokens.yaml": {"source": "tokens"},
    "optimizer/muon.yaml": {"name": "muon"},
    "optimizer/sgd.yaml": {"name": "sgd", "lr": 0.01, "weight_decay": 0.0},
    "lr_scheduler/warmup_linear.yaml": {"decay_type": "linear", "min_lr_ratio": 0.0},
    "lr_scheduler/wsd.yaml": {"decay_type": "wsd", "min_lr_ratio": 0.0},
}
# Sections of configs/train.yaml that are dataclass groups without a folder of their own.
ROOT_SECTIONS = ("job", "training")
NOT_DEFAULTS = ("model",)  # presets, not defaults (see the module docstring)


def _defaults() -> dict[str, Any]:
    """Every dataclass default, interpolations resolved (``job.dump_folder``)."""
    return OmegaConf.to_container(OmegaConf.structured(TrainConfig), resolve=True)


def _raw(path: str) -> dict[str, Any]:
    with open(os.path.join(CONFIG_DIR, path), encoding="utf-8") as f:
        data = yaml.safe_load(f) or {}
    data.pop("defaults", None)
    return data


def _leaves(raw: dict[str, Any], composed: Any, default: Any, prefix: str = "") -> Iterator[tuple]:
    """(key, composed value, dataclass default) of every leaf the YAML sets (nested groups walked)."""
    for key, value in raw.items():
        if isinstance(value, dict) and isinstance(default.get(key), dict) and value:
            yield from _leaves(value, composed[key], default[key], f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", composed[key], default[key]


def _group_files() -> list[str]:
    """``<group>/<option>.yaml`` of every group whose schema is a TrainConfig field."""
    groups = [f.name for f in dataclasses.fields(TrainConfig) if f.name not in NOT_DEFAULTS]
    return sorted(
        f"{group}/{name}"
        for group in groups
        if os.path.isdir(os.path.join(CONFIG_DIR, group))
        for name in os.listdir(os.path.join(CONFIG_DIR, group))
        if name.endswith(".yaml")
    )


def _default_options() -> set[str]:
    """The group files ``configs/train.yaml`` composes by default."""
    with open(os.path.join(CONFIG_DIR, "train.yaml"), encoding="utf-8") as f:
        entries = yaml.safe_load(f)["defaults"]
    return {f"{k}/{v}.yaml" for e in entries if isinstance(e, dict) for k, v in e.items() if "/" not in k}


@pytest.mark.parametrize("path", _group_files())
def test_group_file_agrees_with_the_dataclass(path: str) -> None:
    group, option = path[:-5].split("/")
    composed = OmegaConf.to_container(compose_dict(f"{group}={option}")[group], resolve=True)
    default = _defaults()[group]
    differ = {
        key: (value, want) for key, value, want in _leaves(_raw(path), composed, default) if value != want
    }
    settings = OPTION_SETTINGS.get(path, {})
    assert {k: v for k, (v, _) in differ.items()} == settings, (
        f"configs/{path} and the {group} dataclass disagree on {sorted(set(differ) - set(settings))} "
        f"(yaml, dataclass): {differ}; make them agree (the YAML is what users get), or list a deliberate "
        "setting of this option in OPTION_SETTINGS"
    )


def test_root_sections_agree_with_the_dataclasses() -> None:
    raw, composed, default = (
        _raw("train.yaml"),
        OmegaConf.to_container(compose_dict(), resolve=True),
        _defaults(),
    )
    assert set(ROOT_SECTIONS) <= set(raw)
    for section in ROOT_SECTIONS:
        differ = [
            (k, v, want)
            for k, v, want in _leaves(raw[section], composed[section], default[section])
            if v != want
        ]
        assert not differ, f"configs/train.yaml {section}: (key, yaml, dataclass) {differ}"


def test_default_options_set_nothing_on_purpose() -> None:
    """The default composition overrides no dataclass default, and every listed setting is real."""
    defaults = _default_options()
    assert {"data/builtin.yaml", "optimizer/adamw.yaml", "parallelism/default.yaml"} <= defaults
    assert not defaults & set(OPTION_SETTINGS)
    assert set(OPTION_SETTINGS) <= set(_group_files())


def test_default_cluster_preset_is_the_cluster_dataclass() -> None:
    raw = _raw("cluster/h100_node.yaml")
    default = dataclasses.asdict(ClusterConfig())
    assert {k: v for k, v in raw.items() if v != default[k]} == {}
