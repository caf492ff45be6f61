"""Typed config: per-family model schemas and the cross-field errors that need no world size."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from models.errors import ConfigError
from models.llama import LlamaArgs
from tests.configs import compose_dict, make_config
from trainer.config import to_train_config, to_yaml


def test_model_is_typed_by_its_family() -> None:
    cfg = make_config("model=llama3_8b")
    assert isinstance(cfg.model, LlamaArgs) and cfg.model.family == "llama"
    assert cfg.model.rope_scaling.type == "llama3" and cfg.model.rope_scaling.factor == 8.0
    with pytest.raises(Exception, match="not_a_key"):  # unknown keys fail at composition
        compose_dict("model.not_a_key=1")
    with pytest.raises(Exception, match="dim"):  # wrong types too
        compose_dict("model.dim=wide")


def test_saved_config_yaml_reloads_with_its_family() -> None:
    cfg = make_config("model=llama3_8b")
    assert to_train_config(OmegaConf.create(to_yaml(cfg))) == cfg


@pytest.mark.parametrize(
    "overrides,needle",
    [
        (("optimizer.lr=nan",), "optimizer.lr=nan must be a finite number > 0"),
        (("optimizer.lr=inf",), "optimizer.lr=inf must be a finite number > 0"),
        (("optimizer.eps=0",), "optimizer.eps=0.0 must be a finite number > 0"),
        (("model.family=nope",), "model.family='nope' is not a known model family"),
        (("model.rope_scaling.type=longrope",), "model.rope_scaling.type='longrope' is not one of"),
        (("metrics.comm_ledger=true", "training.compile=true"), "cannot run with training.compile=true"),
        (
            ("metrics.memory_ledger=true", "training.compile=true"),
            "memory_ledger=true cannot run with training.compile",
        ),
        (("metrics.memory_check=maybe",), "metrics.memory_check='maybe' is not one of"),
    ],
)
def test_bad_values_are_config_errors(overrides: tuple[str, ...], needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        make_config(*overrides)


def test_dump_folder_that_is_a_file(tmp_path) -> None:
    existing = tmp_path / "a_file"
    existing.write_text("not a folder")
    with pytest.raises(ConfigError, match="is an existing file, not a folder"):
        make_config(f"job.dump_folder={existing}")
