"""Plain DistributedDataParallel: the last step of the flow for ``DDPConfig`` (the wrapper itself)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from plait.mesh import DDPConfig, MeshContext

__all__ = ["wrap_ddp"]


def _device() -> torch.device:
    """The device DDP runs on: the current CUDA device under NCCL, else CPU."""
    if dist.get_backend() == "nccl" and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def wrap_ddp(model: nn.Module, mesh_context: MeshContext) -> nn.Module:
    """Move ``model`` to the device and wrap it in DDP (world > 1); checkpointing is the flow's, before.

    The device comes from the default process group (NCCL: the current CUDA device; otherwise CPU).
    With one rank there is nothing to synchronise: the model is returned unwrapped.

    Returns:
        ``DistributedDataParallel(model)``, or ``model`` itself with one rank.

    Raises:
        TypeError: the strategy config is not a :class:`DDPConfig`.
        ValueError: the default process group is not initialised, or ``model`` has parameters on
            the meta device (DDP broadcasts rank 0's weights when it wraps, so they must exist).
    """
    config = mesh_context.strategy_config
    if not isinstance(config, DDPConfig):
        raise TypeError(f"wrap_ddp needs a DDPConfig, got {type(config).__name__}")
    if not dist.is_initialized():
        raise ValueError("DDP needs an initialised default process group; call plait.mesh.init_distributed()")
    meta = [name for name, param in model.named_parameters() if param.is_meta]
    if meta:
        raise ValueError(
            f"DDP broadcasts rank 0's weights when it wraps, but {len(meta)} parameters (e.g. {meta[0]!r}) "
            "are on the meta device; fill them before parallelize_model (plait.mesh.materialize(model, "
            "seed=..., device=...) then parallelize_model), or use FSDP2Config, which shards meta models"
        )
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
