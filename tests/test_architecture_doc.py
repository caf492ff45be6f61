"""The recipes of docs/architecture.md ("Adding a model family / a strategy / an optimizer ...") name
every file to touch: each path they name exists, so the recipes cannot point at files that moved."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "architecture.md"


def _recipes() -> dict[str, str]:
    """Section title -> text, for every ``## Adding ...`` section."""
    sections = re.split(r"^## ", DOC.read_text(encoding="utf-8"), flags=re.M)
    return {s.splitlines()[0]: s for s in sections if s.startswith("Adding")}


def _named_paths(text: str) -> list[str]:
    """Repository paths in backticks: a folder (``models/llama/``) or a file with an extension; names
    with a placeholder (``models/<family>/``) or a module attribute (``a/b.py:name``) are cut there."""
    out = []
    for token in re.findall(r"`([^`\s]+)`", text):
        token = re.split(r"[:(]", token)[0]
        if "<" in token or "/" not in token:
            continue
        if token.endswith("/") or re.search(r"\.(py|yaml|md|sh)$", token):
            out.append(token)
    return out


def test_recipes_exist() -> None:
    recipes = _recipes()
    assert {"Adding a model family", "Adding a strategy"} <= set(recipes), sorted(recipes)


def test_every_path_a_recipe_names_exists() -> None:
    missing = [
        f"{title}: {path}"
        for title, text in _recipes().items()
        for path in _named_paths(text)
        if not (REPO / path).exists()
    ]
    assert not missing, "docs/architecture.md recipes name files that do not exist:\n" + "\n".join(missing)


def test_recipes_name_files() -> None:
    for title, text in _recipes().items():
        assert len(_named_paths(text)) >= 3, f"{title}: a recipe names the files to touch"
