"""Load a recipe: YAML file (or the embedded default) + ``--set a.b=value`` overrides.

Overrides are applied to the plain data *before* it is mapped onto the dataclasses, so an
override obeys exactly the same strict checks as the file (unknown key, wrong type).
Values are YAML-parsed: ``--set train.steps=10`` is an int, ``--set data.paths=[a.txt]`` a list.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from plait.train.config import Recipe, from_dict

__all__ = ["RECIPES_DIR", "apply_overrides", "load_recipe", "parse_override", "resolve_recipe_path"]

RECIPES_DIR = Path(__file__).resolve().parent / "shipped_recipes"
"""The shipped recipes (inside the package, so the wheel carries them)."""


class _Loader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that also reads ``1e-3`` (no dot, YAML 1.1 says string) as a float."""


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
    return parts, value


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Return a copy of ``data`` with each ``a.b=value`` override applied (nested dicts created)."""
    out = _deepcopy(data)
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


def load_recipe(path: str | None = None, overrides: list[str] | None = None) -> Recipe:
    """Load ``path`` (None = the embedded default recipe), apply overrides, map strictly."""
    data: Any = {}
    if path is not None:
        file = resolve_recipe_path(path)
        try:
            data = _yaml(file.read_text()) or {}
        except yaml.YAMLError as err:
            raise ValueError(f"recipe {str(file)!r} is not valid YAML: {err}".replace("\n", " ")) from None
        if not isinstance(data, dict):
            raise TypeError(
                f"recipe {str(file)!r} must be a mapping at the top level, got {type(data).__name__}"
            )
    return from_dict(Recipe, apply_overrides(data, overrides or []))


def _deepcopy(data: Any) -> Any:
    if isinstance(data, dict):
        return {k: _deepcopy(v) for k, v in data.items()}
    if isinstance(data, list):
        return [_deepcopy(v) for v in data]
    return data
