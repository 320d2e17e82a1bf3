"""Explicit FSDP2 prefetch between consecutive units."""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn
from torch.distributed.fsdp import FSDPModule


def check_prefetch_depth(name: str, depth: int) -> None:
    """Raise unless ``depth`` is a non-negative int (0 disables that direction)."""
    if isinstance(depth, bool) or not isinstance(depth, int) or depth < 0:
        raise ValueError(f"{name} must be an int >= 0 (0 disables prefetch), got {depth!r}.")


def wire_fsdp_prefetch(units: Sequence[nn.Module], *, forward_depth: int, backward_depth: int) -> None:
    """Make each unit all-gather its neighbours ahead of time.

    Unit *i* forward-prefetches units *i+1 … i+forward_depth* and backward-prefetches
    *i-1 … i-backward_depth*, nearest first. A depth of 0 leaves that direction to FSDP's default.
    Entries that are not FSDP units (a custom ``shard_fn`` may return something else) are skipped.

    Raises:
        ValueError: for a negative or non-int depth.
    """
    check_prefetch_depth("forward_prefetch_depth", forward_depth)
    check_prefetch_depth("backward_prefetch_depth", backward_depth)
    fsdp_units = [u for u in units if isinstance(u, FSDPModule)]
    for index, unit in enumerate(fsdp_units):
        forward = fsdp_units[index + 1 : index + 1 + forward_depth]
        backward = fsdp_units[max(index - backward_depth, 0) : index][::-1]
        if forward_depth and forward:
            unit.set_modules_to_forward_prefetch(forward)
        if backward_depth and backward:
            unit.set_modules_to_backward_prefetch(backward)
