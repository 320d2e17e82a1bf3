"""Find the MoE blocks of a model: modules with an ``experts`` child and a ``router`` / ``gate`` child."""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from plait.strategies.experts import num_experts_of

_ROUTER_NAMES = ("router", "gate")


@dataclass(frozen=True)
class MoEBlockInfo:
    """One MoE block: its grouped experts and its router (None when it has no ``router``/``gate`` child)."""

    fqn: str
    experts_fqn: str
    experts: nn.Module
    num_experts: int
    router_fqn: str | None
    router: nn.Module | None


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def find_moe_blocks(model: nn.Module, ep_size: int) -> list[MoEBlockInfo]:
    """Return every module with an ``experts`` child, checked against the experts contract and ``ep_size``.

    Raises:
        ValueError: no experts module at all; experts as a per-expert ModuleList/ModuleDict; parameters
            without a common expert dim 0; ``num_experts`` not divisible by ``ep_size``.
    """
    blocks: list[MoEBlockInfo] = []
    for fqn, module in model.named_modules():
        experts = getattr(module, "experts", None)
        if not isinstance(experts, nn.Module) or experts not in module.children():
            continue
        experts_fqn = _join(fqn, "experts")
        if isinstance(experts, nn.ModuleList | nn.ModuleDict):
            kind = "ModuleList" if isinstance(experts, nn.ModuleList) else "ModuleDict"
            own = "" if type(experts).__name__ == kind else f" (an nn.{kind})"
            raise ValueError(
                f"{experts_fqn!r} is a per-expert {type(experts).__name__}{own}; expert parallel needs one "
                "experts module whose parameters stack the experts on dim 0 (the fused layout of Hugging "
                "Face transformers >= 5, e.g. gate_up_proj [E, 2I, H]); the block's own per-expert loop "
                "cannot be dispatched by all-to-all - use ep_size 1 for this model (transformers >= 5 "
                "stores every causal-LM MoE family fused)"
            )
        num_experts = num_experts_of(experts)
        if num_experts % ep_size != 0:
            raise ValueError(
                f"num_experts ({num_experts}) of {experts_fqn!r} must be divisible by ep_size ({ep_size}); "
                f"use an ep_size that divides {num_experts}"
            )
        router_name = next(
            (n for n in _ROUTER_NAMES if isinstance(getattr(module, n, None), nn.Module)), None
        )
        blocks.append(
            MoEBlockInfo(
                fqn=fqn,
                experts_fqn=experts_fqn,
                experts=experts,
                num_experts=num_experts,
                router_fqn=None if router_name is None else _join(fqn, router_name),
                router=None if router_name is None else getattr(module, router_name),
            )
        )
    if not blocks:
        raise ValueError(
            f"{type(model).__name__} has no MoE block (a module with an 'experts' child); expert parallel "
            "(ep_size > 1) needs grouped experts — use ep_size 1 for a dense model"
        )
    return blocks
