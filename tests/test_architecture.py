"""The package layout's import rule (docs/architecture.md): no import cycles between modules or packages,
and no upward import across layers. Every import counts, also those inside functions; `if TYPE_CHECKING:`
blocks are left out (they never run)."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = SRC / "leantrain"

# Layer of each top-level module or package of leantrain (docs/architecture.md); an import may go sideways
# or down, never up.
LAYERS = {
    "leantrain": 0, "errors": 0, "hardware": 0, "dtypes": 0, "spec": 0, "security": 0, "render": 0,
    "demo_context": 0, "rank0": 0,
    "plan": 1, "data": 1, "model": 1, "observe": 1,
    "parallel": 2,
    "provenance": 3,
    "train": 4, "ckpt": 4,
    "launch": 5,
    "golive": 6,
    "cli": 7, "demo": 7,
}
MAX_MODULE_LINES = 500


def _modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


class _ImportVisitor(ast.NodeVisitor):
    def __init__(self, module: str, *, is_package: bool, known: set[str]) -> None:
        self.module, self.is_package, self.known = module, is_package, known
        self.targets: set[str] = set()

    def visit_If(self, node: ast.If) -> None:
        test = node.test
        name = test.id if isinstance(test, ast.Name) else test.attr if isinstance(test, ast.Attribute) else ""
        if name == "TYPE_CHECKING":
            for child in node.orelse:
                self.visit(child)
            return
        self.generic_visit(node)

    def visit_Import(self, node: ast.Import) -> None:
        self.targets.update(alias.name for alias in node.names if alias.name in self.known)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.level:
            base = self.module.split(".")
            if not self.is_package:
                base = base[:-1]
            base = base[: len(base) - (node.level - 1)]
            prefix = ".".join(base + ([node.module] if node.module else []))
        else:
            prefix = node.module or ""
        candidates = [prefix, *(f"{prefix}.{alias.name}" for alias in node.names)]
        self.targets.update(name for name in candidates if name in self.known)


def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    graph = {}
    for name, path in modules.items():
        visitor = _ImportVisitor(name, is_package=path.name == "__init__.py", known=set(modules))
        visitor.visit(ast.parse(path.read_text(), filename=str(path)))
        graph[name] = visitor.targets - {name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one node (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph.get(root, ()))))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def _top(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    packages: dict[str, set[str]] = defaultdict(set)
    for module, targets in graph.items():
        for target in targets:
            if _top(target) != _top(module) and target != "leantrain":
                packages[_top(module)].add(_top(target))
    return packages


def test_cycle_finder_finds_a_planted_cycle() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_module_level_import_cycle() -> None:
    assert cycles(import_graph()) == []


def test_no_package_level_import_cycle() -> None:
    assert cycles(package_graph(import_graph())) == []


def test_every_top_level_module_has_a_layer() -> None:
    missing = sorted({_top(m) for m in _modules()} - set(LAYERS))
    assert not missing, f"add these to LAYERS and docs/architecture.md: {missing}"


def test_no_upward_import() -> None:
    upward = [
        f"{module} (layer {LAYERS[_top(module)]}) imports {target} (layer {LAYERS[_top(target)]})"
        for module, targets in sorted(import_graph().items())
        for target in sorted(targets)
        if LAYERS.get(_top(target), 0) > LAYERS.get(_top(module), 0)
    ]
    assert not upward, "\n".join(upward)


def test_modules_stay_small() -> None:
    sizes = {name: len(path.read_text().splitlines()) for name, path in _modules().items()}
    long = {name: n for name, n in sizes.items() if n > MAX_MODULE_LINES}
    assert not long, f"modules over {MAX_MODULE_LINES} lines: {long}"
