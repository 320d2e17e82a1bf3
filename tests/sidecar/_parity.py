"""Shared rank-side parity driver: one parallelized model vs its unsharded reference, fp32.

Every rank builds the same seeded model, keeps an unsharded copy as the reference and
parallelizes the other through `parallelize_model`. The reference trains on the whole global
batch; each data-parallel rank trains on its slice (tensor-parallel peers share a slice), so
matching gradients also proves the cross-rank gradient averaging happens inside the model.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel
from torch.nn.parallel import DistributedDataParallel

from plait.mesh import MeshContext
from plait.sidecar import parallelize_model
from plait.testing.parity import max_grad_diff, max_param_diff

SEQ = 8
PER_RANK_BATCH = 2
SGD_LR = 0.2
ADAMW_LR = 1e-2


@dataclass
class Parity:
    """Differences between the parallel and the reference run (each a max abs difference)."""

    case: str
    loss_diff: float
    grad_diff: float
    worst_grad: str
    sgd_param_diff: float
    worst_param: str
    adamw_loss_diffs: list[float]
    grads_compared: int
    extra: dict[str, Any] = field(default_factory=dict)


def logits_of(output: Any) -> torch.Tensor:
    """Logits from a plain tensor output or a Hugging Face ``ModelOutput``."""
    return output if isinstance(output, torch.Tensor) else output.logits


def _loss_and_backward(model: nn.Module, batch: dict[str, torch.Tensor]) -> float:
    """Mean next-token cross-entropy over ``batch``; backward included (under loss parallel for DTensors)."""
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    logits = logits_of(model(**inputs))
    sharded = isinstance(logits, DTensor)
    with loss_parallel() if sharded else contextlib.nullcontext():
        loss = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten())
        loss.backward()
    return float((loss.full_tensor() if sharded else loss).detach())


def global_batch(
    vocab: int, dp_size: int, step: int, extra: Callable[[int, int], dict] | None = None
) -> dict:
    """The same global batch on every rank for ``step``: ``input_ids``, ``labels`` (+ ``extra``)."""
    gen = torch.Generator().manual_seed(1000 + step)
    n = dp_size * PER_RANK_BATCH
    ids = torch.randint(0, vocab, (n, SEQ + 1), generator=gen)
    batch = {"input_ids": ids[:, :-1].contiguous(), "labels": ids[:, 1:].contiguous()}
    if extra is not None:
        batch.update(extra(n, step))
    return batch


def local_slice(batch: dict, dp_rank: int) -> dict:
    """This data-parallel rank's rows of ``batch``."""
    lo = dp_rank * PER_RANK_BATCH
    return {k: v[lo : lo + PER_RANK_BATCH] for k, v in batch.items()}


def _dp_group(ctx: MeshContext) -> dist.ProcessGroup | None:
    """The data-parallel group: the ``dp`` mesh, or every rank when there is no device mesh (DDP)."""
    return dist.group.WORLD if ctx.device_mesh is None else ctx.dp_mesh().get_group()


def dp_coordinates(ctx: MeshContext) -> tuple[int, int]:
    """``(dp_rank, dp_size)`` of this rank."""
    group = _dp_group(ctx)
    return dist.get_rank(group), dist.get_world_size(group)


def _dp_mean(value: float, ctx: MeshContext) -> float:
    """Mean of ``value`` over the data-parallel ranks (the reference loss is the global-batch mean)."""
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, group=_dp_group(ctx))
    return float(t) / dist.get_world_size(_dp_group(ctx))


def run_parity(
    case: str,
    build: Callable[[], nn.Module],
    ctx: MeshContext,
    vocab: int,
    *,
    extra_inputs: Callable[[int, int], dict] | None = None,
    prepare: Callable[[nn.Module], None] | None = None,
    parallelize: Callable[[nn.Module, MeshContext], nn.Module] = parallelize_model,
    inspect: Callable[[nn.Module], dict[str, Any]] | None = None,
    clip_norm: bool = False,
) -> Parity:
    """Compare one step's loss and gradients, params after 2 SGD steps, losses over 3 AdamW steps.

    Args:
        case: label carried into the result.
        build: builds the seeded model (called once; the reference is a deep copy).
        ctx: the mesh context the parallel copy is parallelized with.
        vocab: vocabulary size for the token batches.
        extra_inputs: ``(rows, step) -> dict`` of extra global-batch inputs (e.g. pixel values).
        prepare: applied to the reference only: what the context's ``reapply_trainability`` must
            reproduce on the parallel copy (e.g. freezing a tower).
        parallelize: the entry point under test.
        inspect: ``model -> dict`` recorded from the parallelized model into ``Parity.extra``.
        clip_norm: also run torch's plain ``clip_grad_norm_`` on both after the first backward and
            record the difference of the total norms as ``extra["grad_norm_diff"]``.
    """
    torch.manual_seed(0)
    reference = build()
    model = parallelize(copy.deepcopy(reference), ctx)
    if prepare is not None:
        prepare(reference)
    dp_rank, dp_size = dp_coordinates(ctx)

    def step_losses(step: int) -> tuple[float, float]:
        batch = global_batch(vocab, dp_size, step, extra_inputs)
        ref_loss = _loss_and_backward(reference, batch)
        par_loss = _dp_mean(_loss_and_backward(model, local_slice(batch, dp_rank)), ctx)
        return ref_loss, par_loss

    strip_ddp = isinstance(model, DistributedDataParallel)
    ref_loss, par_loss = step_losses(0)
    grad_diff, worst_grad = max_grad_diff(reference, model, strip_ddp=strip_ddp)
    grads_compared = sum(p.grad is not None for p in reference.parameters())
    extra: dict[str, Any] = {}
    if clip_norm:
        norms = [torch.nn.utils.clip_grad_norm_(m.parameters(), max_norm=1e9) for m in (reference, model)]
        full = [n.full_tensor() if isinstance(n, DTensor) else n for n in norms]
        extra["grad_norm_diff"] = float((full[0] - full[1]).abs())
    sgd = [
        torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=SGD_LR) for m in (reference, model)
    ]
    for step in (1, 2):
        for opt in sgd:
            opt.step()
            opt.zero_grad()
        if step == 1:
            step_losses(step)
    param_diff, worst_param = max_param_diff(reference, model, strip_ddp=strip_ddp)
    adamw = [
        torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=ADAMW_LR)
        for m in (reference, model)
    ]
    adamw_diffs = []
    for step in range(3, 6):
        r, p = step_losses(step)
        adamw_diffs.append(abs(r - p))
        for opt in adamw:
            opt.step()
            opt.zero_grad()
    return Parity(
        case=case,
        loss_diff=abs(ref_loss - par_loss),
        grad_diff=grad_diff,
        worst_grad=worst_grad,
        sgd_param_diff=param_diff,
        worst_param=worst_param,
        adamw_loss_diffs=adamw_diffs,
        grads_compared=grads_compared,
        extra=extra | (inspect(model) if inspect is not None else {}),
    )


def assert_parity(results: list[list[Parity]] | list[Parity]) -> None:
    """Assert every rank's every case is within the fp32 parity tolerances."""
    flat = [p for r in results for p in (r if isinstance(r, list) else [r])]
    assert flat, "no parity results"
    for p in flat:
        assert p.grads_compared > 0, f"{p.case}: no gradients compared"
        assert p.loss_diff <= 1e-5, f"{p.case}: loss differs by {p.loss_diff}"
        assert p.grad_diff <= 1e-5, f"{p.case}: gradient {p.worst_grad} differs by {p.grad_diff}"
        assert p.sgd_param_diff <= 1e-5, (
            f"{p.case}: after 2 SGD steps {p.worst_param} differs by {p.sgd_param_diff}"
        )
        assert max(p.adamw_loss_diffs) <= 1e-4, f"{p.case}: AdamW losses differ by {p.adamw_loss_diffs}"
