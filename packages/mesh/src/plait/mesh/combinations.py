"""The combination table: which axes, strategies, techniques and model features plait builds together.

One table answers "is this combination built?" for every caller: `plan_meshes` (sizes against the
strategy, before any mesh exists), `plait.sidecar.plan_parallelism` (the whole request, with the
model's features) and the training app's recipe checks (``plait-train validate`` / ``plan``). A
request is reduced to a set of *items*; a rule refuses every request holding all of its items. What
no rule refuses is built, and a test generated from this table names the parity test that covers
each built pair.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from itertools import combinations
from typing import TYPE_CHECKING

from plait.mesh.configs import FSDP2Config
from plait.mesh.sizes import ParallelismSizes
from plait.mesh.strategy import StrategyConfig, strategy_name

if TYPE_CHECKING:
    from plait.mesh.context import MeshContext

__all__ = [
    "AXES",
    "COMBINATION_RULES",
    "FEATURES",
    "STRATEGIES",
    "TECHNIQUES",
    "CombinationRequest",
    "CombinationRule",
    "check_combination",
    "combination_request",
    "context_request",
    "refusal_of",
    "table_pairs",
]

AXES: tuple[str, ...] = ("dp_replicate", "dp_shard", "cp", "tp", "sp", "ep", "pp")
"""Mesh axes (and sequence parallel, which rides on tp) that are present when larger than 1."""
STRATEGIES: tuple[str, ...] = ("fsdp2", "ddp", "megatron_fsdp")
TECHNIQUES: tuple[str, ...] = ("ac_full", "ac_selective", "compile", "async_tp", "float8", "float8_rowwise")
"""``float8``: ``FSDP2Config.float8`` is set; ``float8_rowwise``: with ``scaling='rowwise'`` (holds ``float8`` too)."""
FEATURES: tuple[str, ...] = ("moe", "multimodal")
"""Model features the planner reads off the model (an experts block; a vision/audio tower)."""
EXCLUSIVE: tuple[frozenset[str], ...] = (
    frozenset({"fsdp2", "ddp"}),
    frozenset({"fsdp2", "megatron_fsdp"}),
    frozenset({"ddp", "megatron_fsdp"}),
    frozenset({"ac_full", "ac_selective"}),
)
"""Pairs no request can hold (one strategy, one checkpointing mode)."""


@dataclass(frozen=True)
class CombinationRule:
    """Requests holding every item of ``items`` are refused with ``reason`` and ``fix``."""

    items: frozenset[str]
    reason: str
    fix: str
    layout: bool = False
    """The meshes themselves cannot be laid out (checked by `plan_meshes`); else the flow refuses it."""


def _rule(items: Iterable[str], reason: str, fix: str, *, layout: bool = False) -> CombinationRule:
    return CombinationRule(frozenset(items), reason, fix, layout)


_DDP_FIX = "use FSDP2Config (strategy fsdp2) or set it to 1"
_FLOAT8_OFF = "turn float8 off (FSDP2Config.float8=None)"
_FLOAT8_RULES: tuple[CombinationRule, ...] = (
    *(
        _rule(
            {strategy, "float8"},
            "float8 is a step of the FSDP2 flow only (FSDP2Config.float8)",
            f"use FSDP2Config (strategy fsdp2) or {_FLOAT8_OFF}",
        )
        for strategy in ("ddp", "megatron_fsdp")
    ),
    _rule(
        {"float8_rowwise", "tp"},
        "torchao's float8 TP styles cast with one tensorwise scale",
        "set Float8Config.scaling='tensorwise' or tp_size to 1",
    ),
    _rule(
        {"float8", "sp"},
        "under sequence parallel torchao's float8 TP styles all-gather float8 gradients, which gloo cannot "
        "carry, so no parity run of it exists (it needs >= 2 CUDA GPUs)",
        f"set sequence_parallel to False or {_FLOAT8_OFF}",
    ),
    _rule(
        {"float8", "cp"},
        "float8 with context parallel has no parity run yet",
        f"set cp_size to 1 or {_FLOAT8_OFF}",
    ),
    _rule(
        {"float8", "ep"},
        "float8 expert weights (grouped GEMMs) are not built",
        f"set ep_size to 1 or {_FLOAT8_OFF}",
    ),
    _rule(
        {"float8", "moe"},
        "float8 expert weights (grouped GEMMs) are not built, and no parity run covers float8 MoE layers",
        _FLOAT8_OFF,
    ),
    _rule(
        {"float8", "pp"},
        "the float8 transform is not built into the pipeline path (stages are pruned copies of the model)",
        f"set pp_size to 1 or {_FLOAT8_OFF}",
    ),
    _rule(
        {"float8", "multimodal"},
        "float8 with frozen or sharded media towers has no parity run yet",
        _FLOAT8_OFF,
    ),
)
_MEGATRON_FIX = "use FSDP2Config (strategy fsdp2) or set it to 1"
COMBINATION_RULES: tuple[CombinationRule, ...] = (
    *(
        _rule({"ddp", axis}, f"DDP replicates the whole model; it has no {axis} axis", _DDP_FIX, layout=True)
        for axis in ("dp_replicate", "tp", "sp", "cp", "ep", "pp")
    ),
    _rule(
        {"ddp", "compile"}, "per-layer compile is built for FSDP2 only", "use FSDP2Config or turn compile off"
    ),
    *(
        _rule(
            {"megatron_fsdp", axis},
            f"its mesh is (dp, cp, tp), with no {axis} axis",
            _MEGATRON_FIX,
            layout=True,
        )
        for axis in ("dp_replicate", "ep", "pp")
    ),
    _rule({"megatron_fsdp", "sp"}, "Megatron-FSDP is not built with sequence parallel here", _MEGATRON_FIX),
    *(
        _rule(
            {"megatron_fsdp", item},
            "no parity run of it exists yet (the megatron-fsdp package needs >= 2 CUDA GPUs, none was lent)",
            "use FSDP2Config (strategy fsdp2), which builds it, or turn it off",
        )
        for item in ("tp", "ac_full", "ac_selective")
    ),
    _rule(
        {"megatron_fsdp", "cp"},
        "plait's context-parallel attention is built into the FSDP2 flow only",
        _MEGATRON_FIX,
    ),
    _rule(
        {"megatron_fsdp", "compile"},
        "per-layer compile is built for FSDP2 only",
        "use FSDP2Config or turn compile off",
    ),
    _rule(
        {"ep", "async_tp"},
        "no parity run of it exists yet (async TP needs >= 2 CUDA GPUs, none was lent)",
        "turn async TP off",
    ),
    _rule({"pp", "multimodal"}, "pipeline stages split decoders only", "set pp_size to 1"),
    _rule({"cp", "multimodal"}, "media tokens are not sequence-sharded", "set cp_size to 1"),
    *_FLOAT8_RULES,
)
"""Every refusal of a combination, in the order they are reported (the first that applies)."""


_STRATEGY_NAMES = {"fsdp2": "FSDP2", "ddp": "DDP", "megatron_fsdp": "Megatron-FSDP"}


@dataclass(frozen=True)
class CombinationRequest:
    """What a job asks for, reduced to items, with the value behind each item for messages."""

    items: frozenset[str]
    values: dict[str, str] = field(default_factory=dict, compare=False)

    def describe(self, item: str) -> str:
        """``cp_size=2``, ``strategy ddp``: the setting behind ``item``."""
        return self.values.get(item, item)


def combination_request(
    strategy_config: StrategyConfig,
    sizes: ParallelismSizes,
    *,
    activation_checkpointing: str | bool = False,
    features: Iterable[str] = (),
    compile: bool | None = None,
) -> CombinationRequest:
    """Reduce a strategy, resolved sizes, the AC mode and model features to a request.

    ``compile``: per-layer compile asked for outside the config (a recipe's ``parallel.compile``);
    None = the config's ``enable_compile`` (only ``FSDP2Config`` has one).
    """
    strategy = strategy_name(strategy_config)
    values = {strategy: _STRATEGY_NAMES[strategy]}
    for axis in ("dp_replicate", "cp", "tp", "ep", "pp"):
        size = getattr(sizes, f"{axis}_size") or 1
        if size > 1:
            values[axis] = f"{axis}_size={size}"
    resolved = sizes.dp_size is not None
    dp_shard = sizes.dp_shard_size if strategy == "fsdp2" and resolved else (sizes.dp_size or 1)
    if dp_shard > 1:
        values["dp_shard"] = f"data parallel over {dp_shard} ranks"
    if getattr(strategy_config, "sequence_parallel", False) and (sizes.tp_size or 1) > 1:
        values["sp"] = "sequence_parallel=True"
    if getattr(strategy_config, "enable_async_tensor_parallel", False) and (sizes.tp_size or 1) > 1:
        values["async_tp"] = "enable_async_tensor_parallel=True"
    if compile is None:
        compile = isinstance(strategy_config, FSDP2Config) and strategy_config.enable_compile
    if compile:
        values["compile"] = "enable_compile=True"
    float8 = strategy_config.float8 if isinstance(strategy_config, FSDP2Config) else None
    if float8 is not None:
        values["float8"] = f"float8 (scaling={float8.scaling!r})"
        if float8.scaling == "rowwise":
            values["float8_rowwise"] = "Float8Config.scaling='rowwise'"
    if activation_checkpointing:
        mode = "full" if activation_checkpointing is True else str(activation_checkpointing)
        values[f"ac_{mode}"] = f"activation_checkpointing={mode!r}"
    for feature in features:
        values[feature] = {"moe": "an MoE model", "multimodal": "a multimodal model"}.get(feature, feature)
    return CombinationRequest(frozenset(values), values)


def context_request(mesh_context: MeshContext, *, features: Iterable[str] = ()) -> CombinationRequest:
    """The request a built `MeshContext` makes (its meshes, configs and AC mode), with model features."""
    sizes = ParallelismSizes(
        dp_size=mesh_context.dp_size,
        dp_replicate_size=mesh_context.dp_replicate_size or 1,
        tp_size=mesh_context.tp_size,
        pp_size=mesh_context.pp_size,
        cp_size=mesh_context.cp_size,
        ep_size=mesh_context.ep_size,
    )
    return combination_request(
        mesh_context.strategy_config,
        sizes,
        activation_checkpointing=mesh_context.activation_checkpointing,
        features=features,
    )


def refusal_of(request: CombinationRequest, *, layout_only: bool = False) -> str | None:
    """The one-line refusal of the first rule ``request`` meets, or None when it is built.

    ``layout_only``: only the rules that forbid laying the meshes out (what `plan_meshes` checks).
    """
    for rule in COMBINATION_RULES:
        if rule.items <= request.items and (rule.layout or not layout_only):
            items = _ordered(rule.items)
            if items[0] in STRATEGIES:
                rest = " with ".join(request.describe(item) for item in items[1:])
                return f"{request.describe(items[0])} does not support {rest}: {rule.reason}; {rule.fix}"
            what = " with ".join(request.describe(item) for item in items)
            return f"{what} is not supported: {rule.reason}; {rule.fix}"
    return None


def check_combination(request: CombinationRequest, *, layout_only: bool = False) -> None:
    """Raise the table's refusal for ``request`` (ValueError, one line); needs no process group."""
    message = refusal_of(request, layout_only=layout_only)
    if message is not None:
        raise ValueError(message)


def _ordered(items: Iterable[str]) -> list[str]:
    order = {name: i for i, name in enumerate((*STRATEGIES, *AXES, *TECHNIQUES, *FEATURES))}
    return sorted(items, key=lambda item: order.get(item, len(order)))


def table_pairs() -> list[frozenset[str]]:
    """Every pair of axes, strategies and techniques (not async TP) a request can hold."""
    universe = (*AXES, *STRATEGIES, "ac_full", "ac_selective", "compile", "float8")
    return [frozenset(pair) for pair in combinations(universe, 2) if frozenset(pair) not in EXCLUSIVE]
