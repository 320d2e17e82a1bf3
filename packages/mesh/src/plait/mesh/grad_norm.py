"""Global gradient-norm clipping that is correct for gradients sharded over any DTensor meshes.

After FSDP2 + TP (+ EP, HSDP) the gradients are DTensors on *different* meshes and placements (a
TP-sharded projection on ``(dp_shard, tp)``, a norm on ``dp_shard`` only, experts on the MoE mesh,
plain tensors for an unsharded part). ``torch.nn.utils.clip_grad_norm_`` cannot combine them (it
fails with "must have the same mesh"); here the squared local sums are summed over exactly the
mesh dims each gradient is sharded on, and the groups' squares are added: the result equals the
norm of the unsharded gradients, on every rank.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate

__all__ = ["clip_grad_norm_", "global_grad_norm"]


def _shard_dims(grad: torch.Tensor) -> tuple[object, tuple[int, ...]]:
    """The mesh and the mesh dims a gradient is split over (its shards must be summed over them)."""
    if not isinstance(grad, DTensor):
        return None, ()
    # Any placement that is neither replicated nor partial splits the tensor (Shard, _StridedShard, ...).
    dims = tuple(i for i, p in enumerate(grad.placements) if not (p.is_replicate() or p.is_partial()))
    return grad.device_mesh, dims


def global_grad_norm(
    parameters: Iterable[torch.Tensor], extra_group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """The L2 norm of all gradients as if unsharded (a plain fp32 scalar on CPU, the same on every rank).

    Local squared sums are grouped by ``(mesh, split dims)`` and each group is all-reduced over
    exactly the mesh dims its gradients are sharded on (never over replicas). Every rank must call
    this with the same parameters (it is a collective over their meshes). ``extra_group``: ranks
    holding disjoint parameters (pipeline stages) whose squared sums are added as well.
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
    if extra_group is not None:
        summed = total_sq.to(next(iter(groups.values())).device if groups else "cpu")
        dist.all_reduce(summed, group=extra_group)
        total_sq = summed.cpu()
    return total_sq.sqrt()


def clip_grad_norm_(
    parameters: Iterable[torch.Tensor],
    max_norm: float | None,
    extra_group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """Scale gradients in place so their global norm is at most ``max_norm``; return the norm before.

    Args:
        parameters: every trainable parameter of the model (the same list on every rank).
        max_norm: the bound; None measures the norm without clipping.
        extra_group: see :func:`global_grad_norm` (a pipeline's pp group).

    Raises:
        ValueError: ``max_norm`` is not positive.
    """
    if max_norm is not None and not max_norm > 0:
        raise ValueError(f"max_norm must be > 0 (or None to only measure), got {max_norm!r}")
    params = [p for p in parameters if p.grad is not None]
    total = global_grad_norm(params, extra_group)
    if max_norm is not None:
        coef = min(1.0, max_norm / (float(total) + 1e-6))
        if coef < 1.0:
            for p in params:
                p.grad.mul_(coef)
    return total
