"""Rank-side parity runner: a sharded model against its unsharded copy on the global batch."""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from plait.testing.models import lm_loss, make_batch
from plait.testing.parity import max_grad_diff, max_param_diff

Inputs = tuple[dict[str, torch.Tensor], torch.Tensor]
"""One micro-batch: forward kwargs and next-token labels."""


@dataclass
class Parity:
    """What one rank measured; every number is |parallel - reference|."""

    loss_diff: float
    grad_diff: float
    worst_grad: str
    param_diff_after_sgd: float
    worst_param: str
    adamw_loss_diffs: list[float]
    extra: dict[str, Any] = field(default_factory=dict)

    def check(self) -> None:
        """Assert the contract tolerances (fp32)."""
        assert self.loss_diff <= 1e-5, self
        assert self.grad_diff <= 1e-5, (self.worst_grad, self.grad_diff)
        assert self.param_diff_after_sgd <= 1e-5, (self.worst_param, self.param_diff_after_sgd)
        assert max(self.adamw_loss_diffs) <= 1e-4, self.adamw_loss_diffs


def _loss(model: nn.Module, batch: Inputs) -> torch.Tensor:
    kwargs, labels = batch
    return lm_loss(model(**kwargs), labels)


def run_parity(
    build: Callable[[], nn.Module],
    shard: Callable[[nn.Module], nn.Module],
    batches: list[list[Inputs]],
    dp_rank: int,
    inspect: Callable[[nn.Module, nn.Module], dict[str, Any]] | None = None,
) -> Parity:
    """Train ``shard(copy)`` on this rank's micro-batch and ``build()`` on all of them; compare.

    Args:
        build: Builds the seeded reference model (called after ``torch.manual_seed(0)``).
        shard: Parallelizes a deep copy and returns the model to run.
        batches: ``batches[step][dp_rank]`` = (forward kwargs, labels); 5 steps: 1 compared
            gradient, 2 SGD steps, then 3 AdamW steps.
        dp_rank: This rank's index among the data-parallel ranks.
        inspect: Optional ``(ref, par) -> dict`` run after training; its result lands in ``extra``.
    """
    torch.manual_seed(0)
    ref = build()
    par = shard(copy.deepcopy(ref))

    def par_loss(step: int) -> torch.Tensor:
        return _loss(par, batches[step][dp_rank])

    def ref_loss(step: int) -> torch.Tensor:
        return torch.stack([_loss(ref, batch) for batch in batches[step]]).mean()

    def global_loss(loss: torch.Tensor) -> float:
        total = loss.detach().clone()
        dist.all_reduce(total)
        return total.item() / len(batches[0])

    sgd_ref, sgd_par = torch.optim.SGD(ref.parameters(), lr=0.5), torch.optim.SGD(par.parameters(), lr=0.5)
    loss_ref, loss_par = ref_loss(0), par_loss(0)
    loss_ref.backward()
    loss_par.backward()
    loss_diff = abs(loss_ref.item() - global_loss(loss_par))
    grad_diff, worst_grad = max_grad_diff(ref, par)
    for step in (0, 1):
        if step:
            ref_loss(step).backward()
            par_loss(step).backward()
        sgd_ref.step()
        sgd_par.step()
        sgd_ref.zero_grad()
        sgd_par.zero_grad()
    param_diff, worst_param = max_param_diff(ref, par)

    adam_ref, adam_par = (
        torch.optim.AdamW(ref.parameters(), lr=1e-2),
        torch.optim.AdamW(par.parameters(), lr=1e-2),
    )
    adamw_diffs = []
    for step in (2, 3, 4):
        loss_ref, loss_par = ref_loss(step), par_loss(step)
        adamw_diffs.append(abs(loss_ref.item() - global_loss(loss_par)))
        loss_ref.backward()
        loss_par.backward()
        adam_ref.step()
        adam_par.step()
        adam_ref.zero_grad()
        adam_par.zero_grad()
    extra = inspect(ref, par) if inspect else {}
    return Parity(loss_diff, grad_diff, worst_grad, param_diff, worst_param, adamw_diffs, extra)


def token_batches(
    vocab: int, dp_size: int, *, batch: int = 2, seq: int = 8, steps: int = 5
) -> list[list[Inputs]]:
    """``steps`` global batches, one micro-batch per data-parallel rank (identical on every rank)."""
    return [
        [
            ({"input_ids": ids}, labels)
            for ids, labels in (make_batch(vocab, batch, seq, seed=step * 100 + r) for r in range(dp_size))
        ]
        for step in range(steps)
    ]
