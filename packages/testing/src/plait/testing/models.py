"""Test inputs the tests share: a container-layout model, the batch makers and the loss.

The reference decoders (dense, MoE, VLM) live in `plait.models`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "GLOBAL_BATCH_ROWS_PER_RANK",
    "GLOBAL_BATCH_SEQ",
    "NestedContainerModel",
    "global_batch",
    "lm_loss",
    "local_slice",
    "make_batch",
]

GLOBAL_BATCH_SEQ = 8
GLOBAL_BATCH_ROWS_PER_RANK = 2
""":func:`global_batch`: sequence length, and rows per data-parallel rank."""


class _Block(nn.Module):
    """Residual `x + fc(gelu(norm(x)))`."""

    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(hidden_size)
        self.fc = nn.Linear(hidden_size, hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc(F.gelu(self.norm(x)))


class _Stage(nn.Module):
    """A leaf projection followed by a ModuleList of blocks (a list nested in a list element)."""

    def __init__(self, hidden_size: int, num_blocks: int) -> None:
        super().__init__()
        self.proj = nn.Linear(hidden_size, hidden_size)
        self.blocks = nn.ModuleList(_Block(hidden_size) for _ in range(num_blocks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.proj(x)
        for block in self.blocks:
            x = block(x)
        return x


class NestedContainerModel(nn.Module):
    """Awkward container layouts for unit discovery; `forward(x [..., hidden]) -> [..., hidden]` uses all.

    Layout: `embed` (leaf), `towers` (ModuleDict of ModuleLists: `towers.text.0`), `mixer` (leaf),
    `stages` (ModuleList whose elements hold a ModuleList: `stages.1.blocks.0`), `grid` (ModuleList
    of ModuleLists: `grid.0.1`), `norm` and `head` (leaves).
    """

    def __init__(self, hidden_size: int = 16, num_blocks: int = 2) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.embed = nn.Linear(hidden_size, hidden_size)
        self.towers = nn.ModuleDict(
            {
                name: nn.ModuleList(_Block(hidden_size) for _ in range(num_blocks))
                for name in ("text", "image")
            }
        )
        self.mixer = nn.Linear(hidden_size, hidden_size)
        self.stages = nn.ModuleList(_Stage(hidden_size, num_blocks) for _ in range(2))
        self.grid = nn.ModuleList(
            [
                nn.ModuleList(_Block(hidden_size) for _ in range(num_blocks)),
                nn.ModuleList([_Block(hidden_size)]),
            ]
        )
        self.norm = nn.LayerNorm(hidden_size)
        self.head = nn.Linear(hidden_size, hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for tower in self.towers.values():
            for block in tower:
                h = block(h)
        h = self.mixer(h)
        for stage in self.stages:
            h = stage(h)
        for row in self.grid:
            for block in row:
                h = block(h)
        return self.head(self.norm(h))


def make_batch(vocab_size: int, batch: int, seq: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Random token ids `[batch, seq]` and their next-token labels, from a private generator.

    The global RNG is untouched, so every rank gets the same batch for the same seed.
    """
    if vocab_size < 1 or batch < 1 or seq < 1:
        raise ValueError(f"vocab_size, batch and seq must be >= 1, got {vocab_size}, {batch}, {seq}")
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(vocab_size, (batch, seq + 1), generator=generator)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def global_batch(
    vocab: int, dp_size: int, step: int, extra: Callable[[int, int], dict[str, torch.Tensor]] | None = None
) -> dict[str, torch.Tensor]:
    """The same global batch on every rank for ``step``: ``input_ids``, ``labels`` (+ ``extra(rows, step)``)."""
    gen = torch.Generator().manual_seed(1000 + step)
    rows = dp_size * GLOBAL_BATCH_ROWS_PER_RANK
    ids = torch.randint(0, vocab, (rows, GLOBAL_BATCH_SEQ + 1), generator=gen)
    batch = {"input_ids": ids[:, :-1].contiguous(), "labels": ids[:, 1:].contiguous()}
    return batch | (extra(rows, step) if extra is not None else {})


def local_slice(batch: dict[str, torch.Tensor], dp_rank: int) -> dict[str, torch.Tensor]:
    """This data-parallel rank's rows of a :func:`global_batch`."""
    lo = dp_rank * GLOBAL_BATCH_ROWS_PER_RANK
    return {k: v[lo : lo + GLOBAL_BATCH_ROWS_PER_RANK] for k, v in batch.items()}


def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean cross entropy over all tokens (labels already shifted, as `make_batch` returns them).

    Accepts vocab-sharded DTensor logits inside `torch.distributed.tensor.parallel.loss_parallel()`.
    """
    return F.cross_entropy(logits.flatten(0, -2).float(), labels.flatten())
