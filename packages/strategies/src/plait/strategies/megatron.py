"""Megatron-FSDP: TP via plait.tp, then the ``megatron-fsdp`` package shards over the ``(dp, cp)`` ranks."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from plait.mesh import (
    ActivationCheckpointing,
    MegatronFSDPConfig,
    MeshContext,
    normalize_activation_checkpointing,
)
from plait.sharding import apply_activation_checkpointing, discover_layer_groups
from plait.strategies._megatron_api import load_api, resolve_unit_modules, translate_config
from plait.tp import apply_tp, resolve_tp_plan, validate_tp_mesh

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


def parallelize_megatron_fsdp(
    model: nn.Module,
    config: MegatronFSDPConfig,
    device_mesh: DeviceMesh,
    *,
    optimizer: torch.optim.Optimizer | None = None,
    activation_checkpointing: ActivationCheckpointing = False,
    reapply_trainability: Callable[[nn.Module], None] | None = None,
    model_tp_plan: Any = None,
    finalize_tp_plan: Callable[..., Any] | None = None,
    validate_tp: Callable[[nn.Module, DeviceMesh], None] | None = None,
    layer_group_paths: Any = None,
    whole_layer_checkpointing: bool = False,
) -> nn.Module | tuple[nn.Module, torch.optim.Optimizer]:
    """Apply TP, AC and ``reapply_trainability``, then Megatron-FSDP over the ``dp`` (x ``cp``) ranks.

    Unit modules come from ``config.unit_modules`` or the model's ``_no_split_modules``. With one
    data-parallel rank (dp = cp = 1) there is nothing to shard: only TP is applied, with a warning.

    Args:
        model: The model.
        config: The :class:`MegatronFSDPConfig`.
        device_mesh: The ``(dp, cp, tp)`` mesh (``MeshContext.build(MegatronFSDPConfig(), sizes)``).
        optimizer: Optional optimizer over ``model``'s parameters; it is rebuilt on the sharded
            parameters (one parameter group with the optimizer's defaults) and hooked to Megatron-FSDP.
        activation_checkpointing: False, True / ``"full"`` or ``"selective"``; scope from the config.
        reapply_trainability: Called after TP/AC wrapping, before sharding, to restore ``requires_grad``.
        model_tp_plan: The sidecar's TP plan factory (``resolve_tp_plan``'s ``model_plan``).
        finalize_tp_plan: The sidecar's ``_finalize_tp_plan`` hook.
        validate_tp: The sidecar's ``_validate_tp_mesh`` hook; default :func:`plait.tp.validate_tp_mesh`.
        layer_group_paths: The sidecar's ``layer_group_paths`` for activation checkpointing.
        whole_layer_checkpointing: Checkpoint whole layers instead of per submodule (full mode).

    Returns:
        The Megatron-FSDP model; ``(model, optimizer)`` when an optimizer was given.

    Raises:
        TypeError: ``config`` is not a :class:`MegatronFSDPConfig`.
        ImportError: megatron-fsdp is missing or its API is unsupported (names the version needed).
        ValueError: a bad mesh, no unit modules, a bad TP plan or head counts vs tp.
    """
    if not isinstance(config, MegatronFSDPConfig):
        raise TypeError(f"parallelize_megatron_fsdp needs a MegatronFSDPConfig, got {type(config).__name__}")
    dp, cp, tp = _sizes(device_mesh)
    shard = dp * cp > 1
    ac_mode = normalize_activation_checkpointing(activation_checkpointing)
    if shard:
        api = load_api(with_optimizer=optimizer is not None)
        units = resolve_unit_modules(model, config)
        kwargs = translate_config(config, api)
    plan = None
    if tp > 1:
        (validate_tp or validate_tp_mesh)(model, device_mesh["tp"])
        plan = resolve_tp_plan(
            model, plan=config.tp_plan, tp_size=tp, model_plan=model_tp_plan, finalize=finalize_tp_plan
        )
    groups = discover_layer_groups(model, layer_group_paths) if ac_mode else []

    ctx = MeshContext.from_meshes(device_mesh, strategy_config=config)
    if plan:
        apply_tp(model, ctx.tp_mesh(), plan)
    if ac_mode:
        apply_activation_checkpointing(
            model,
            groups,
            mode=ac_mode,
            scope=config.activation_checkpointing_scope,
            whole_layer=whole_layer_checkpointing,
        )
    if reapply_trainability is not None:
        reapply_trainability(model)
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
