"""The token loss: cross entropy summed over target tokens, vocab-parallel when the logits are sharded."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from plait.sidecar import chunked_loss, chunked_loss_sum

__all__ = ["IGNORE_INDEX", "TokenLoss", "is_vocab_sharded", "loss_context", "token_loss_sum"]

IGNORE_INDEX = -100
"""Label value that contributes no loss (padding, masked positions)."""


def is_vocab_sharded(logits: torch.Tensor) -> bool:
    """Whether ``logits`` is a DTensor sharded on its vocabulary (last) dimension."""
    return isinstance(logits, DTensor) and any(
        p.is_shard() and p.dim in (-1, logits.ndim - 1) for p in logits.placements
    )


def loss_context(logits: torch.Tensor) -> contextlib.AbstractContextManager[None]:
    """``loss_parallel()`` for vocab-sharded logits, else a no-op context."""
    return loss_parallel() if is_vocab_sharded(logits) else contextlib.nullcontext()


def token_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum of token cross-entropies (call inside :func:`loss_context`)."""
    if isinstance(logits, DTensor) and not is_vocab_sharded(logits):
        logits = logits.full_tensor()
    return F.cross_entropy(
        logits.flatten(0, 1).float(), labels.flatten(), reduction="sum", ignore_index=IGNORE_INDEX
    )


@dataclass(frozen=True)
class TokenLoss:
    """A micro-batch's token-loss sum from the model's full logits, or chunked (``train.loss``)."""

    model: nn.Module
    chunked: bool
    chunk_tokens: int | None = None
    """None: `plait.sidecar`'s default."""

    def __call__(
        self, forward: Callable[[], torch.Tensor], labels: torch.Tensor, scale: float | None
    ) -> torch.Tensor:
        """The sum over ``labels`` of ``forward()``'s loss; back-propagated times ``scale`` unless None."""
        if self.chunked:
            chunk = {} if self.chunk_tokens is None else {"chunk_tokens": self.chunk_tokens}
            with chunked_loss(self.model, labels, ignore_index=IGNORE_INDEX, **chunk):
                losses = forward()  # the model's output: per-token losses in place of logits
            total = chunked_loss_sum(losses, labels)
            if scale is not None:
                (total * scale).backward()
            return total
        logits = forward()
        with loss_context(logits):  # loss parallel covers the backward too
            total = token_loss_sum(logits, labels)
            if scale is not None:
                (total * scale).backward()
        return total
