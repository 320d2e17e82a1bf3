"""AdamW, the warmup + cosine schedule, and global gradient-norm clipping that is correct for DTensors.

After FSDP2 + TP the gradients are DTensors on *different* meshes and placements (a TP-sharded
projection on ``(dp_shard, tp)``, a norm on ``dp_shard`` only, plain tensors for an unsharded
model). ``torch.nn.utils.clip_grad_norm_`` cannot combine those; here each group of equal
``(mesh, placements)`` gets its norm (a reduction over exactly its shards), and the groups'
squared norms are summed: the result equals the norm of the unsharded gradients.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import nn
from torch.distributed.tensor import DTensor
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


def _group_key(grad: torch.Tensor) -> tuple[object, ...]:
    if isinstance(grad, DTensor):
        return (grad.device_mesh, tuple(grad.placements))
    return (None, ())


def global_grad_norm(parameters: Iterable[torch.Tensor]) -> torch.Tensor:
    """The L2 norm of all gradients as if unsharded (a plain fp32 scalar tensor, same on every rank)."""
    groups: dict[tuple[object, ...], list[torch.Tensor]] = {}
    for p in parameters:
        if p.grad is not None:
            groups.setdefault(_group_key(p.grad), []).append(p.grad)
    total_sq = torch.zeros((), dtype=torch.float32)
    for grads in groups.values():
        norms = [torch.linalg.vector_norm(g, 2, dtype=torch.float32) for g in grads]
        norm = torch.linalg.vector_norm(torch.stack(norms), 2)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        total_sq = total_sq + norm.detach().float().cpu() ** 2
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
