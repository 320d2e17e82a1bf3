"""Megatron-FSDP: after the flow's TP and checkpointing, the ``megatron-fsdp`` package shards over ``(dp, cp)``."""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from plait.mesh import MegatronFSDPConfig, MeshContext
from plait.strategies._megatron_api import load_api, resolve_unit_modules, translate_config

__all__ = ["check_megatron_fsdp", "shard_megatron_fsdp"]

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
        raise TypeError(f"Megatron-FSDP needs a MegatronFSDPConfig, got {type(config).__name__}")
    if mesh_context.device_mesh is None:
        raise ValueError(
            "Megatron-FSDP needs mesh_context.device_mesh, got None; build the context with "
            "MeshContext.build(MegatronFSDPConfig(...), sizes)."
        )
    return config, mesh_context.device_mesh


def _prepare(
    model: nn.Module, mesh_context: MeshContext, *, with_optimizer: bool
) -> tuple[Any, list[type], dict[str, Any]] | None:
    """``(api, unit module classes, package kwargs)``, checked; None with one data-parallel rank."""
    config, device_mesh = _device_mesh(mesh_context)
    dp, cp, _ = _sizes(device_mesh)
    if dp * cp == 1:
        return None
    api = load_api(with_optimizer=with_optimizer)
    return api, resolve_unit_modules(model, config), translate_config(config, api)


def check_megatron_fsdp(model: nn.Module, mesh_context: MeshContext) -> None:
    """Refuse what Megatron-FSDP cannot shard before anything changes (the plan calls it).

    Raises:
        TypeError: the strategy config is not a :class:`MegatronFSDPConfig`.
        ImportError: megatron-fsdp is missing or its API is unsupported (names the version needed).
        ValueError: a mesh without ``dp``, no unit modules, a config the package cannot take.
    """
    _prepare(model, mesh_context, with_optimizer=False)


def shard_megatron_fsdp(
    model: nn.Module, mesh_context: MeshContext, *, optimizer: torch.optim.Optimizer | None = None
) -> nn.Module | tuple[nn.Module, torch.optim.Optimizer]:
    """Shard ``model`` with the ``megatron-fsdp`` package over the ``dp`` (x ``cp``) ranks; the flow's last step.

    TP, activation checkpointing and ``reapply_trainability`` are the flow's steps before this one.
    Unit modules come from ``config.unit_modules`` or the model's ``_no_split_modules``; with one
    data-parallel rank nothing is sharded, with a warning. A given ``optimizer`` is rebuilt on the
    sharded parameters (one group, its defaults) and ``(model, optimizer)`` is returned.

    Raises:
        TypeError / ImportError / ValueError: as :func:`check_megatron_fsdp`.
    """
    prepared = _prepare(model, mesh_context, with_optimizer=optimizer is not None)
    device_mesh = mesh_context.device_mesh
    dp, cp, tp = _sizes(device_mesh)
    if prepared is None:
        warnings.warn(
            f"Megatron-FSDP with dp={dp}, cp={cp}: one data-parallel rank, nothing to shard (tp={tp})",
            UserWarning,
            stacklevel=2,
        )
        return model if optimizer is None else (model, optimizer)
    api, units, kwargs = prepared
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
