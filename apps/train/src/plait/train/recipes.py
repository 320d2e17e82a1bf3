"""Load a recipe: YAML file (or the embedded default) + ``--set a.b=value`` overrides.

Overrides are applied to the plain data *before* it is mapped onto the dataclasses, so an
override obeys exactly the same strict checks as the file (unknown key, wrong type).
Values are YAML-parsed: ``--set train.steps=10`` is an int, ``--set data.paths=[a.txt]`` a list.

The YAML loader refuses what a recipe never needs and an attacker could use: aliases (``*name``,
so no "billion laughs" expansion), duplicate keys (YAML would silently keep the last), and nesting
deeper than :data:`MAX_DEPTH` (before Python's recursion limit is reached).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

if TYPE_CHECKING:
    from plait.train.config import Recipe

__all__ = [
    "MAX_DEPTH",
    "RECIPES_DIR",
    "apply_overrides",
    "load_recipe",
    "parse_override",
    "resolve_recipe_path",
]

RECIPES_DIR = Path(__file__).resolve().parent / "shipped_recipes"
"""The shipped recipes (inside the package, so the wheel carries them)."""

MAX_DEPTH = 32
"""Deepest nesting of mappings and lists a recipe may have (the shipped ones use 4)."""


class _Loader(yaml.SafeLoader):
    """``yaml.SafeLoader`` without aliases or duplicate keys, bounded in depth; reads ``1e-3`` as a float."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._depth = 0

    def compose_node(self, parent: yaml.Node | None, index: object) -> yaml.Node | None:
        if self.check_event(yaml.AliasEvent):
            mark = self.peek_event().start_mark
            raise ValueError(
                f"line {mark.line + 1}: YAML aliases (*{self.peek_event().anchor}) are not allowed in a "
                "recipe; write the value out"
            )
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH:
                mark = self.peek_event().start_mark
                raise ValueError(f"line {mark.line + 1}: nesting deeper than {MAX_DEPTH} levels")
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            if not isinstance(key, str | int | float | bool | None):
                continue  # unhashable keys: SafeLoader's own error
            if key in seen:
                raise ValueError(f"line {line}: duplicate key {key!r} (first at line {seen[key]})")
            seen[key] = line
        return super().construct_mapping(node, deep=deep)


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def _yaml(text: str) -> Any:
    return yaml.load(text, Loader=_Loader)  # a SafeLoader subclass: no arbitrary objects


def parse_override(text: str) -> tuple[list[str], Any]:
    """Split ``a.b=value`` into the key path and the YAML-parsed value."""
    key, sep, raw = text.partition("=")
    parts = key.strip().split(".")
    if not sep or not all(parts):
        raise ValueError(f"--set expects KEY.PATH=VALUE (e.g. train.steps=10), got {text!r}")
    try:
        value = _yaml(raw) if raw.strip() else ""
    except yaml.YAMLError as err:
        raise ValueError(f"--set {key}: value {raw!r} is not valid YAML ({err.__class__.__name__})") from None
    except ValueError as err:
        raise ValueError(f"--set {key}: {err}") from None
    return parts, value


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Return a copy of ``data`` with each ``a.b=value`` override applied (nested dicts created)."""
    out = _copy(data)
    for text in overrides:
        parts, value = parse_override(text)
        node = out
        for i, part in enumerate(parts[:-1]):
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                where = ".".join(parts[: i + 1])
                raise TypeError(f"--set {'.'.join(parts)}: '{where}' is {child!r}, not a mapping")
            node = child
        node[parts[-1]] = value
    return out


def resolve_recipe_path(name: str) -> Path:
    """A recipe path as given, or a bare name looked up in the shipped recipes directory."""
    path = Path(name)
    if path.is_file():
        return path
    for candidate in (RECIPES_DIR / name, RECIPES_DIR / f"{name}.yaml"):
        if candidate.is_file():
            return candidate
    shipped = sorted(p.stem for p in RECIPES_DIR.glob("*.yaml")) if RECIPES_DIR.is_dir() else []
    raise ValueError(
        f"recipe {name!r} not found; give a YAML path or one of: {', '.join(shipped) or '(none)'}"
    )


def _read(file: Path) -> dict[str, Any]:
    try:
        data = _yaml(file.read_text(encoding="utf-8")) or {}
    except yaml.YAMLError as err:
        raise ValueError(f"recipe {str(file)!r} is not valid YAML: {err}".replace("\n", " ")) from None
    except UnicodeDecodeError:
        raise  # a ValueError too, but the CLI names the byte and the fix (plait.train.errors)
    except ValueError as err:
        raise ValueError(f"recipe {str(file)!r}, {err}") from None
    if not isinstance(data, dict):
        raise TypeError(f"recipe {str(file)!r} must be a mapping at the top level, got {type(data).__name__}")
    return data


def load_recipe(path: str | None = None, overrides: list[str] | None = None) -> Recipe:
    """Load ``path`` (None = the embedded default recipe), apply overrides, map strictly."""
    from plait.train.config import recipe_from_dict  # here: listing recipes does not import torch

    data = _read(resolve_recipe_path(path)) if path is not None else {}
    return recipe_from_dict(apply_overrides(data, overrides or []))


def _copy(data: Any) -> Any:
    """A copy of the loaded tree (alias-free and depth-bounded, so this is linear in its size)."""
    if isinstance(data, dict):
        return {k: _copy(v) for k, v in data.items()}
    if isinstance(data, list):
        return [_copy(v) for v in data]
    return data
