"""`plan_float8`: which linears become float8, and why the others do not — decided before anything changes.

Pure: it reads the model's structure (meta tensors are fine) and the TP plan and calls no
collective, so ``plait-train validate`` / ``plan`` reach the same decision as the ranks. It checks
that torchao imports, so a missing torchao is refused here, before anything changes.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Any

from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

from plait.float8.torchao_api import require_torchao
from plait.mesh import Float8Config

__all__ = ["FLOAT8_ALIGNMENT", "Float8Plan", "plan_float8", "resolve_emulate"]

FLOAT8_ALIGNMENT = 16
"""Float8 matmuls (``torch._scaled_mm``) need both dims of each weight a multiple of 16."""

_ROUTER_NAMES = ("gate", "router")
"""Children of a block with ``experts`` that route tokens (kept in high precision)."""


@dataclass(frozen=True)
class Float8Plan:
    """The float8 decision for one model: the recipe and exactly which linears are converted."""

    scaling: str
    """``tensorwise`` or ``rowwise``."""
    emulate: bool
    """Float8 matmuls emulated in high precision (CPU) instead of ``torch._scaled_mm``."""
    fsdp_all_gather: bool
    """FSDP2 all-gathers the converted weights in float8 (``precompute_float8_scales`` after each step)."""
    modules: tuple[str, ...]
    """FQNs of the ``nn.Linear`` modules converted to torchao's ``Float8Linear``, in model order."""
    skipped: tuple[tuple[str, str], ...] = ()
    """``(fqn, reason)`` for every ``nn.Linear`` left in high precision."""

    def describe(self) -> dict[str, Any]:
        """Every decision as plain values (what ``plait-train plan`` prints); layer indices become ``*``."""
        converted: dict[str, int] = {}
        for fqn in self.modules:
            converted[_layer_pattern(fqn)] = converted.get(_layer_pattern(fqn), 0) + 1
        skipped: dict[str, str] = {}
        for fqn, reason in self.skipped:
            skipped.setdefault(_layer_pattern(fqn), reason)
        return {
            "scaling": self.scaling,
            "emulate": self.emulate,
            "fsdp_all_gather": self.fsdp_all_gather,
            "converted": {pattern: f"{n} module{'s' * (n > 1)}" for pattern, n in converted.items()},
            "skipped": skipped,
        }


def _layer_pattern(fqn: str) -> str:
    """``model.layers.3.mlp.up_proj`` -> ``model.layers.*.mlp.up_proj``."""
    return ".".join("*" if part.isdigit() else part for part in fqn.split("."))


def resolve_emulate(config: Float8Config, device_type: str) -> bool:
    """``config.emulate``, or (None) True on a CPU mesh and False on CUDA.

    Raises:
        ValueError: ``emulate=False`` on a mesh that is not CUDA (float8 matmuls need CUDA sm89+).
    """
    if config.emulate is None:
        return device_type != "cuda"
    if not config.emulate and device_type != "cuda":
        raise ValueError(
            f"Float8Config.emulate=False on a {device_type} mesh: hardware float8 matmuls need CUDA "
            "(sm89+); set emulate=True (or leave it None) or run on CUDA"
        )
    return config.emulate


def plan_float8(
    model: nn.Module,
    config: Float8Config,
    *,
    device_type: str,
    tp_plan: Mapping[str, ParallelStyle] | None = None,
    tp_size: int = 1,
) -> Float8Plan:
    """Decide which of ``model``'s linears torchao converts (see ``Float8Config`` for the rules).

    Args:
        model: The plain model (before TP or FSDP).
        config: The float8 settings.
        device_type: The mesh's device type (``cpu`` / ``cuda``), for ``emulate``.
        tp_plan: The resolved TP plan (tp > 1); a converted linear must be sharded by exactly torch's
            ``ColwiseParallel`` or ``RowwiseParallel``, whose float8 twins torchao provides.
        tp_size: The TP degree: the per-rank dims must be multiples of 16.

    Raises:
        ImportError: torchao is not installed (names the extra to install).
        ValueError: ``emulate=False`` off CUDA, or no linear is left to convert (naming the reasons).
    """
    require_torchao()
    emulate = resolve_emulate(config, device_type)
    styles = _linear_styles(model, tp_plan or {}) if tp_size > 1 else {}
    never = _never_converted(model)
    modules: list[str] = []
    skipped: list[tuple[str, str]] = []
    for fqn, module in model.named_modules():
        if not isinstance(module, nn.Linear) or not fqn:
            continue
        reason = (
            never.get(fqn)
            or _subclass_reason(module)
            or _pattern_reason(fqn, config)
            or _shape_reason(module, styles, fqn, tp_size)
        )
        if reason:
            skipped.append((fqn, reason))
        else:
            modules.append(fqn)
    if not modules:
        reasons = sorted({reason for _, reason in skipped}) or ["the model has no nn.Linear"]
        raise ValueError(
            f"FSDP2Config.float8 is set but no linear of {type(model).__name__} can be converted "
            f"({'; '.join(reasons)}); adjust Float8Config.include/skip or turn float8 off"
        )
    return Float8Plan(config.scaling, emulate, config.fsdp_all_gather, tuple(modules), tuple(skipped))


def _never_converted(model: nn.Module) -> dict[str, str]:
    """The automatic skips: the output head, MoE routers, everything inside an ``experts`` block."""
    found: dict[str, str] = {}
    head = _output_head(model)
    for fqn, module in model.named_modules():
        if module is head:
            found[fqn] = "the output head (kept in high precision)"
        experts = getattr(module, "experts", None)
        if not isinstance(experts, nn.Module):
            continue
        prefix = f"{fqn}." if fqn else ""
        for name, _ in experts.named_modules():
            found[f"{prefix}experts{'.' + name if name else ''}"] = (
                "MoE experts (grouped GEMMs are not built)"
            )
        for router in _ROUTER_NAMES:
            for name, _ in getattr(module, router, nn.Module()).named_modules():
                found.setdefault(f"{prefix}{router}{'.' + name if name else ''}", "an MoE router")
    return found


def _output_head(model: nn.Module) -> nn.Module | None:
    getter = getattr(model, "get_output_embeddings", None)
    head = getter() if callable(getter) else None
    if head is None:
        head = getattr(model, "lm_head", None)
    return head if isinstance(head, nn.Module) else None


def _subclass_reason(module: nn.Linear) -> str | None:
    """Only plain ``nn.Linear`` is converted: a subclass has a forward of its own (or is float8 already)."""
    kind = type(module)
    return None if kind is nn.Linear else f"a {kind.__name__}, not a plain nn.Linear"


def _pattern_reason(fqn: str, config: Float8Config) -> str | None:
    if not any(fnmatchcase(fqn, p) for p in config.include):
        return "not matched by Float8Config.include"
    hit = next((p for p in config.skip if fnmatchcase(fqn, p)), None)
    return f"Float8Config.skip {hit!r}" if hit is not None else None


def _shape_reason(
    module: nn.Linear, styles: Mapping[str, ParallelStyle], fqn: str, tp_size: int
) -> str | None:
    """Why a linear cannot run float8 matmuls as it is laid out (tp > 1: its style and its shard)."""
    out_features, in_features = module.out_features, module.in_features
    if tp_size > 1:
        style = styles.get(fqn)
        kind = type(style)
        if kind is ColwiseParallel:
            out_features //= tp_size
        elif kind is RowwiseParallel:
            in_features //= tp_size
        else:
            shown = "no style" if style is None else kind.__name__
            return f"tp > 1: the TP plan gives it {shown}, not ColwiseParallel or RowwiseParallel"
    if out_features % FLOAT8_ALIGNMENT or in_features % FLOAT8_ALIGNMENT:
        where = " per TP rank" if tp_size > 1 else ""
        return f"{in_features} x {out_features} features{where} are not multiples of {FLOAT8_ALIGNMENT}"
    return None


def _linear_styles(model: nn.Module, tp_plan: Mapping[str, ParallelStyle]) -> dict[str, ParallelStyle]:
    """The style each module FQN gets from the plan's ``fnmatch`` patterns (the first pattern wins)."""
    styles: dict[str, ParallelStyle] = {}
    fqns = [fqn for fqn, _ in model.named_modules() if fqn]
    for pattern, style in tp_plan.items():
        for fqn in fqns:
            if fnmatchcase(fqn, pattern):
                styles.setdefault(fqn, style)
    return styles
