"""The registries of named TP plans and per-model-class TP plans."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

__all__ = [
    "PlanFactory",
    "model_class_plan",
    "named_plan",
    "register_model_tp_plan",
    "register_tp_plan",
    "registered_plan_names",
]

PlanFactory = Callable[[nn.Module, bool], dict[str, Any]]
"""``(model, sequence_parallel) -> {fqn_pattern: ParallelStyle | str}``; must build fresh styles per call."""

_NAMED_PLANS: dict[str, PlanFactory] = {}
_MODEL_PLANS: dict[str, PlanFactory] = {}


def register_tp_plan(name: str, factory: PlanFactory) -> None:
    """Register a named plan, usable as ``tp_plan: <name>``; re-registering a name replaces it.

    Raises:
        ValueError: empty name or a name with ``:`` (reserved for import paths).
        TypeError: ``factory`` is not callable.
    """
    if not isinstance(name, str) or not name or ":" in name:
        raise ValueError(f"TP plan name must be a non-empty string without ':', got {name!r}")
    if not callable(factory):
        raise TypeError(
            f"TP plan factory for {name!r} must be callable (model, sequence_parallel), got {factory!r}"
        )
    _NAMED_PLANS[name] = factory


def register_model_tp_plan(class_name: str | type, factory: PlanFactory) -> None:
    """Register the plan for a model class, by qualified (``pkg.mod.Cls``) or bare (``Cls``) name.

    Raises:
        ValueError: empty class name.
        TypeError: ``factory`` is not callable.
    """
    key = f"{class_name.__module__}.{class_name.__qualname__}" if isinstance(class_name, type) else class_name
    if not isinstance(key, str) or not key:
        raise ValueError(f"model class name must be a non-empty string or a class, got {class_name!r}")
    if not callable(factory):
        raise TypeError(
            f"TP plan factory for {key!r} must be callable (model, sequence_parallel), got {factory!r}"
        )
    _MODEL_PLANS[key] = factory


def named_plan(name: str) -> PlanFactory | None:
    """The factory registered under ``name``, or ``None``."""
    return _NAMED_PLANS.get(name)


def registered_plan_names() -> list[str]:
    """The registered plan names, sorted."""
    return sorted(_NAMED_PLANS)


def model_class_plan(model: nn.Module) -> PlanFactory | None:
    """The factory registered for ``model``'s class (qualified name first, then the bare name), or ``None``."""
    cls = type(model)
    return _MODEL_PLANS.get(f"{cls.__module__}.{cls.__qualname__}") or _MODEL_PLANS.get(cls.__name__)
