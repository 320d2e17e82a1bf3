"""Torch's fake process group: one process pretends to be one rank of a huge world."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

__all__ = ["fake_process_group"]


@contextlib.contextmanager
def fake_process_group(world_size: int, rank: int = 0) -> Iterator[dist.ProcessGroup]:
    """Initialise the default group with the fake backend for the duration of the block.

    Collectives return immediately without communicating (their results are meaningless), so
    this is for code that only builds meshes, plans or sharding specs. `init_device_mesh("cpu",
    shape, mesh_dim_names=...)` works inside for worlds of 16,384 ranks and more.

    Args:
        world_size: pretended number of ranks.
        rank: the rank this process plays.

    Yields:
        The default (fake) process group; it is destroyed on exit.
    """
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"need world_size >= 1 and 0 <= rank < world_size, got {world_size=}, {rank=}.")
    if dist.is_initialized():
        raise RuntimeError(
            "fake_process_group needs a process without a default process group; this one already has "
            f"a {dist.get_backend()!r} group of {dist.get_world_size()} ranks (do not use it inside run_on_ranks)."
        )
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield dist.group.WORLD
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
