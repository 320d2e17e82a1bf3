"""Rank-side helpers shared by the strategies tests: seeded batches and the LM loss for the tests that
are not parity runs, and the entry to plait.testing's parity driver."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from plait.testing import Parity, token_batches
from plait.testing import run_parity as _drive

Build = Callable[[], tuple[nn.Module, nn.Module]]
"""Returns ``(reference, parallelized)`` models with equal initial weights."""


def global_batch(vocab: int, world: int, per_rank: int = 2, seq: int = 8, seed: int = 1) -> torch.Tensor:
    """The same token batch on every rank; rank r trains on rows ``[r*per_rank, (r+1)*per_rank)``."""
    return torch.randint(0, vocab, (world * per_rank, seq), generator=torch.Generator().manual_seed(seed))


def local_rows(
    batch: torch.Tensor, data_rank: int | None = None, data_ranks: int | None = None
) -> torch.Tensor:
    """This rank's rows: one equal slice per data-parallel rank (default: every rank is one)."""
    rank = dist.get_rank() if data_rank is None else data_rank
    world = dist.get_world_size() if data_ranks is None else data_ranks
    per_rank = batch.shape[0] // world
    return batch[rank * per_rank : (rank + 1) * per_rank]


def lm_loss(model: Callable[[torch.Tensor], torch.Tensor], ids: torch.Tensor) -> torch.Tensor:
    logits = model(ids)
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())


def mean_over_ranks(value: torch.Tensor) -> float:
    out = value.detach().clone()
    dist.all_reduce(out)
    return out.item() / dist.get_world_size()


def run_parity(build: Build, vocab: int, *, dp_rank: int | None = None, dp_size: int | None = None) -> Parity:
    """The driver on ``build()``'s pair; data-parallel coordinates default to (rank, world size)."""
    size = dist.get_world_size() if dp_size is None else dp_size
    return _drive(build, token_batches(vocab, size), dp_rank=dist.get_rank() if dp_rank is None else dp_rank)
