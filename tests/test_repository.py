"""Repository-wide rules: functions short enough to read at once, a repository that stands
alone (no file points outside it), every file, module and name the prose sends a reader to exists,
facts spelled once (the wrapper prefixes), and initial weights pinned bit for bit."""

from __future__ import annotations

import ast
import hashlib
import importlib
import io
import re
import tokenize
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
PRODUCT_DIRS = ("models", "parallelisms", "trainer", "benchmarks")
MAX_FUNCTION_LINES = 80


def _python_files(*dirs: str) -> list[Path]:
    return sorted(p for d in dirs for p in (REPO / d).rglob("*.py"))


def test_no_function_longer_than_80_lines() -> None:
    long = []
    for path in _python_files(*PRODUCT_DIRS):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(REPO)}:{node.lineno} {node.name} ({n} lines)")
    assert not long, "functions over 80 lines (split them into named steps):\n" + "\n".join(long)


def test_no_file_points_outside_the_repository() -> None:
    """A user who clones the repository has nothing else: no reference to a design file or
    folder that lives beside it."""
    pattern = re.compile(r"DESIGN\.md|\.\./shared|shared project folder")
    offenders = []
    for path in [
        *_python_files(*PRODUCT_DIRS, "tests"),
        *REPO.glob("*.md"),
        *(REPO / "docs").rglob("*.md"),
        *(REPO / "configs").rglob("*.yaml"),
        REPO / "launch.sh",
        *(REPO / "slurm").iterdir(),
    ]:
        if path.is_file() and path != Path(__file__) and pattern.search(path.read_text(encoding="utf-8")):
            offenders.append(str(path.relative_to(REPO)))
    assert not offenders, f"files pointing outside the repository: {offenders}"


# Files allowed to spell the wrapper prefixes themselves (none: every reader calls unwrapped_name).
WRAPPER_PREFIX_EXCEPTIONS: set[str] = set()


def test_wrapper_prefixes_are_spelled_once() -> None:
    """The compile / activation-checkpoint name components are defined once
    (``models.common.WRAPPER_PREFIXES``); every reader calls ``unwrapped_name``."""
    pattern = re.compile(r"[\"']_(orig_mod|checkpoint_wrapped_module)\.")
    offenders = [
        str(path.relative_to(REPO))
        for path in _python_files(*PRODUCT_DIRS, "tests")
        if path.relative_to(REPO).as_posix() not in {"models/common.py", *WRAPPER_PREFIX_EXCEPTIONS}
        and pattern.search(path.read_text(encoding="utf-8"))
    ]
    assert not offenders, (
        f"files spelling the wrapper prefixes (use models.common.unwrapped_name): {offenders}"
    )


def _prose() -> Iterator[tuple[Path, int, str]]:
    """(file, line, text) of every comment and string of the product, and every line of README.md
    and docs/*.md: where a reader is sent to a file or a name."""
    for path in _python_files(*PRODUCT_DIRS):
        source = path.read_text(encoding="utf-8")
        for tok in tokenize.generate_tokens(io.StringIO(source).readline):
            if tok.type in (tokenize.COMMENT, tokenize.STRING):
                yield path, tok.start[0], tok.string
    for path in [*REPO.glob("*.md"), *(REPO / "docs").rglob("*.md")]:
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            yield path, number, line


# A repository path: at least one folder, then a file name with an extension we ship.
_PATH = re.compile(r"(?<![\w./-])((?:[\w.-]+/)+[\w.-]*\w\.(?:py|md|yaml|sh))\b")
# Paths named on purpose that are not files of this repository.
PATH_EXCEPTIONS = {
    "torch/optim/_muon.py",  # torch's own source, which trainer/optim/muon.py follows
}


def test_named_file_paths_exist() -> None:
    """Every ``folder/file.py`` (.md, .yaml, .sh) a docstring, comment, README.md or docs/ names exists:
    from the repository root, from a top-level package (the tree in docs/architecture.md), or beside
    the file that names it."""
    missing = []
    for path, line, text in _prose():
        for match in _PATH.finditer(text):
            name = match.group(1)
            bases = (REPO, REPO / "models", REPO / "parallelisms", REPO / "trainer", path.parent)
            if name not in PATH_EXCEPTIONS and not any((base / name).exists() for base in bases):
                missing.append(f"{path.relative_to(REPO)}:{line}: {name}")
    assert not missing, "paths that name no file (fix the text, or list a deliberate one):\n" + "\n".join(
        missing
    )


# ``package.module.name`` references in prose; trainer.train_step() is a Trainer instance in examples.
_DOTTED = re.compile(r"(?<![\w./-])((?:models|parallelisms|trainer)(?:\.[A-Za-z_]\w*)+)")
DOTTED_EXCEPTIONS = {"trainer.train_step"}


def _resolves(reference: str) -> bool:
    """Whether ``reference`` is a module of the product, or a name (attribute, dataclass field) in one."""
    parts = reference.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            if not hasattr(obj, attr):
                return attr in getattr(obj, "__dataclass_fields__", {})
            obj = getattr(obj, attr)
        return True
    return False


def test_named_modules_and_names_exist() -> None:
    """Every ``trainer.x.y`` / ``models.x`` / ``parallelisms.x`` the prose names can be imported."""
    missing = sorted(
        {
            f"{path.relative_to(REPO)}:{line}: {ref}"
            for path, line, text in _prose()
            for ref in (m.group(1).rstrip(".") for m in _DOTTED.finditer(text))
            if not ref.endswith((".py", ".md", ".yaml"))
            and ref not in DOTTED_EXCEPTIONS
            and not _resolves(ref)
        }
    )
    assert not missing, "names that do not exist (fix the text):\n" + "\n".join(missing)


def test_architecture_doc_exists_and_is_linked() -> None:
    doc = REPO / "docs" / "architecture.md"
    assert doc.is_file()
    text = doc.read_text(encoding="utf-8")
    for seam in ("ModelSpec", "ParallelDims", "StepContext", "positions", "parallelize"):
        assert seam in text, seam
    assert "docs/architecture.md" in (REPO / "README.md").read_text(encoding="utf-8")


# sha256 over (name, fp32 bytes) of the debug preset's initial weights, seed 0, computed before
# the model-spec refactor: the per-module init must keep today's weights bit for bit. Pinned per
# ATen CPU kernel family: ``normal_`` fills a float tensor of >= 16 elements with a vectorised
# Box-Muller under the AVX2 and AVX-512 kernels and a scalar one under ``default``, and their
# last bits differ (measured: avx2 == avx512 != default). Other levels (e.g. ARM) are not pinned.
_VECTORISED = {
    False: "d71608e5254fba80ea2a04ab72dfb01132591edd6ba8ca6a2b97ec0ba6d83889",
    True: "cf54d4a9a6efe4572e252cf054b27de7eb0c0609113894542f5a7064555eb177",
}
DEBUG_INIT_SHA256 = {
    "AVX2": _VECTORISED,
    "AVX512": _VECTORISED,
    "DEFAULT": {
        False: "2c915f3d4134769003348fe4bf59f994589dead45125f61a6b273fac07fdafb3",
        True: "f81cb767f683a1ebea1579d8d8bfddaa0f2feef5be76cc1c8ca45fea2f137304",
    },
}


def test_debug_initial_weights_are_pinned() -> None:
    from models import get_spec
    from tests.configs import make_config

    level = torch.backends.cpu.get_cpu_capability()
    if level not in DEBUG_INIT_SHA256:
        pytest.skip(f"no pinned initial weights for ATen CPU capability {level}")
    for tie, expected in DEBUG_INIT_SHA256[level].items():
        cfg = make_config("model=debug", f"model.tie_embeddings={str(tie).lower()}")
        net = get_spec(cfg.model.family).build(cfg.model)
        net.init_weights(seed=0)
        digest = hashlib.sha256()
        for name, value in sorted(net.state_dict().items()):
            digest.update(name.encode())
            digest.update(value.to(torch.float32).contiguous().numpy().tobytes())
        assert digest.hexdigest() == expected, f"initial weights changed (tie_embeddings={tie}, {level})"
