"""Router margins: how far every token's k-th router logit is above its (k+1)-th, in every forward.

A MoE parity test whose data sits near a top-k tie passes on one CPU and fails on another (a rounding
difference flips an expert choice). :func:`record_routing_margins` hooks every router of a model; the
tests assert the smallest margin seen, relative to the logit scale, stays above :data:`MIN_MARGIN`, for
every token of every forward of every step they compare. A hook is shared by ``copy.deepcopy``, so the
parallel copy of a hooked reference records its (local) margins into the same recorder.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

__all__ = ["MIN_MARGIN", "Margins", "record_routing_margins"]

MIN_MARGIN = 1e-3
"""Least gap between the k-th and (k+1)-th router logit, relative to the largest |logit| of the call."""

_ROUTER_NAMES = ("gate", "router")


@dataclass
class Margins:
    """The smallest relative router margin seen, and how many router calls were measured."""

    smallest: float = float("inf")
    calls: int = 0
    tokens: int = 0
    where: str = ""

    def record(self, name: str, logits: torch.Tensor, top_k: int, scale: torch.Tensor | None = None) -> None:
        """Measure one router call of ``name``: ``logits [..., experts]``, relative to ``scale`` (or the logits)."""
        logits = logits.detach().float().reshape(-1, logits.shape[-1])
        top = torch.topk(logits, top_k + 1, dim=-1).values
        gap = top[:, top_k - 1] - top[:, top_k]
        ref = (logits if scale is None else scale.detach().float()).abs().max().clamp_min(1e-30)
        worst = float(gap.min() / ref)
        self.calls += 1
        self.tokens += logits.shape[0]
        if worst < self.smallest:
            self.smallest, self.where = worst, name

    def check(self) -> None:
        """Assert a router was measured and the smallest margin is at least :data:`MIN_MARGIN`."""
        assert self.calls > 0, "no router call was measured"
        assert self.smallest >= MIN_MARGIN, (
            f"router margin {self.smallest:.2e} < {MIN_MARGIN} at {self.where}: the data sits near a "
            "top-k tie, so another CPU's rounding could flip an expert choice - pick other data or seeds"
        )


@dataclass
class _Hook:
    margins: Margins
    name: str
    top_k: int

    def __deepcopy__(self, memo: dict[int, Any]) -> _Hook:
        return self

    def __call__(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        bias = getattr(module, "expert_bias", None)
        if isinstance(bias, torch.Tensor) and isinstance(getattr(module, "gate", None), nn.Module):
            with torch.no_grad():  # plait's TopKRouter returns (weights, indices): recompute its logits
                raw = module.gate(args[0])
            self.margins.record(self.name, raw + bias, self.top_k, scale=raw)
            return
        logits = output[0] if isinstance(output, tuple) else output
        self.margins.record(self.name, logits, self.top_k)


def _top_k(router: nn.Module, model: nn.Module) -> int:
    for owner in (router, getattr(model, "config", None)):
        for attr in ("top_k", "num_experts_per_tok"):
            value = getattr(owner, attr, None)
            if isinstance(value, int):
                return value
    raise AssertionError(f"cannot tell the top-k of router {type(router).__name__}")


def record_routing_margins(model: nn.Module, margins: Margins | None = None) -> Margins:
    """Hook every router (the ``gate`` / ``router`` child of a module with an ``experts`` child)."""
    margins = margins if margins is not None else Margins()
    hooked = 0
    for fqn, module in model.named_modules():
        if not isinstance(getattr(module, "experts", None), nn.Module):
            continue
        for attr in _ROUTER_NAMES:
            router = getattr(module, attr, None)
            if isinstance(router, nn.Module):
                router.register_forward_hook(_Hook(margins, f"{fqn}.{attr}", _top_k(router, model)))
                hooked += 1
                break
    assert hooked, f"{type(model).__name__} has no router to measure"
    return margins
