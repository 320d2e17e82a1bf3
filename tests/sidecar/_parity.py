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
from plait.testing import Inputs, Parity, assert_parity, global_batch, local_slice, logits_of, paired
from plait.testing import run_parity as _drive

__all__ = [
    "BATCH_STEPS",
    "Parity",
    "assert_parity",
    "dp_coordinates",
    "logits_of",
    "run_parity",
]

BATCH_STEPS = (0, 1, 3, 4, 5)
"""The global batches the driver's five steps use (the MoE tests' router margins are checked on these)."""


def _micro_batches(batch: dict[str, torch.Tensor], dp_size: int) -> list[Inputs]:
    slices = [local_slice(batch, r) for r in range(dp_size)]
    return [({k: v for k, v in rows.items() if k != "labels"}, rows["labels"]) for rows in slices]


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

    ``extra_inputs(rows, step)`` adds inputs to the global batch; ``prepare`` is applied to the
    reference only; ``inspect(parallel_model)`` lands in ``Parity.extra``.
    """
    dp_rank, dp_size = dp_coordinates(ctx)
    batches = [
        _micro_batches(global_batch(vocab, dp_size, step, extra_inputs), dp_size) for step in BATCH_STEPS
    ]
    return _drive(
        paired(build, lambda model: parallelize(model, ctx)),
        batches,
        dp_rank=dp_rank,
        case=case,
        prepare_reference=prepare,
        inspect=(lambda _ref, par: inspect(par)) if inspect else None,
        clip_norm=clip_norm,
    )
