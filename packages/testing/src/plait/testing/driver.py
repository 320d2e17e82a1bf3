"""The parity driver: a parallelized model trained side by side with its unsharded reference.

Every package's tests use this one driver. On each rank, the reference (plain, unsharded, fp32)
trains on the whole global batch (the mean of every data-parallel rank's micro-batch loss) and the
parallel model on this rank's micro-batch; matching gradients therefore also prove that the
cross-rank gradient averaging happens inside the parallel model. Five global batches are used:

1. step 0: the loss and every parameter's gradient are compared, then an SGD step;
2. step 1: a second SGD step; every parameter is compared;
3. steps 2-4: AdamW steps continuing from the SGD state; each step's loss is compared, against a
   floor measured in the same run (:attr:`Parity.adamw_floor`).

The parallel loss is averaged over the world, which equals the data-parallel mean when every
data-parallel rank has the same number of peers (tensor/expert-parallel ranks share a micro-batch).
Gradients are compared relative to the reference's largest entry of that parameter
(``max|g - g_ref| / max|g_ref|``, floored at 1% of the model's largest entry, see
:func:`plait.testing.parity.max_grad_diff`), so one tolerance fits parameters of any gradient scale.

Tolerances (:data:`~plait.testing.tolerances.FP32`, :data:`~plait.testing.tolerances.BF16`) are the project's parity
contract, in :mod:`plait.testing.tolerances`.
"""

from __future__ import annotations

import contextlib
import copy
import itertools
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel
from torch.nn.parallel import DistributedDataParallel

from plait.testing.models import make_batch
from plait.testing.parity import full_tensor, max_grad_diff, max_param_diff
from plait.testing.tolerances import Parity

__all__ = [
    "ADAMW_LR",
    "Inputs",
    "SGD_LR",
    "STEPS",
    "logits_of",
    "paired",
    "run_parity",
    "token_batches",
]

Inputs = tuple[dict[str, torch.Tensor], torch.Tensor]
"""One micro-batch: the forward's keyword arguments and the next-token labels."""

SGD_LR = 0.2
ADAMW_LR = 1e-2
STEPS = 5
"""The driver's learning rates (2 SGD steps, then AdamW) and its number of global batches."""


def logits_of(output: Any) -> torch.Tensor:
    """Logits from a plain tensor output or a Hugging Face ``ModelOutput``."""
    return output if isinstance(output, torch.Tensor) else output.logits


def _loss(model: nn.Module, batch: Inputs) -> torch.Tensor:
    """Mean next-token cross entropy in fp32 (a vocab-sharded DTensor's under ``loss_parallel``)."""
    kwargs, labels = batch
    logits = logits_of(model(**kwargs))
    sharded = isinstance(logits, DTensor)
    with loss_parallel() if sharded else contextlib.nullcontext():
        return F.cross_entropy(logits.flatten(0, -2).float(), labels.flatten())


def _backward(loss: torch.Tensor) -> None:
    with loss_parallel() if isinstance(loss, DTensor) else contextlib.nullcontext():
        loss.backward()


def _world_mean(loss: torch.Tensor) -> float:
    total = full_tensor(loss).double().reshape(1).clone()
    dist.all_reduce(total)
    return float(total) / dist.get_world_size()


def paired(
    build: Callable[[], nn.Module], parallelize: Callable[[nn.Module], nn.Module]
) -> Callable[[], tuple[nn.Module, nn.Module]]:
    """``() -> (reference, parallel)``: ``build()`` after ``torch.manual_seed(0)``, and a parallelized deep copy."""

    def make() -> tuple[nn.Module, nn.Module]:
        torch.manual_seed(0)
        reference = build()
        return reference, parallelize(copy.deepcopy(reference))

    return make


def token_batches(
    vocab: int,
    dp_size: int,
    *,
    batch: int = 2,
    seq: int = 8,
    extra: Callable[[int, int], dict[str, torch.Tensor]] | None = None,
) -> list[list[Inputs]]:
    """``STEPS`` global batches of ``dp_size`` micro-batches each, identical on every rank.

    ``extra(step, dp_rank)`` adds forward inputs (e.g. ``pixel_values``) to a micro-batch.
    """
    out = []
    for step in range(STEPS):
        micro = []
        for r in range(dp_size):
            ids, labels = make_batch(vocab, batch, seq, seed=1000 * step + r)
            micro.append(({"input_ids": ids, **(extra(step, r) if extra else {})}, labels))
        out.append(micro)
    return out


def _optimizers(models: tuple[Any, Any], cls: type[torch.optim.Optimizer], lr: float) -> list:
    return [cls([p for p in m.parameters() if p.requires_grad], lr=lr) for m in models]


def _default_step(model: nn.Module, batch: Inputs) -> torch.Tensor:
    loss = _loss(model, batch)
    _backward(loss)
    return loss


@dataclass(frozen=True)
class _Plan:
    """How one parity run feeds and steps the pair (the hooks of :func:`run_parity`)."""

    batches: list[list[Inputs]]
    dp_rank: int
    local: Callable[[Inputs], Inputs] | None
    parallel_step: Callable[[Any, Inputs], torch.Tensor]

    def step(self, pair: tuple[nn.Module, Any], index: int) -> tuple[float, float]:
        """Forward and backward of global batch ``index``: the reference's loss and the world mean of the parallel one."""
        reference, model = pair
        batches = self.batches[index]
        ref_loss = torch.stack([_loss(reference, b) for b in batches]).mean()
        mine = batches[self.dp_rank]
        par_loss = self.parallel_step(model, self.local(mine) if self.local else mine)
        ref_loss.backward()
        return float(ref_loss.detach()), _world_mean(par_loss)

    def losses(self, pair: tuple[nn.Module, Any], steps: range) -> Iterator[tuple[float, float]]:
        return (self.step(pair, i) for i in steps)


def _train(
    pair: tuple[nn.Module, Any],
    cls: type[torch.optim.Optimizer],
    lr: float,
    losses: Iterable[tuple[float, float]],
    reference_losses: list[float],
) -> list[float]:
    """One optimizer step per batch index ``losses`` is asked for; returns the loss differences."""
    optimizers, diffs = _optimizers(pair, cls, lr), []
    for ref_loss, par_loss in losses:
        reference_losses.append(ref_loss)
        diffs.append(abs(ref_loss - par_loss))
        for opt in optimizers:
            opt.step()
            opt.zero_grad()
    return diffs


def _grad_norm_diff(reference: nn.Module, model: nn.Module) -> float:
    norms = [torch.nn.utils.clip_grad_norm_(m.parameters(), max_norm=1e9) for m in (reference, model)]
    return float((full_tensor(norms[0]) - full_tensor(norms[1])).abs())


def run_parity(
    models: Callable[[], tuple[nn.Module, Any]],
    batches: list[list[Inputs]],
    *,
    dp_rank: int,
    case: str = "",
    prepare_reference: Callable[[nn.Module], None] | None = None,
    inspect: Callable[[nn.Module, Any], dict[str, Any]] | None = None,
    clip_norm: bool = False,
    local_inputs: Callable[[Inputs], Inputs] | None = None,
    parallel_step: Callable[[Any, Inputs], torch.Tensor] | None = None,
    subset: bool = False,
) -> Parity:
    """Train the pair on ``batches`` (``batches[step][dp_rank]`` is this rank's micro-batch) and compare.

    Args:
        models: returns ``(reference, parallel)`` with equal initial weights (see :func:`paired`).
        batches: ``STEPS`` global batches, one micro-batch per data-parallel rank (:func:`token_batches`).
        dp_rank: this rank's data-parallel index.
        case: label carried into the result and its messages.
        prepare_reference: applied to the reference only, e.g. the freezing that the parallel side's
            ``reapply_trainability`` must reproduce.
        inspect: ``(reference, parallel) -> dict`` recorded in ``Parity.extra`` after training.
        clip_norm: also record ``extra["grad_norm_diff"]``, torch's plain ``clip_grad_norm_`` on both.
        local_inputs: what the parallel model sees of its micro-batch (e.g. a context-parallel rank's
            sequence slice with its global ``position_ids``); the mean loss must stay the world mean.
        parallel_step: ``(parallel, micro_batch) -> loss``, forward and backward of the parallel side
            (e.g. a pipeline schedule's step); default: the driver's loss and its backward.
        subset: the parallel side holds only some of the reference's parameters (a pipeline rank's
            stages, under the full model's names); only those are compared.
    """
    if len(batches) != STEPS or not all(0 <= dp_rank < len(b) for b in batches):
        raise ValueError(f"need {STEPS} global batches holding dp_rank {dp_rank}'s micro-batch")
    plan = _Plan(batches, dp_rank, local_inputs, parallel_step or _default_step)
    pair = models()
    if prepare_reference is not None:
        prepare_reference(pair[0])
    parity = _measure(pair, plan, case, subset=subset, clip_norm=clip_norm)
    if inspect is not None:
        parity.extra |= inspect(*pair)
    return parity


def _measure(pair: tuple[nn.Module, Any], plan: _Plan, case: str, *, subset: bool, clip_norm: bool) -> Parity:
    """Step 0's loss and gradients, the parameters after 2 SGD steps, then the AdamW losses."""
    strip_ddp = isinstance(pair[1], DistributedDataParallel)
    first = plan.step(pair, 0)
    grad_diff, worst_grad = max_grad_diff(*pair, strip_ddp=strip_ddp, relative=True, subset=subset)
    grads_compared = sum(p.grad is not None for p in pair[1].parameters())
    extra = {"grad_norm_diff": _grad_norm_diff(*pair)} if clip_norm else {}
    ref_losses: list[float] = []
    sgd_losses = itertools.chain([first], plan.losses(pair, range(1, 2)))
    _train(pair, torch.optim.SGD, SGD_LR, sgd_losses, ref_losses)
    param_diff, worst_param = max_param_diff(*pair, strip_ddp=strip_ddp, subset=subset)
    twin = copy.deepcopy(pair[0])
    adamw_diffs = _train(pair, torch.optim.AdamW, ADAMW_LR, plan.losses(pair, range(2, STEPS)), ref_losses)
    floor = _adamw_floor(twin, plan.batches[2:], ref_losses[2:], jitter=max(grad_diff, 1e-6))
    loss_diff = abs(first[0] - first[1])
    return Parity(
        case,
        loss_diff,
        grad_diff,
        worst_grad,
        param_diff,
        worst_param,
        adamw_diffs,
        floor,
        grads_compared,
        extra,
        ref_losses,
    )


def _adamw_floor(
    twin: nn.Module, batches: list[list[Inputs]], ref_losses: list[float], *, jitter: float
) -> float:
    """How far rounding alone moves the reference's AdamW losses: the larger of two twins' distances.

    A float64 twin (fp32 rounding against none; a model without float64 kernels gets a row-by-row
    fp32 twin), and an fp32 twin whose gradients get noise of ``jitter`` times each parameter's largest
    gradient every step - the size of the difference the parallel run's gradients measured at step 0
    (the driver's relative gradient measure), which AdamW amplifies most where gradients are small.
    """
    try:
        exact = _twin_diffs(copy.deepcopy(twin).double(), batches, ref_losses, rows=False)
    except (RuntimeError, NotImplementedError):
        exact = _twin_diffs(copy.deepcopy(twin), batches, ref_losses, rows=True)
    return max(exact, _twin_diffs(twin, batches, ref_losses, rows=False, jitter=jitter))


def _twin_diffs(
    twin: nn.Module, batches: list[list[Inputs]], ref_losses: list[float], *, rows: bool, jitter: float = 0.0
) -> float:
    generator = torch.Generator().manual_seed(0)
    optimizer = torch.optim.AdamW([p for p in twin.parameters() if p.requires_grad], lr=ADAMW_LR)
    dtype = next(twin.parameters()).dtype
    diffs = []
    for micro_batches, ref_loss in zip(batches, ref_losses, strict=True):
        pieces = [piece for batch in micro_batches for piece in (_rows(batch) if rows else [batch])]
        total = 0.0
        for kwargs, labels in pieces:
            kwargs = {k: v.to(dtype) if torch.is_floating_point(v) else v for k, v in kwargs.items()}
            logits = logits_of(twin(**kwargs))
            loss = F.cross_entropy(logits.flatten(0, -2).to(dtype), labels.flatten()) / len(pieces)
            loss.backward()
            total += float(loss.detach())
        diffs.append(abs(total - ref_loss))
        for param in twin.parameters() if jitter else ():
            if param.grad is not None:
                noise = torch.rand(param.grad.shape, generator=generator, dtype=param.grad.dtype)
                param.grad.add_(jitter * param.grad.abs().max() * (2 * noise - 1))
        optimizer.step()
        optimizer.zero_grad()
    return max(diffs, default=0.0)


def _rows(batch: Inputs) -> list[Inputs]:
    """The micro-batch one row at a time (every row has as many tokens, so the mean loss is the same)."""
    kwargs, labels = batch
    rows = labels.shape[0]
    if rows == 1 or any(isinstance(v, torch.Tensor) and v.shape[:1] != (rows,) for v in kwargs.values()):
        return [batch]
    return [
        (
            {k: v[i : i + 1] if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()},
            labels[i : i + 1],
        )
        for i in range(rows)
    ]
