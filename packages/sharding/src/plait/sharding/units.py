"""FSDP2 unit selection: one unit per layer-container element, per-unit reshard policy, the root last."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable
from functools import partial
from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from plait.sharding._walk import UnitCandidate, owning_prefix, walk_unit_candidates
from plait.sharding.embeddings import check_tied_parameters
from plait.sharding.multimodal import (
    find_frozen_multimodal_modules,
    find_multimodal_modules,
    frozen_modules_to_skip,
    frozen_multimodal_ignored_params,
)
from plait.sharding.prefetch import check_prefetch_depth, wire_fsdp_prefetch
from plait.sharding.unit_policy import FSDPUnit, unit_reshard_after_forward


def select_fsdp_units(
    module: nn.Module,
    *,
    exclude: Iterable[nn.Module] = (),
    ignored_params: set[nn.Parameter] | None = None,
) -> list[UnitCandidate]:
    """Return the container elements that would become FSDP units, in registration order.

    Elements under ``exclude``, elements that already are FSDP units and elements with no
    parameter left to shard (none, or all ignored) are left out.
    """
    ignored = {id(p) for p in ignored_params or ()}
    skip = frozenset(id(m) for m in exclude)
    return [
        c
        for c in walk_unit_candidates(module, skip)
        if not isinstance(c.module, FSDPModule) and any(id(p) not in ignored for p in c.module.parameters())
    ]


def apply_fsdp_sharding(
    module: nn.Module,
    mesh: DeviceMesh,
    *,
    mp_policy: MixedPrecisionPolicy | None = None,
    offload_policy: OffloadPolicy | None = None,
    reshard_after_forward: bool | int | None = None,
    enable_prefetch: bool = True,
    forward_prefetch_depth: int = 1,
    backward_prefetch_depth: int = 2,
    frozen_multimodal_sharding: str = "root",
    ignored_params: set[nn.Parameter] | None = None,
    shard_fn: Callable[..., nn.Module] = fully_shard,
    exclude: Iterable[nn.Module] | None = None,
) -> list[nn.Module]:
    """Wrap every element of every layer container of ``module`` as an FSDP unit (not the root).

    The rules (units, reshard policy, prefetch, frozen multimodal towers) are in docs/behavior.md,
    "Sharding"; the root is left to the caller (:func:`fully_shard_root`).

    Args:
        module: The model; left untouched if a check fails.
        mesh: The FSDP mesh (1-D, or 2-D ``(replicate, shard)`` for HSDP).
        mp_policy: Mixed precision for every unit (None = FSDP default).
        offload_policy: Offload policy for every unit (None = none).
        reshard_after_forward: Explicit policy for every unit; None = the documented default.
        enable_prefetch: Wire explicit forward/backward prefetch.
        forward_prefetch_depth: Units each unit all-gathers ahead in forward; 0 = off.
        backward_prefetch_depth: Units each unit all-gathers ahead in backward; 0 = off.
        frozen_multimodal_sharding: ``root | per_layer | replicate``.
        ignored_params: Parameters no unit shards (added to the frozen ones under ``replicate``).
        shard_fn: The FSDP primitive, called like ``fully_shard``.
        exclude: Modules whose subtrees get no units (e.g. already handled by the caller).

    Returns:
        The units, in order.

    Raises:
        ValueError: a bad policy or depth, or a tied parameter two units would own (nothing wrapped).
    """
    check_prefetch_depth("forward_prefetch_depth", forward_prefetch_depth)
    check_prefetch_depth("backward_prefetch_depth", backward_prefetch_depth)
    candidates, ignored = _candidates(module, frozen_multimodal_sharding, ignored_params, exclude)
    shard = partial(
        shard_fn,
        mesh=mesh,
        mp_policy=mp_policy or MixedPrecisionPolicy(),
        offload_policy=offload_policy or OffloadPolicy(),
        ignored_params=ignored or None,
    )
    reshard = partial(unit_reshard_after_forward, "layer", explicit=reshard_after_forward)
    units = [_wrap(c, shard, reshard_after_forward=reshard(last=c.last)) for c in candidates]
    if enable_prefetch and reshard_after_forward is not False:
        wire_fsdp_prefetch(
            units, forward_depth=forward_prefetch_depth, backward_depth=backward_prefetch_depth
        )
    return units


def plan_layer_units(
    module: nn.Module,
    *,
    reshard_after_forward: bool | int | None = None,
    frozen_multimodal_sharding: str = "root",
    ignored_params: set[nn.Parameter] | None = None,
    exclude: Iterable[nn.Module] | None = None,
) -> list[FSDPUnit]:
    """The layer units :func:`apply_fsdp_sharding` creates with the same arguments, in order.

    Raises:
        ValueError: a tied parameter two units would own.
    """
    candidates, _ = _candidates(module, frozen_multimodal_sharding, ignored_params, exclude)
    return [
        FSDPUnit(
            (c.fqn,),
            "layer",
            unit_reshard_after_forward("layer", explicit=reshard_after_forward, last=c.last),
        )
        for c in candidates
    ]


def _candidates(
    module: nn.Module,
    frozen_multimodal_sharding: str,
    ignored_params: set[nn.Parameter] | None,
    exclude: Iterable[nn.Module] | None,
) -> tuple[list[UnitCandidate], set[nn.Parameter]]:
    """The units to wrap and the parameters none of them shards, checked before anything is wrapped."""
    frozen = find_frozen_multimodal_modules(module)
    skipped = frozen_modules_to_skip(frozen, frozen_multimodal_sharding)
    ignored = set(ignored_params or ()) | frozen_multimodal_ignored_params(frozen, frozen_multimodal_sharding)
    candidates = select_fsdp_units(module, exclude=[*(exclude or ()), *skipped], ignored_params=ignored)
    check_tied_parameters(module, [c.fqn for c in candidates])
    return candidates, ignored


def _wrap(candidate: UnitCandidate, shard_fn: Callable[..., nn.Module], **kwargs: Any) -> nn.Module:
    """Shard one unit in place; a function that returns a new wrapper is registered in its parent."""
    wrapped = shard_fn(candidate.module, **kwargs)
    if isinstance(wrapped, nn.Module) and wrapped is not candidate.module:
        candidate.parent.register_module(candidate.name, wrapped)
    return wrapped if isinstance(wrapped, nn.Module) else candidate.module


def _trainable_multimodal_in_root(model: nn.Module) -> bool:
    units = [fqn for fqn, m in model.named_modules() if fqn and isinstance(m, FSDPModule)]
    return any(
        not owning_prefix(fqn, units) and any(p.requires_grad for p in m.parameters())
        for fqn, m in find_multimodal_modules(model).items()
    )


def fully_shard_root(
    model: nn.Module,
    mesh: DeviceMesh,
    *,
    mp_policy: MixedPrecisionPolicy | None,
    offload_policy: OffloadPolicy | None,
    ignored_params: set[nn.Parameter] | None = None,
    shard_fn: Callable[..., nn.Module] = fully_shard,
) -> nn.Module:
    """Wrap the root last, with ``reshard_after_forward=False``; return the wrapped model.

    When a trainable multimodal tower or projector has parameters in the root unit, the root
    reduce-scatters zero gradients for parameters that got none on this rank. A rank whose batch
    has no images skips the projector; without this its reduce-scatter input would be smaller
    than the other ranks' and the collective would fail. Every rank always runs the root, so
    keeping such modules in the root (the default unit selection does) is what makes
    rank-divergent modalities safe. Side effect: a step in which *no* rank uses the projector
    gives it zero gradients instead of none.
    """
    wrapped = shard_fn(
        model,
        mesh=mesh,
        reshard_after_forward=False,
        mp_policy=mp_policy or MixedPrecisionPolicy(),
        offload_policy=offload_policy or OffloadPolicy(),
        ignored_params=ignored_params or None,
    )
    root = wrapped if isinstance(wrapped, nn.Module) else model
    if isinstance(root, FSDPModule) and _trainable_multimodal_in_root(root):
        if hasattr(root, "set_reduce_scatter_unused_params"):
            root.set_reduce_scatter_unused_params(True, recurse=False)
        else:
            warnings.warn(
                "This torch has no FSDPModule.set_reduce_scatter_unused_params: steps in which ranks see "
                "different modalities (a rank skipping the trainable projector) will fail in reduce-scatter. "
                "Upgrade torch, or give every rank the same modalities each step.",
                UserWarning,
                stacklevel=2,
            )
    return root
