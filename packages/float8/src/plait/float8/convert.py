"""The float8 step: convert the planned linears with torchao, and the per-step scale precompute.

torchao is imported only here, and only when float8 is asked for: without it, the plan's first
use raises one ImportError naming the extra to install.
"""

from __future__ import annotations

import dataclasses
import sys

from torch import nn

from plait.float8.plan import Float8Plan
from plait.float8.torchao_api import require_torchao

__all__ = ["apply_float8", "precompute_float8_scales", "torchao_config"]


def torchao_config(plan: Float8Plan) -> object:
    """torchao's ``Float8LinearConfig`` for the plan's recipe, emulation and float8 all-gather."""
    float8 = require_torchao()
    config = float8.Float8LinearConfig.from_recipe_name(plan.scaling)
    return dataclasses.replace(
        config, emulate=plan.emulate, enable_fsdp_float8_all_gather=plan.fsdp_all_gather
    )


def apply_float8(model: nn.Module, plan: Float8Plan) -> nn.Module:
    """Swap exactly the plan's linears for torchao's ``Float8Linear`` in place; returns ``model``.

    Runs before TP and FSDP: their styles and units then see the converted modules.

    Raises:
        ImportError: torchao is not installed (names the extra to install).
        ValueError: a planned module is not an ``nn.Linear`` any more (the model changed after planning).
    """
    float8 = require_torchao()
    wanted = set(plan.modules)
    found = {fqn for fqn, m in model.named_modules() if fqn in wanted and type(m) is nn.Linear}
    if found != wanted:
        raise ValueError(
            f"float8 plan names {sorted(wanted - found)}, which are not nn.Linear modules of "
            f"{type(model).__name__}; plan the model again (plan_parallelism) after changing it"
        )
    float8.convert_to_float8_training(
        model, module_filter_fn=lambda _, fqn: fqn in wanted, config=torchao_config(plan)
    )
    return model


def precompute_float8_scales(model: nn.Module) -> None:
    """After each ``optimizer.step()``: the float8 weight scales FSDP2's float8 all-gather uses next.

    One all-reduce for every weight instead of one per weight inside the all-gathers. Once called,
    it must be called after every step (the all-gather uses the scales it left). A no-op for a model
    without float8 all-gather weights (or without torchao), so plain loops may always call it.
    """
    float8 = sys.modules.get("torchao.float8")
    if float8 is None:
        # torchao.float8 never imported: no Float8Linear exists. Importing it here would cost every
        # run without float8 torchao's import time and its torch warnings.
        return
    float8.precompute_float8_dynamic_scale_for_fsdp(model)
