"""Training app: recipes, models, data, checkpoints and the torchrun entry point.

The names below are for tools and dev packages (``plait.testing``'s memory probe, the planner's
measurement tools); they load on first use, so ``import plait.train`` stays cheap.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["Trainer", "auto_plan", "check_recipe", "layout_of_recipe", "load_recipe", "shape_of"]

_LAZY = {
    "Trainer": "plait.train.trainer",
    "auto_plan": "plait.train.plan_auto",
    "check_recipe": "plait.train.setup",
    "layout_of_recipe": "plait.train.plan_auto",
    "load_recipe": "plait.train.recipes",
    "shape_of": "plait.train.plan_auto",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'plait.train' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
