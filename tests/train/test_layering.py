"""The app's modules import one way: no cycle among plait.train's modules, the entry point on top.

Every import counts, the ones inside functions and under ``TYPE_CHECKING`` too: a lazy import
back up (``rank_server`` importing ``cli`` to call ``main``) is still a cycle; a lower module that
must call back up is passed the callable instead.
"""

from __future__ import annotations

import ast
from pathlib import Path

import plait.train

PACKAGE = "plait.train"


def _module_name(path: Path, root: Path) -> str:
    parts = [PACKAGE, *path.relative_to(root).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported(node: ast.Import | ast.ImportFrom, module: str, is_package: bool) -> list[str]:
    """The dotted names ``node`` imports in ``module`` (a ``from`` import also names each attribute)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    if node.level:
        anchor = module.split(".")[: len(module.split(".")) - node.level + (1 if is_package else 0)]
        base = ".".join([*anchor, *([base] if base else [])])
    return [base, *(f"{base}.{alias.name}" for alias in node.names)]


def import_graph(root: Path) -> dict[str, set[str]]:
    """``module -> the app modules it imports`` for every module of the package in ``root``."""
    files = {_module_name(path, root): path for path in sorted(root.rglob("*.py"))}
    graph: dict[str, set[str]] = {}
    for module, path in files.items():
        is_package = path.name == "__init__.py"
        edges = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import | ast.ImportFrom):
                edges |= {name for name in _imported(node, module, is_package) if name in files}
        edges.discard(module)
        graph[module] = edges - {m for m in edges if module.startswith(f"{m}.")}  # parent packages
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph`` (``[a, b, ..., a]``), or None."""
    done: set[str] = set()

    def visit(module: str, path: list[str]) -> list[str] | None:
        if module in path:
            return [*path[path.index(module) :], module]
        if module in done:
            return None
        for target in sorted(graph[module]):
            cycle = visit(target, [*path, module])
            if cycle is not None:
                return cycle
        done.add(module)
        return None

    for module in sorted(graph):
        cycle = visit(module, [])
        if cycle is not None:
            return cycle
    return None


def _app_graph() -> dict[str, set[str]]:
    return import_graph(Path(plait.train.__file__).parent)


def test_the_app_modules_import_without_a_cycle() -> None:
    cycle = find_cycle(_app_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_the_command_line_is_the_top_and_the_rank_server_imports_no_app_module() -> None:
    graph = _app_graph()
    assert {m for m, targets in graph.items() if f"{PACKAGE}.cli" in targets} == {f"{PACKAGE}.__main__"}
    # the launcher imports it before it starts the server: nothing of the app, nothing heavy
    assert graph[f"{PACKAGE}.rank_server"] == set()


def test_the_checker_finds_a_cycle_through_an_import_inside_a_function(tmp_path: Path) -> None:
    (tmp_path / "__init__.py").write_text("")
    (tmp_path / "top.py").write_text("from plait.train.low import helper\n")
    (tmp_path / "low.py").write_text("def helper():\n    from plait.train import top\n")
    graph = import_graph(tmp_path)
    top, low = f"{PACKAGE}.top", f"{PACKAGE}.low"
    assert graph == {PACKAGE: set(), top: {low}, low: {top}}
    assert find_cycle(graph) == [low, top, low]
