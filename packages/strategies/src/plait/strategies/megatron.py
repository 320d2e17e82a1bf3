"""Megatron-FSDP: TP via plait.tp, then the ``megatron-fsdp`` package shards over the ``(dp, cp)`` ranks."""

from __future__ import annotations

import copy
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from plait.mesh import MegatronFSDPConfig, MeshContext
from plait.sharding import LayerGroup
from plait.strategies._megatron_api import load_api, resolve_unit_modules, translate_config
from plait.strategies.hooks import SidecarHooks
from plait.tp import apply_tp

__all__ = ["parallelize_megatron_fsdp"]

_DIMS = ("dp", "cp", "tp")


def _sizes(device_mesh: DeviceMesh) -> tuple[int, int, int]:
    names = tuple(device_mesh.mesh_dim_names or ())
    if "dp" not in names or any(n not in _DIMS for n in names):
        raise ValueError(
            f"Megatron-FSDP needs a mesh with dims from {_DIMS} including 'dp', got {list(names)}; build it "
            "with MeshContext.build(MegatronFSDPConfig(), sizes)"
        )
    return tuple(device_mesh.size(names.index(n)) if n in names else 1 for n in _DIMS)  # type: ignore[return-value]


def _device(device_mesh: DeviceMesh) -> torch.device:
    if device_mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(device_mesh.device_type)


def _device_mesh(mesh_context: MeshContext) -> tuple[MegatronFSDPConfig, DeviceMesh]:
    config = mesh_context.strategy_config
    if not isinstance(config, MegatronFSDPConfig):
        raise TypeError(f"parallelize_megatron_fsdp needs a MegatronFSDPConfig, got {type(config).__name__}")
    if mesh_context.device_mesh is None:
        raise ValueError(
            "Megatron-FSDP needs mesh_context.device_mesh, got None; build the context with "
            "MeshContext.build(MegatronFSDPConfig(...), sizes)."
        )
    return config, mesh_context.device_mesh


def _apply_before_sharding(
    model: nn.Module,
    mesh_context: MeshContext,
    sidecar: SidecarHooks,
    tp_plan: Mapping[str, Any],
    layer_groups: Sequence[LayerGroup],
) -> None:
    """TP, activation checkpointing and ``reapply_trainability``, in that order (all checked first)."""
    if tp_plan:
        apply_tp(model, mesh_context.tp_mesh(), copy.deepcopy(dict(tp_plan)))
    if mesh_context.activation_checkpointing:
        sidecar._checkpoint_activations(model, list(layer_groups), mesh_context)
    if mesh_context.reapply_trainability is not None:
        mesh_context.reapply_trainability(model)


def parallelize_megatron_fsdp(
    model: nn.Module,
    mesh_context: MeshContext,
    sidecar: SidecarHooks,
    *,
    tp_plan: Mapping[str, Any] | None = None,
    layer_groups: Sequence[LayerGroup] = (),
    optimizer: torch.optim.Optimizer | None = None,
) -> nn.Module | tuple[nn.Module, torch.optim.Optimizer]:
    """Apply TP, AC and ``reapply_trainability``, then Megatron-FSDP over the ``dp`` (x ``cp``) ranks.

    Unit modules come from ``config.unit_modules`` or the model's ``_no_split_modules``; with one
    data-parallel rank only TP is applied, with a warning. ``tp_plan`` and ``layer_groups`` come from
    the plan (``plait.sidecar.plan_parallelism``). A given ``optimizer`` is rebuilt on the sharded
    parameters (one group, its defaults) and ``(model, optimizer)`` is returned.

    Raises:
        TypeError: the strategy config is not a :class:`MegatronFSDPConfig`.
        ImportError: megatron-fsdp is missing or its API is unsupported (names the version needed).
        ValueError: a bad mesh, no unit modules, a bad TP plan or head counts vs tp.
    """
    config, device_mesh = _device_mesh(mesh_context)
    dp, cp, tp = _sizes(device_mesh)
    shard = dp * cp > 1
    if shard:
        api = load_api(with_optimizer=optimizer is not None)
        units = resolve_unit_modules(model, config)
        kwargs = translate_config(config, api)
    _apply_before_sharding(model, mesh_context, sidecar, tp_plan or {}, layer_groups)
    if not shard:
        warnings.warn(
            f"Megatron-FSDP with dp={dp}, cp={cp}: one data-parallel rank, nothing to shard; applied TP "
            f"(tp={tp}) only",
            UserWarning,
            stacklevel=2,
        )
        return model if optimizer is None else (model, optimizer)
    extra = {"optimizer": optimizer} if optimizer is not None else {}
    return api.entry(
        module=model,
        **extra,
        device_mesh=device_mesh,
        dp_shard_dim="dp_cp" if cp > 1 else "dp",
        tp_dim="tp" if "tp" in device_mesh.mesh_dim_names else None,
        fsdp_unit_modules=units,
        device=_device(device_mesh),
        **kwargs,
    )
