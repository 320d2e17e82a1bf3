"""The sidecar tests' entry to plait.testing's parity driver: a ``MeshContext`` gives the data-parallel
coordinates and ``parallelize_model`` is the entry point under test."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from plait.mesh import MeshContext
from plait.sidecar import parallelize_model
from plait.testing import Parity, assert_parity, paired, token_batches
from plait.testing import run_parity as _drive

__all__ = ["Parity", "assert_parity", "dp_coordinates", "run_parity"]


def dp_coordinates(ctx: MeshContext) -> tuple[int, int]:
    """``(dp_rank, dp_size)``: the ``dp`` mesh, or every rank when there is no device mesh (DDP)."""
    group = dist.group.WORLD if ctx.device_mesh is None else ctx.dp_mesh().get_group()
    return dist.get_rank(group), dist.get_world_size(group)


def run_parity(
    case: str,
    build: Callable[[], nn.Module],
    ctx: MeshContext,
    vocab: int,
    *,
    extra_inputs: Callable[[int, int], dict[str, torch.Tensor]] | None = None,
    prepare: Callable[[nn.Module], None] | None = None,
    parallelize: Callable[[nn.Module, MeshContext], nn.Module] = parallelize_model,
    inspect: Callable[[nn.Module], dict[str, Any]] | None = None,
    clip_norm: bool = False,
) -> Parity:
    """Run the driver on ``build()`` parallelized with ``ctx``.

    ``extra_inputs(rows, seed)`` adds inputs to each micro-batch of 2 rows; ``prepare`` is applied
    to the reference only; ``inspect(parallel_model)`` lands in ``Parity.extra``.
    """
    dp_rank, dp_size = dp_coordinates(ctx)
    extra = (lambda step, r: extra_inputs(2, 1000 * step + r)) if extra_inputs else None
    return _drive(
        paired(build, lambda model: parallelize(model, ctx)),
        token_batches(vocab, dp_size, extra=extra),
        dp_rank=dp_rank,
        case=case,
        prepare_reference=prepare,
        inspect=(lambda _ref, par: inspect(par)) if inspect else None,
        clip_norm=clip_norm,
    )
