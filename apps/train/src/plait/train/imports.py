"""What a recipe may import: registered names by default, ``pkg.mod:ATTR`` paths only when allowed.

A recipe is data, but some of its values name code: ``parallel.options.tp_plan: "pkg.mod:ATTR"``
imports a module and calls what it names, ``parallel.options.unit_modules`` imports classes.
Importing a module runs it, so a recipe from someone else could run anything. Such paths are
refused unless the command line says ``--allow-imports``; registered plan names and built-in
values need no switch. The working directory is never importable (``python -m`` would put it
first on ``sys.path``): a module a recipe imports must be installed or on ``PYTHONPATH``.
"""

from __future__ import annotations

import os
import re
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from plait.train.config import Recipe

__all__ = ["ALLOW_IMPORTS_FLAG", "check_recipe_imports", "drop_implicit_cwd", "recipe_import_paths"]

ALLOW_IMPORTS_FLAG = "--allow-imports"
_IMPORT_PATH = re.compile(r"^\s*[A-Za-z_][\w.]*\s*:\s*[A-Za-z_][\w.]*\s*$")
_CLASS_LISTS = ("unit_modules",)
"""Options whose every string entry is a class import path (``pkg.mod.Class`` or ``pkg.mod:Class``)."""


def recipe_import_paths(recipe: Recipe) -> list[tuple[str, str]]:
    """``(recipe key, import path)`` of every value of the recipe that would import a module."""
    found: list[tuple[str, str]] = []
    _walk(recipe.parallel.options, "parallel.options", False, found)
    return found


def _walk(value: Any, key: str, class_list: bool, found: list[tuple[str, str]]) -> None:
    if isinstance(value, dict):
        for k, v in value.items():
            _walk(v, f"{key}.{k}", str(k) in _CLASS_LISTS, found)
    elif isinstance(value, list | tuple):
        for i, v in enumerate(value):
            _walk(v, f"{key}[{i}]", class_list, found)
    elif isinstance(value, str) and (class_list or _IMPORT_PATH.match(value)):
        found.append((key, value))


def check_recipe_imports(recipe: Recipe, *, allow_imports: bool) -> None:
    """Refuse the recipe's import paths unless ``allow_imports``.

    Raises:
        ValueError: the first import path, with its key and the switch that allows it.
    """
    paths = recipe_import_paths(recipe)
    if paths and not allow_imports:
        key, path = paths[0]
        more = f" (and {len(paths) - 1} more)" if len(paths) > 1 else ""
        raise ValueError(
            f"{key} {path!r} is an import path{more}: importing it would run code the recipe names; "
            f"use a registered name, or pass {ALLOW_IMPORTS_FLAG} if you trust this recipe "
            "(the module must be installed or on PYTHONPATH; the working directory is never importable)"
        )


def drop_implicit_cwd() -> None:
    """Remove the working directory ``python -m`` put first on ``sys.path`` (nothing under ``-P``)."""
    if not sys.flags.safe_path and sys.path and sys.path[0] in ("", os.getcwd()):
        del sys.path[0]
