"""Plain DistributedDataParallel: activation checkpointing per scope, then the DDP wrapper."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from plait.mesh import (
    ActivationCheckpointing,
    DDPConfig,
    normalize_ac_scope,
    normalize_activation_checkpointing,
)
from plait.sharding import apply_activation_checkpointing, discover_layer_groups

__all__ = ["parallelize_ddp"]


def _device() -> torch.device:
    """The device DDP runs on: the current CUDA device under NCCL, else CPU."""
    if dist.get_backend() == "nccl" and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def parallelize_ddp(
    model: nn.Module,
    config: DDPConfig,
    *,
    activation_checkpointing: ActivationCheckpointing = False,
    scope: str | Iterable[str] | None = None,
    reapply_trainability: Callable[[nn.Module], None] | None = None,
    layer_group_paths: Any = None,
    whole_layer_checkpointing: bool = False,
) -> nn.Module:
    """Checkpoint the layers ``scope`` selects, restore trainability, then wrap in DDP (world > 1).

    The device comes from the default process group (NCCL: the current CUDA device; otherwise CPU).
    With one rank there is nothing to synchronise: the model is returned unwrapped.

    Args:
        model: The model; moved to the device.
        config: The :class:`DDPConfig` (DDP options and the default AC scope).
        activation_checkpointing: False, True / ``"full"`` or ``"selective"``.
        scope: AC scope; None = ``config.activation_checkpointing_scope``.
        reapply_trainability: Called after AC wrapping, before DDP records which parameters train.
        layer_group_paths: The sidecar's ``layer_group_paths`` for activation checkpointing.
        whole_layer_checkpointing: Checkpoint whole layers instead of per submodule (full mode).

    Returns:
        ``DistributedDataParallel(model)``, or ``model`` itself with one rank.

    Raises:
        TypeError: ``config`` is not a :class:`DDPConfig`.
        ValueError: the default process group is not initialised, or a bad AC mode / scope.
    """
    if not isinstance(config, DDPConfig):
        raise TypeError(f"parallelize_ddp needs a DDPConfig, got {type(config).__name__}")
    if not dist.is_initialized():
        raise ValueError(
            "parallelize_ddp needs an initialised default process group; call plait.mesh.init_distributed()"
        )
    mode = normalize_activation_checkpointing(activation_checkpointing)
    ac_scope = normalize_ac_scope(scope) if scope is not None else config.activation_checkpointing_scope
    if mode:
        groups = discover_layer_groups(model, layer_group_paths)
        apply_activation_checkpointing(
            model, groups, mode=mode, scope=ac_scope, whole_layer=whole_layer_checkpointing
        )
    if reapply_trainability is not None:
        reapply_trainability(model)
    device = _device()
    model.to(device)
    if dist.get_world_size() == 1:
        return model
    return DistributedDataParallel(
        model,
        device_ids=[device.index] if device.type == "cuda" else None,
        broadcast_buffers=config.broadcast_buffers,
        find_unused_parameters=config.find_unused_parameters,
        static_graph=config.static_graph,
        bucket_cap_mb=config.bucket_cap_mb,
        gradient_as_bucket_view=config.gradient_as_bucket_view,
    )
