"""parallelize_model refuses what it cannot parallelize, with one clear error, before anything happens."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.fsdp import fully_shard

from plait.mesh import FSDP2Config, MeshContext, ParallelismSizes
from plait.sidecar import parallelize_model
from plait.testing import run_on_ranks


class _Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def test_not_a_module_or_not_a_context_is_a_type_error() -> None:
    with pytest.raises(TypeError, match=r"expects a torch.nn.Module, got <function .*\(function\); wrap"):
        parallelize_model(lambda x: x, None)
    with pytest.raises(TypeError, match=r"expects a plait.mesh.MeshContext, got dict; build one"):
        parallelize_model(_Tiny(), {"tp_size": 2})


def _refusal(model: nn.Module, ctx: MeshContext) -> str:
    before = [(n, type(m)) for n, m in model.named_modules()]
    try:
        parallelize_model(model, ctx)
    except ValueError as err:
        assert [(n, type(m)) for n, m in model.named_modules()] == before, "nothing may change"
        return str(err)
    return "accepted"


def _already_parallelized() -> dict[str, str]:
    ctx = MeshContext.build(FSDP2Config(), ParallelismSizes())
    twice = parallelize_model(_Tiny(), ctx)
    by_hand = _Tiny()
    fully_shard(by_hand.layers[1], mesh=ctx.fsdp_mesh())
    return {"twice": _refusal(twice, ctx), "by_hand": _refusal(by_hand, ctx)}


def test_an_already_parallelized_model_is_refused_on_every_rank() -> None:
    for out in run_on_ranks(_already_parallelized, 2, timeout=120):
        assert "already parallelized (returned by an earlier parallelize_model call)" in out["twice"]
        assert "module 'layers.1' is an FSDP2 unit" in out["by_hand"]
        assert "call parallelize_model once, on the plain model" in out["by_hand"]
