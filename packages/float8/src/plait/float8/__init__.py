"""Float8 training as a model transform (torchao's ``Float8Linear``): the plan, the step, the TP styles."""

from plait.float8.convert import apply_float8, precompute_float8_scales, torchao_config
from plait.float8.plan import FLOAT8_ALIGNMENT, Float8Plan, plan_float8, resolve_emulate
from plait.float8.torchao_api import INSTALL_HINT, require_torchao
from plait.float8.tp import float8_tp_plan

__all__ = [
    "FLOAT8_ALIGNMENT",
    "INSTALL_HINT",
    "Float8Plan",
    "apply_float8",
    "float8_tp_plan",
    "plan_float8",
    "precompute_float8_scales",
    "require_torchao",
    "resolve_emulate",
    "torchao_config",
]
