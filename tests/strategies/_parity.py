"""Rank-side helpers shared by the strategies tests: seeded batches, the LM loss, a parity run."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from plait.testing.parity import max_grad_diff, max_param_diff

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


@dataclass
class Parity:
    """Worst differences between a parallel model and its unsharded reference (NaN = not measured)."""

    loss_diff: float = math.nan
    grad_diff: float = math.nan
    worst_grad: str = ""
    param_diff: float = math.nan
    worst_param: str = ""
    adamw_loss_diff: float = math.nan

    def check(self) -> None:
        """fp32 parity: loss and gradients 1e-5, params after 2 SGD steps 1e-5, AdamW losses 1e-4."""
        assert self.loss_diff <= 1e-5, self
        assert self.grad_diff <= 1e-5, self
        assert self.param_diff <= 1e-5, self
        assert self.adamw_loss_diff <= 1e-4, self


def _steps(
    ref: nn.Module,
    par: nn.Module,
    batch: torch.Tensor,
    rows: Callable[[torch.Tensor], torch.Tensor],
    opt: Callable[..., torch.optim.Optimizer],
    n: int,
) -> Iterator[float]:
    ref_opt, par_opt = opt(ref.parameters()), opt(par.parameters())
    for _ in range(n):
        ref_loss, par_loss = lm_loss(ref, batch), lm_loss(par, rows(batch))
        ref_loss.backward()
        par_loss.backward()
        yield abs(mean_over_ranks(par_loss) - ref_loss.item())
        ref_opt.step()
        par_opt.step()
        ref_opt.zero_grad()
        par_opt.zero_grad()


def run_parity(
    build: Build,
    vocab: int,
    strip_ddp: bool = False,
    data_ranks: int | None = None,
    rows: Callable[[torch.Tensor], torch.Tensor] = local_rows,
) -> Parity:
    """Loss + every gradient of step 1, parameters after 2 SGD steps, losses over 3 AdamW steps.

    The reference sees the whole global batch (2 rows per data-parallel rank); each parallel rank
    sees ``rows(batch)``; the parallel loss is averaged over all ranks (equal rows per data rank and
    identical losses on ranks sharing data, so it equals the reference's mean).
    """
    batch = global_batch(vocab, data_ranks or dist.get_world_size())
    ref, par = build()
    result = Parity(loss_diff=0.0)
    for step, loss_diff in enumerate(_steps(ref, par, batch, rows, lambda p: torch.optim.SGD(p, lr=0.5), 2)):
        result.loss_diff = max(result.loss_diff, loss_diff)
        if step == 0:
            result.grad_diff, result.worst_grad = max_grad_diff(ref, par, strip_ddp=strip_ddp)
    result.param_diff, result.worst_param = max_param_diff(ref, par, strip_ddp=strip_ddp)
    ref, par = build()
    result.adamw_loss_diff = max(_steps(ref, par, batch, rows, lambda p: torch.optim.AdamW(p, lr=1e-2), 3))
    return result
