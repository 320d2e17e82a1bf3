"""The parity driver: a correct data-parallel model passes, a missing gradient average fails, and the
bf16 tolerances accept a bf16 model that the fp32 ones refuse."""

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from plait.models import DecoderConfig, DenseDecoder
from plait.testing import (
    BF16,
    FP32,
    Inputs,
    Parity,
    assert_parity,
    paired,
    run_on_ranks,
    run_parity,
    token_batches,
)


def _build() -> nn.Module:
    return DenseDecoder(DecoderConfig(vocab_size=64))


def _cases() -> list[Parity]:
    batches, rank = token_batches(64, dist.get_world_size()), dist.get_rank()
    cases = {
        "ddp": lambda m: DistributedDataParallel(m),
        "no_average": lambda m: m,  # each rank keeps its own micro-batch's gradient
        "ddp_bf16": lambda m: DistributedDataParallel(m.to(torch.bfloat16)),
    }
    results = [
        run_parity(paired(_build, wrap), batches, dp_rank=rank, case=name) for name, wrap in cases.items()
    ]
    doubled = run_parity(  # a parallel step whose backward doubles the gradient
        paired(_build, DistributedDataParallel), batches, dp_rank=rank, case="doubled", parallel_step=_doubled
    )
    return [*results, doubled]


def _doubled(model: nn.Module, batch: Inputs) -> torch.Tensor:
    kwargs, labels = batch
    loss = F.cross_entropy(model(**kwargs).flatten(0, -2), labels.flatten())
    (2 * loss).backward()
    return loss


def test_driver_passes_ddp_and_catches_a_missing_gradient_average() -> None:
    results = run_on_ranks(_cases, 2)
    for rank in results:
        ddp, no_average, bf16, doubled = rank
        ddp.check(FP32)
        assert len(ddp.reference_losses) == 5 and ddp.reference_losses[0] != ddp.reference_losses[-1]
        assert doubled.loss_diff <= 1e-5 and doubled.grad_diff > 0.9, doubled
        assert ddp.grads_compared == len(list(_build().parameters())) and len(ddp.adamw_loss_diffs) == 3
        with pytest.raises(AssertionError, match=r"no_average: gradient of .* relative"):
            no_average.check(BF16)  # even the loose tolerances refuse it
        assert no_average.grad_diff > 0.1
        bf16.check(BF16)
        with pytest.raises(AssertionError, match="ddp_bf16"):
            bf16.check(FP32)
    assert_parity([rank[0] for rank in results])


def test_driver_refuses_batches_that_do_not_fit() -> None:
    model = _build()
    with pytest.raises(ValueError, match="need 5 global batches holding dp_rank 2"):
        run_parity(lambda: (model, copy.deepcopy(model)), token_batches(64, 2), dp_rank=2)
