"""The family door: code outside ``models/`` reads a model's args through its ``ModelSpec`` (typed
fields, the spec's callables such as ``planner_terms``, ``mtp_depth``, ``attention_mask``), never
by probing them with ``getattr`` / ``hasattr``: a probe is a second picture of a family, which the
next family silently falls through.

``DOOR_FOLDERS`` lists the folders held to it, one tuple to widen."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# Folders (relative to the repository) whose modules must not probe model args.
DOOR_FOLDERS: tuple[str, ...] = ("trainer/planner",)
# What a model-args expression looks like: these names, or an attribute chain ending in ``.model``
# (``cfg.model``, ``c.cfg.model``, ``self.cfg.model``).
ARGS_NAMES: frozenset[str] = frozenset({"a", "args", "model_args"})
ARGS_ATTRIBUTES: frozenset[str] = frozenset({"model"})
PROBES: frozenset[str] = frozenset({"getattr", "hasattr"})


def is_model_args(node: ast.expr) -> bool:
    """Whether ``node`` names a model's args (see ``ARGS_NAMES`` / ``ARGS_ATTRIBUTES``)."""
    if isinstance(node, ast.Name):
        return node.id in ARGS_NAMES
    return isinstance(node, ast.Attribute) and node.attr in ARGS_ATTRIBUTES


def probes_in(source: str, filename: str = "<source>") -> list[str]:
    """``file:line: call`` for every getattr / hasattr whose first argument is a model-args expression."""
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in PROBES
            and node.args
            and is_model_args(node.args[0])
        ):
            found.append(f"{filename}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_the_probe_finder_finds_probes() -> None:
    """The finder itself: every shape of a model-args probe is caught, other getattr calls are not."""
    flagged = """
hasattr(a, "kv_lora_rank")
getattr(args, "qk_norm", False)
getattr(model_args, "mtp_depth", 0)
getattr(cfg.model, "mtp_depth", 0)
getattr(c.cfg.model, "attention_mask", "causal")
"""
    assert len(probes_in(flagged)) == 5
    clean = """
getattr(dims, name)
getattr(self.c.dims, a)
getattr(model, "layers", None)
hasattr(torch.nn.init, name)
c.spec.mtp_depth(c.cfg.model)
"""
    assert probes_in(clean) == []


def test_planner_reads_no_model_args() -> None:
    """No module of ``DOOR_FOLDERS`` probes model args: the planner reads a family through its spec
    (``spec.planner_terms(args)``: attention traffic and saved terms, FFN / MoE terms; the spec's
    ``mtp_depth``, ``attention_mask``, ``num_experts``)."""
    probes = []
    for folder in DOOR_FOLDERS:
        files = sorted((REPO / folder).rglob("*.py"))
        assert files, f"{folder} holds no Python file: is DOOR_FOLDERS stale?"
        for path in files:
            probes += probes_in(path.read_text(encoding="utf-8"), str(path.relative_to(REPO)))
    assert not probes, "model args probed outside models/ (read them through the ModelSpec):\n" + "\n".join(
        probes
    )
