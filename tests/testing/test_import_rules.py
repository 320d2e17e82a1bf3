"""Across packages only public names: no ``_private`` module or name, and only what ``__all__`` lists.

Every .py file under packages/*/src, apps/*/src and tools/ is parsed (imports inside functions
included). An import of ``plait.X`` (or of a module inside it) from a file outside package X fails
(a) when the module path has a ``_private`` part or the imported name starts with ``_``, and (b) when
the imported name is not in ``plait.X.__all__`` (read from X's ``__init__.py``) or a module inside X
is imported whole. Tests are exempt: a white-box test may import its own package's internals.
"""

from __future__ import annotations

import ast
import functools
from collections.abc import Callable, Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SOURCES = ("packages/*/src/**/*.py", "apps/*/src/**/*.py", "tools/**/*.py")


def package_of(path: Path) -> str | None:
    """``X`` for a file of ``packages/*/src/plait/X`` or ``apps/*/src/plait/X``; ``None`` elsewhere (tools)."""
    parts = path.relative_to(ROOT).parts
    if len(parts) > 5 and parts[0] in ("packages", "apps") and parts[2:4] == ("src", "plait"):
        return parts[4]
    return None


def plait_imports(source: str) -> Iterator[tuple[int, str, str | None]]:
    """``(line, module, name)`` of every absolute import of plait; ``name`` is ``None`` for ``import plait.x``."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module == "plait" or node.module.startswith("plait."):
                yield from ((node.lineno, node.module, alias.name) for alias in node.names)
        elif isinstance(node, ast.Import):
            yield from ((node.lineno, a.name, None) for a in node.names if a.name.startswith("plait."))


@functools.cache
def exports(package: str) -> frozenset[str]:
    """The names ``plait.<package>.__all__`` lists, read from its ``__init__.py`` without importing it."""
    inits = [*ROOT.glob(f"packages/*/src/plait/{package}/__init__.py")]
    inits += ROOT.glob(f"apps/*/src/plait/{package}/__init__.py")
    assert len(inits) == 1, f"plait.{package}: expected one __init__.py, found {inits}"
    names: set[str] = set()
    for node in ast.walk(ast.parse(inits[0].read_text())):
        targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
        if any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets):
            names |= set(ast.literal_eval(node.value))  # type: ignore[attr-defined]
    return frozenset(names)


def violation(own: str | None, module: str, name: str | None, public: Callable[[str], frozenset[str]]) -> str:
    """Why this import breaks a rule, or ``""``; ``public(X)`` gives ``plait.X.__all__``."""
    parts = module.split(".")
    if len(parts) == 1:  # from plait import X: the package itself
        return "a private package" if (name or "").startswith("_") else ""
    target = parts[1]
    if target == own:
        return ""
    if any(p.startswith("_") for p in parts[1:]) or (name or "").startswith("_"):
        return "(a) a private module or name of another package"
    if name is None:
        return "(b) a module inside another package, imported whole" if len(parts) > 2 else ""
    if name not in public(target):
        return f"(b) {name} is not in plait.{target}.__all__"
    return ""


def violations(path: Path, public: Callable[[str], frozenset[str]] = exports) -> list[str]:
    """Every import of ``path`` that breaks a rule, as ``path:line: import ... (why)``."""
    own, found = package_of(path), []
    for line, module, name in plait_imports(path.read_text()):
        why = violation(own, module, name, public)
        if why:
            spelled = f"from {module} import {name}" if name else f"import {module}"
            found.append(f"{path.relative_to(ROOT)}:{line}: {spelled} ({why})")
    return found


def test_no_package_or_tool_imports_a_private_or_unexported_name_of_another_package() -> None:
    files = sorted({p for pattern in SOURCES for p in ROOT.glob(pattern)})
    assert len(files) > 50, files
    found = [v for path in files for v in violations(path)]
    assert not found, "imports across packages of names outside plait.X.__all__:\n" + "\n".join(found)


def test_the_rules_see_imports_inside_functions() -> None:
    source = (
        "import plait.tp\n"
        "from plait.tp import resolve_tp_plan\n"
        "def f():\n"
        "    from plait.tp.registry import model_class_plan\n"
        "    from plait.tp._styles import Style\n"
        "    from plait.tp import _helper\n"
        "    import plait.tp.registry\n"
        "    from plait.sidecar.dispatch import parallelize_model\n"
    )
    public = {"tp": frozenset({"resolve_tp_plan"}), "sidecar": frozenset({"parallelize_model"})}
    calls = [(line, violation("sidecar", module, name, public.__getitem__))
             for line, module, name in plait_imports(source)]  # fmt: skip
    assert [(line, why.split(" ")[0]) for line, why in calls if why] == [
        (4, "(b)"),
        (5, "(a)"),
        (6, "(a)"),
        (7, "(b)"),
    ]
    assert package_of(ROOT / "packages/sidecar/src/plait/sidecar/plan.py") == "sidecar"
    assert package_of(ROOT / "tools/pipeline_matrix.py") is None
    assert {"run_on_ranks", "run_cases"} <= exports("testing")
