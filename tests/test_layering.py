"""The layering, enforced: ``models`` imports neither ``parallelisms`` nor ``trainer``,
``parallelisms`` does not import ``trainer``, and no import cycle exists anywhere in the product.

Every import counts: module level, inside functions (lazy imports), under ``TYPE_CHECKING``,
relative (``from . import x``, ``from ..data import y``). An edge goes to the module that the
import names: ``from a.b import c`` is an edge to ``a.b.c`` when that is a module, else to ``a.b``.
Run with ``-s`` to see the number of cycles found.
"""

from __future__ import annotations

import ast
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PRODUCT_PACKAGES = ("models", "parallelisms", "trainer")
# (importer package, packages it must never import)
FORBIDDEN = {"models": ("parallelisms", "trainer"), "parallelisms": ("trainer",)}


def module_files(root: Path, packages: tuple[str, ...]) -> dict[str, Path]:
    """Dotted module name -> file, for every ``.py`` under the given top-level packages."""
    modules = {}
    for pkg in packages:
        for path in sorted((root / pkg).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join(parts)] = path
    return modules


def _resolve_from(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join([*base, node.module] if node.module else base)


def imports_of(module: str, path: Path, known: set[str]) -> set[str]:
    """The product modules ``module`` imports (any depth in the file; lazy imports included)."""
    is_package = path.name == "__init__.py"
    found: set[str] = set()

    def add(name: str) -> None:
        # the longest known prefix: importing a.b.c where only a.b is a product module
        parts = name.split(".")
        for n in range(len(parts), 0, -1):
            if ".".join(parts[:n]) in known:
                found.add(".".join(parts[:n]))
                return

    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            target = _resolve_from(module, is_package, node)
            for alias in node.names:
                sub = f"{target}.{alias.name}" if target else alias.name
                add(sub if sub in known else target)
    found.discard(module)
    return found


def import_graph(root: Path, packages: tuple[str, ...]) -> dict[str, set[str]]:
    files = module_files(root, packages)
    known = set(files)
    return {mod: imports_of(mod, path, known) for mod, path in files.items()}


def _strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm, iterative; components of more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                comp = []
                while True:
                    top = stack.pop()
                    on_stack.discard(top)
                    comp.append(top)
                    if top == node:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def _chain(graph: dict[str, set[str]], component: list[str]) -> list[str]:
    """One cycle through the component's first module, as a chain a -> b -> ... -> a."""
    members, start = set(component), component[0]
    paths = {start: [start]}
    frontier = [start]
    while frontier:  # breadth-first: the shortest way back to start
        nxt = []
        for node in frontier:
            for child in sorted(graph[node] & members):
                if child == start:
                    return [*paths[node], start]
                if child not in paths:
                    paths[child] = [*paths[node], child]
                    nxt.append(child)
        frontier = nxt
    return component


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One chain per import cycle (per strongly connected component of the graph)."""
    return [_chain(graph, comp) for comp in _strongly_connected(graph)]


def _describe(graph: dict[str, set[str]], chain: list[str]) -> str:
    comp = next(c for c in _strongly_connected(graph) if chain[0] in c)
    extra = sorted(set(comp) - set(chain))
    return " -> ".join(chain) + (f"  (same knot: {', '.join(extra)})" if extra else "")


def layer_violations(graph: dict[str, set[str]]) -> list[str]:
    bad = []
    for mod, targets in sorted(graph.items()):
        banned = FORBIDDEN.get(mod.split(".")[0], ())
        for target in sorted(targets):
            if target.split(".")[0] in banned:
                bad.append(f"{mod} imports {target}")
    return bad


def test_layers_point_one_way() -> None:
    violations = layer_violations(import_graph(REPO, PRODUCT_PACKAGES))
    assert not violations, "layering broken:\n" + "\n".join(violations)


def test_no_import_cycle_in_the_product() -> None:
    graph = import_graph(REPO, PRODUCT_PACKAGES)
    cycles = find_cycles(graph)
    print(
        f"\nlayering: {len(graph)} product modules, "
        f"{sum(len(v) for v in graph.values())} import edges, {len(cycles)} import cycles"
    )
    for chain in cycles:
        print("  cycle: " + _describe(graph, chain))
    assert not cycles, "import cycles:\n" + "\n".join(_describe(graph, c) for c in cycles)


def _write_package(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text), encoding="utf-8")


def test_checker_reports_an_added_cycle_and_a_layer_violation(tmp_path: Path) -> None:
    """The checker itself: a synthetic product with a lazy relative-import cycle, a package-level
    cycle through ``from . import x``, and a model importing the trainer."""
    _write_package(
        tmp_path,
        {
            "models/__init__.py": "",
            "models/a.py": "from models import b\n",
            "models/b.py": "def f():\n    from .a import thing  # lazy\n",
            "models/c.py": "import trainer.loop\n",
            "trainer/__init__.py": "from . import loop\n",
            "trainer/loop.py": "from trainer import helpers\n",
            "trainer/helpers.py": "import trainer\n",
            "parallelisms/__init__.py": "",
            "parallelisms/ok.py": "from models.a import x\n",
        },
    )
    graph = import_graph(tmp_path, PRODUCT_PACKAGES)
    assert graph["models.b"] == {"models.a"}
    cycles = find_cycles(graph)
    print("\nself-test: " + "; ".join(" -> ".join(c) for c in cycles))
    assert ["models.a", "models.b", "models.a"] in cycles
    assert ["trainer", "trainer.loop", "trainer.helpers", "trainer"] in cycles
    assert len(cycles) == 2
    assert layer_violations(graph) == ["models.c imports trainer.loop"]
    # and the real tree's checker fails once such a cycle exists: remove it and it passes
    (tmp_path / "models/b.py").write_text("", encoding="utf-8")
    assert len(find_cycles(import_graph(tmp_path, PRODUCT_PACKAGES))) == 1
