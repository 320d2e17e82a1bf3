"""DTensor-aware differences between a parallelized model and its unsharded reference (the driver's
measurements, in `plait.testing.driver`).

`full_tensor` on a DTensor is a collective: every rank must call these helpers on the same
models in the same order (they walk parameters in sorted-name order, so they do).
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.distributed.tensor import DTensor

__all__ = [
    "clean_fqn",
    "full_tensor",
    "max_grad_diff",
    "max_param_diff",
]

_WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """Return `t` as a plain detached tensor, all-gathering it first when it is a DTensor (collective)."""
    if isinstance(t, DTensor):
        t = t.full_tensor()
    return t.detach()


def clean_fqn(name: str, strip_ddp: bool = False) -> str:
    """Strip wrapper segments (activation checkpointing, torch.compile, FSDP1) from a parameter name.

    Args:
        name: a fully qualified parameter or module name.
        strip_ddp: also drop the leading `module.` that DistributedDataParallel adds.
    """
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    if strip_ddp and name.startswith("module."):
        name = name[len("module.") :]
    return name


def _named(model: nn.Module, strip_ddp: bool) -> dict[str, nn.Parameter]:
    return {clean_fqn(name, strip_ddp): p for name, p in model.named_parameters()}


def _paired(
    ref_model: nn.Module, par_model: nn.Module, strip_ddp: bool, subset: bool = False
) -> list[tuple[str, nn.Parameter, nn.Parameter]]:
    ref, par = _named(ref_model, strip_ddp), _named(par_model, strip_ddp)
    if subset and par.keys() <= ref.keys():
        return [(name, ref[name], par[name]) for name in sorted(par)]
    if ref.keys() != par.keys():
        missing = [] if subset else sorted(ref.keys() - par.keys())
        extra = sorted(par.keys() - ref.keys())
        raise AssertionError(
            f"parameter names differ after cleaning: missing in the parallel model {missing}, "
            f"only in the parallel model {extra} (tied weights lost? a wrapper prefix not stripped?)"
        )
    return [(name, ref[name], par[name]) for name in sorted(ref)]


def _max_abs_diff(name: str, ref: torch.Tensor, par: torch.Tensor) -> float:
    ref, par = full_tensor(ref), full_tensor(par)
    if ref.shape != par.shape:
        raise AssertionError(
            f"{name}: shape {tuple(par.shape)} in the parallel model, {tuple(ref.shape)} in the reference"
        )
    if ref.numel() == 0:
        return 0.0
    return (ref.float() - par.float().to(ref.device)).abs().max().item()


def _worse(worst: float, worst_name: str, diff: float, name: str) -> tuple[float, str]:
    """Keep the larger difference; a NaN difference is the worst of all."""
    if not worst_name or (math.isnan(diff) and not math.isnan(worst)) or diff > worst:
        return diff, name
    return worst, worst_name


RELATIVE_FLOOR = 1e-2
"""Smallest gradient scale for relative comparisons, as a fraction of the model's largest entry."""


def _largest_grad(model: nn.Module) -> float:
    grads = [
        full_tensor(p.grad).abs().max().item()
        for p in model.parameters()
        if p.grad is not None and p.grad.numel()
    ]
    return max(grads, default=0.0)


def max_grad_diff(
    ref_model: nn.Module,
    par_model: nn.Module,
    *,
    strip_ddp: bool = False,
    relative: bool = False,
    subset: bool = False,
) -> tuple[float, str]:
    """Largest gradient difference over parameters matched by cleaned name, and its name.

    Absolute, or with ``relative`` divided by the reference's max |gradient| of that parameter, or
    by :data:`RELATIVE_FLOOR` times the model's largest reference gradient entry when that is larger:
    a gradient that is zero by construction (a top-1 router's, say) holds only rounding noise, which
    no scale of its own can measure. Parameters whose gradient is None on both sides are skipped;
    None on one side only fails. With ``subset`` the parallel model may hold only some of the
    reference's parameters (a pipeline rank's stages); only those are compared.
    """
    floor = RELATIVE_FLOOR * _largest_grad(ref_model) if relative else 0.0
    worst, worst_name = 0.0, ""
    for name, ref, par in _paired(ref_model, par_model, strip_ddp, subset):
        if ref.grad is None and par.grad is None:
            continue
        if ref.grad is None or par.grad is None:
            side = "reference" if ref.grad is None else "parallel model"
            raise AssertionError(f"{name}: gradient is None in the {side} only")
        diff = _max_abs_diff(name, ref.grad, par.grad)
        if relative:
            scale = max(full_tensor(ref.grad).abs().max().item() if ref.grad.numel() else 0.0, floor)
            diff = diff / scale if scale > 0 else diff
        worst, worst_name = _worse(worst, worst_name, diff, name)
    return worst, worst_name


def max_param_diff(
    ref_model: nn.Module, par_model: nn.Module, *, strip_ddp: bool = False, subset: bool = False
) -> tuple[float, str]:
    """Largest absolute parameter difference over parameters matched by cleaned name, and its name.

    ``subset`` as in :func:`max_grad_diff`.
    """
    worst, worst_name = 0.0, ""
    for name, ref, par in _paired(ref_model, par_model, strip_ddp, subset):
        diff = _max_abs_diff(name, ref, par)
        worst, worst_name = _worse(worst, worst_name, diff, name)
    return worst, worst_name
