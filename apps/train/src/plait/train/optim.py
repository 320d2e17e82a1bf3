"""AdamW, the warmup + cosine schedule, and the trainer's call of plait.mesh's global-norm clipping."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.optim.lr_scheduler import LambdaLR

from plait.mesh import clip_grad_norm_, global_grad_norm
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


def clip_grad_norm(
    parameters: Iterable[torch.Tensor],
    max_norm: float | None,
    extra_group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """:func:`plait.mesh.clip_grad_norm_` (``optim.grad_clip``; None only measures the norm).

    ``extra_group``: the pipeline's pp group (the stages hold disjoint parameters).
    """
    return clip_grad_norm_(parameters, max_norm, extra_group=extra_group)
