"""parallelize_model compares the model's structure across ranks before any collective."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from plait.mesh import FSDP2Config, MeshContext, ParallelismSizes
from plait.models import DecoderConfig, DenseDecoder
from plait.sidecar import parallelize_model
from plait.testing import run_on_ranks


def _decoder(layers: int) -> nn.Module:
    return DenseDecoder(DecoderConfig(num_hidden_layers=layers))


def _structures() -> tuple[bool, str | None]:
    rank = dist.get_rank()
    ctx = MeshContext.build(FSDP2Config(), ParallelismSizes())
    torch.manual_seed(rank)  # different values are fine: only the structure is compared
    agreed = isinstance(parallelize_model(_decoder(2), ctx), nn.Module)
    try:
        parallelize_model(_decoder(3 if rank == 1 else 2), ctx)
    except ValueError as err:
        return agreed, str(err)
    return agreed, None


def test_a_layer_count_that_differs_on_one_rank_is_named_on_every_rank() -> None:
    results = run_on_ranks(_structures, 2, timeout=120)
    assert [agreed for agreed, _ in results] == [True, True]
    message = results[0][1]
    assert message is not None and message == results[1][1], "every rank raises the same message"
    assert "\n" not in message and "rank 1 has" in message and "1 of 2 ranks differ" in message
    assert "where rank 0 has (absent) (+" in message and "parameter " in message
