"""Plain DistributedDataParallel: the sidecar's activation checkpointing, then the DDP wrapper."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from plait.mesh import DDPConfig, MeshContext
from plait.sharding import LayerGroup
from plait.strategies.hooks import SidecarHooks

__all__ = ["parallelize_ddp"]


def _device() -> torch.device:
    """The device DDP runs on: the current CUDA device under NCCL, else CPU."""
    if dist.get_backend() == "nccl" and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def parallelize_ddp(
    model: nn.Module,
    mesh_context: MeshContext,
    sidecar: SidecarHooks,
    *,
    layer_groups: Sequence[LayerGroup] = (),
) -> nn.Module:
    """Checkpoint the layers (the sidecar's hook), restore trainability, then wrap in DDP (world > 1).

    The device comes from the default process group (NCCL: the current CUDA device; otherwise CPU).
    With one rank there is nothing to synchronise: the model is returned unwrapped.

    Args:
        model: The model; moved to the device.
        mesh_context: Carries the :class:`DDPConfig`, the AC mode and ``reapply_trainability``.
        sidecar: The model's sidecar (``_checkpoint_activations``).
        layer_groups: The planned layer groups checkpointed under ``activation_checkpointing``.

    Returns:
        ``DistributedDataParallel(model)``, or ``model`` itself with one rank.

    Raises:
        TypeError: the strategy config is not a :class:`DDPConfig`.
        ValueError: the default process group is not initialised.
    """
    config = mesh_context.strategy_config
    if not isinstance(config, DDPConfig):
        raise TypeError(f"parallelize_ddp needs a DDPConfig, got {type(config).__name__}")
    if not dist.is_initialized():
        raise ValueError(
            "parallelize_ddp needs an initialised default process group; call plait.mesh.init_distributed()"
        )
    if mesh_context.activation_checkpointing:
        sidecar._checkpoint_activations(model, list(layer_groups), mesh_context)
    if mesh_context.reapply_trainability is not None:
        mesh_context.reapply_trainability(model)
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
