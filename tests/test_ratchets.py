"""Ratchets: counts that may only go down. ``Any`` per code package (a precise type where one
exists), formatter-suppression markers in the product and the tests (none), and the packages the
type checker covers (``[tool.mypy] files``, run by ``.ci/run``)."""

from __future__ import annotations

import io
import re
import tokenize
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# The word ``Any`` (imports, annotations, comments) in each package's Python files: lower these when
# you remove more; never raise them. Before the family-door redesign (issue #34): models 88,
# parallelisms 70, trainer 307.
MAX_ANY = {"models": 62, "parallelisms": 53, "trainer": 297}

# Formatter-suppression comments in the product and the tests: every file is as ruff formats it.
MAX_FORMATTER_MARKERS = 0


def _python_files(*dirs: str) -> list[Path]:
    return sorted(p for d in dirs for p in (REPO / d).rglob("*.py"))


def _any_count(package: str) -> int:
    word = re.compile(r"\bAny\b")
    return sum(len(word.findall(p.read_text(encoding="utf-8"))) for p in _python_files(package))


@pytest.mark.parametrize("package", sorted(MAX_ANY))
def test_any_count_does_not_grow(package: str) -> None:
    count = _any_count(package)
    assert count <= MAX_ANY[package], (
        f"{package}/ spells Any {count} times, more than the ratchet's {MAX_ANY[package]}: give the new "
        "signature a precise type (a Protocol, a TypeVar, a union), or remove an Any elsewhere."
    )


def _formatter_markers(path: Path) -> list[str]:
    marker = re.compile(r"#\s*fmt:\s*(skip|off)\b")
    source = path.read_text(encoding="utf-8")
    return [
        f"{path.relative_to(REPO)}:{tok.start[0]}"
        for tok in tokenize.generate_tokens(io.StringIO(source).readline)
        if tok.type == tokenize.COMMENT and marker.search(tok.string)
    ]


def test_no_formatter_markers() -> None:
    found = [
        m
        for p in _python_files("models", "parallelisms", "trainer", "benchmarks", "tests")
        for m in _formatter_markers(p)
    ]
    assert len(found) <= MAX_FORMATTER_MARKERS, f"formatter-suppression comments (let ruff format): {found}"


def test_mypy_covers_models_and_parallelisms() -> None:
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    config = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["mypy"]
    files = set(config["files"])
    assert {"models", "parallelisms"} <= files, (
        f"[tool.mypy] files must list models and parallelisms: {files}"
    )
    ci = (REPO / ".ci" / "run").read_text(encoding="utf-8").splitlines()
    assert "mypy" in ci, ".ci/run must run the type checker (a line `mypy`) before the tests"
