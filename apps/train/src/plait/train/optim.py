"""AdamW, the warmup + cosine schedule, and global gradient-norm clipping that is correct for DTensors.

After FSDP2 + TP the gradients are DTensors on *different* meshes and placements (a TP-sharded
projection on ``(dp_shard, tp)``, a norm on ``dp_shard`` only, plain tensors for an unsharded
model). ``torch.nn.utils.clip_grad_norm_`` cannot combine those; here the squared local sums are
summed over exactly the mesh dims each gradient is sharded on, and the groups' squares are added:
the result equals the norm of the unsharded gradients.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate
from torch.optim.lr_scheduler import LambdaLR

from plait.train.config import OptimConfig

__all__ = ["build_optimizer", "build_scheduler", "clip_grad_norm", "global_grad_norm", "lr_factor"]


def build_optimizer(model: nn.Module, cfg: OptimConfig) -> torch.optim.AdamW:
    """AdamW over trainable parameters; no weight decay on 1-D parameters (norms, biases)."""
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(
        [g for g in groups if g["params"]],
        lr=cfg.lr,
        betas=(cfg.betas[0], cfg.betas[1]),
        eps=cfg.eps,
        foreach=False,
    )


def lr_factor(step: int, *, warmup_steps: int, total_steps: int, min_lr_ratio: float) -> float:
    """Learning-rate multiplier for 0-based ``step``: linear warmup, then cosine to ``min_lr_ratio``."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    span = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / span)
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: OptimConfig, total_steps: int) -> LambdaLR:
    """A ``LambdaLR`` over :func:`lr_factor` (its state is the step counter, so it checkpoints)."""

    def factor(step: int) -> float:
        return lr_factor(
            step, warmup_steps=cfg.warmup_steps, total_steps=total_steps, min_lr_ratio=cfg.min_lr_ratio
        )

    return LambdaLR(optimizer, factor)


def _shard_dims(grad: torch.Tensor) -> tuple[object, tuple[int, ...]]:
    """The mesh and the mesh dims a gradient is split over (its shards must be summed over them)."""
    if not isinstance(grad, DTensor):
        return None, ()
    # Any placement that is neither replicated nor partial splits the tensor (Shard, _StridedShard, ...).
    dims = tuple(i for i, p in enumerate(grad.placements) if not (p.is_replicate() or p.is_partial()))
    return grad.device_mesh, dims


def global_grad_norm(parameters: Iterable[torch.Tensor]) -> torch.Tensor:
    """The L2 norm of all gradients as if unsharded (a plain fp32 scalar tensor, same on every rank).

    Local squared sums are grouped by ``(mesh, split dims)`` and each group is all-reduced over
    exactly the mesh dims its gradients are sharded on (never over replicas).
    """
    groups: dict[tuple[object, tuple[int, ...]], torch.Tensor] = {}
    for p in parameters:
        if p.grad is None:
            continue
        grad = p.grad
        if isinstance(grad, DTensor) and any(pl.is_partial() for pl in grad.placements):
            grad = grad.redistribute(
                placements=[Replicate() if pl.is_partial() else pl for pl in grad.placements]
            )
        local = grad.to_local() if isinstance(grad, DTensor) else grad
        key = _shard_dims(grad)
        square = local.detach().float().pow(2).sum()
        groups[key] = groups[key] + square if key in groups else square
    total_sq = torch.zeros((), dtype=torch.float32)
    for (mesh, dims), square in groups.items():
        for dim in dims:
            dist.all_reduce(square, group=mesh.get_group(dim))
        total_sq = total_sq + square.cpu()
    return total_sq.sqrt()


def clip_grad_norm(parameters: Iterable[torch.Tensor], max_norm: float | None) -> torch.Tensor:
    """Scale gradients so their global norm is at most ``max_norm``; return the norm before clipping."""
    params = [p for p in parameters if p.grad is not None]
    total = global_grad_norm(params)
    if max_norm is not None:
        coef = min(1.0, max_norm / (float(total) + 1e-6))
        if coef < 1.0:
            for p in params:
                p.grad.mul_(coef)
    return total
