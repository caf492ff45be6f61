"""The family door holds: no module outside ``models/`` probes a model's args by name.

A family's optional features are declared on its ``ModelSpec`` (``models/spec.py``); code in
``trainer/``, ``parallelisms/`` and ``benchmarks/`` reads them through the spec (or typed fields of the
args class it was given), never with ``getattr(args, "kv_lora_rank", ...)`` / ``hasattr(a, ...)``,
which is how a family's knowledge leaked into the planner and the trainer before.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
OUTSIDE_MODELS = ("trainer", "parallelisms", "benchmarks")
# Expressions that hold a family's args: a bare name, ``<x>.args``, or a config's model node
# (``cfg.model``, ``self.cfg.model``, ``c.cfg.model``).
ARG_NAMES = {"a", "args", "model_args", "margs", "folder_args"}


def _is_model_args(node: ast.expr) -> bool:
    if isinstance(node, ast.Name):
        return node.id in ARG_NAMES
    if not isinstance(node, ast.Attribute):
        return False
    if node.attr == "args":
        return True
    owner = node.value
    owner_name = (
        owner.id if isinstance(owner, ast.Name) else owner.attr if isinstance(owner, ast.Attribute) else ""
    )
    return node.attr == "model" and owner_name == "cfg"


def probes(folders: tuple[str, ...] = OUTSIDE_MODELS) -> list[str]:
    """``path:line getattr(...)`` for every getattr/hasattr on model args under ``folders``."""
    found = []
    for folder in folders:
        for path in sorted((REPO / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if (
                    isinstance(node, ast.Call)
                    and isinstance(node.func, ast.Name)
                    and node.func.id in ("getattr", "hasattr")
                    and node.args
                    and _is_model_args(node.args[0])
                ):
                    found.append(f"{path.relative_to(REPO)}:{node.lineno} {ast.unparse(node)}")
    return found


def test_no_model_args_probe_outside_models() -> None:
    found = probes()
    assert not found, "read these through the family's ModelSpec instead:\n" + "\n".join(found)


def test_the_probe_finder_finds_probes(tmp_path: Path) -> None:
    """The check bites: the shapes of probe the tree used to have are all recognised."""
    code = (
        "hasattr(a, 'kv_lora_rank')\ngetattr(cfg.model, 'qk_norm', False)\n"
        "getattr(self.cfg.model, 'attention_mask', 'causal')\ngetattr(c.cfg.model, 'mtp_depth', 0)\n"
        "getattr(model, 'stages', None)\ngetattr(self.model, 'no_sync', None)\n"
    )
    calls = [n for n in ast.walk(ast.parse(code)) if isinstance(n, ast.Call)]
    assert [_is_model_args(c.args[0]) for c in calls] == [True, True, True, True, False, False]
    clean = (
        "getattr(dims, name)\ngetattr(self.c.dims, a)\nhasattr(torch.nn.init, name)\n"
        "c.spec.mtp_depth(c.cfg.model)\n"
    )
    assert not any(
        _is_model_args(n.args[0])
        for n in ast.walk(ast.parse(clean))
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id in ("getattr", "hasattr")
    )


def _trainer_class() -> ast.ClassDef:
    tree = ast.parse((REPO / "trainer" / "train.py").read_text(encoding="utf-8"))
    return next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Trainer")


# Ratchets of the redesign (issue 34): lower them when you simplify more; never raise them. Before it the
# Trainer held 41 attributes and train_step had 15 branches (13 of them `is not None` checks of extras).
MAX_TRAINER_ATTRIBUTES = 32
MAX_TRAIN_STEP_BRANCHES = 3


def test_trainer_attributes_ratchet() -> None:
    """Per-step extras live in the hook list, derived sizes are properties: the Trainer stays small."""
    names = {
        t.attr
        for node in ast.walk(_trainer_class())
        for t in (node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)])
        if isinstance(node, (ast.Assign, ast.AnnAssign))
        and isinstance(t, ast.Attribute)
        and isinstance(t.value, ast.Name)
        and t.value.id == "self"
    }
    assert len(names) <= MAX_TRAINER_ATTRIBUTES, sorted(names)


def test_train_step_branches_ratchet() -> None:
    """``train_step`` is a fixed sequence; extras branch inside their hooks, not here."""
    step = next(n for n in _trainer_class().body if isinstance(n, ast.FunctionDef) and n.name == "train_step")
    branches = sum(isinstance(n, (ast.If, ast.IfExp, ast.For, ast.While)) for n in ast.walk(step))
    assert branches <= MAX_TRAIN_STEP_BRANCHES, branches
