"""Megatron-FSDP through parallelize_model: the package is called last, after TP and trainability.

The package itself runs on CUDA only; here a stand-in records its call (tests/strategies holds the
package-level tests and the GPU parity run).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch.distributed.tensor import DTensor

from plait.mesh import MegatronFSDPConfig, MeshContext, ParallelismSizes
from plait.models import MoEDecoder, MoEDecoderConfig, MoEDecoderLayer
from plait.sidecar import parallelize_model
from tests.strategies._megatron_stand_in import CURRENT, stand_in

_TP_PLAN = {"model.layers.*.self_attn.q_proj": "colwise"}


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[dict[str, Any]]]:
    recorded: list[dict[str, Any]] = []
    monkeypatch.setitem(sys.modules, "megatron_fsdp", stand_in("0.6.1", CURRENT, recorded))
    yield recorded


def _model() -> MoEDecoder:
    torch.manual_seed(0)
    return MoEDecoder(MoEDecoderConfig())


@pytest.mark.parametrize(
    ("sizes", "shard_dim", "tp_applied"),
    [
        (ParallelismSizes(), "dp", False),
        (ParallelismSizes(tp_size=2), "dp", True),
    ],
)
def test_flow_calls_the_package_after_tp_and_trainability(
    calls: list[dict[str, Any]], fake_pg: Any, sizes: ParallelismSizes, shard_dim: str, tp_applied: bool
) -> None:
    model, order = _model(), []
    config = MegatronFSDPConfig(zero_dp_strategy=2, tp_plan=_TP_PLAN)
    with fake_pg(4):
        ctx = MeshContext.build(config, sizes, reapply_trainability=lambda m: order.append(len(calls)))
        out = parallelize_model(model, ctx)
    assert out is model and order == [0] and len(calls) == 1
    call = calls[0]
    assert call["dp_shard_dim"] == shard_dim and call["tp_dim"] == "tp"
    assert call["fsdp_unit_modules"] == [MoEDecoderLayer] and call["zero_dp_strategy"] == 2
    assert call["tp_applied"] is tp_applied


def test_single_data_parallel_rank_applies_tp_only(monkeypatch: pytest.MonkeyPatch, fake_pg: Any) -> None:
    monkeypatch.setitem(sys.modules, "megatron_fsdp", None)  # not needed: nothing to shard
    model = _model()
    with fake_pg(2):
        ctx = MeshContext.build(MegatronFSDPConfig(tp_plan=_TP_PLAN), ParallelismSizes(tp_size=2))
        with pytest.warns(
            UserWarning, match=r"dp=1, cp=1: one data-parallel rank, nothing to shard \(tp=2\)"
        ):
            out = parallelize_model(model, ctx)
    assert out is model
    assert isinstance(model.model.layers[1].self_attn.q_proj.weight, DTensor)


def test_missing_package_is_refused_by_the_plan_before_tp(
    monkeypatch: pytest.MonkeyPatch, fake_pg: Any
) -> None:
    monkeypatch.setitem(sys.modules, "megatron_fsdp", None)
    model = _model()
    with fake_pg(4):
        ctx = MeshContext.build(MegatronFSDPConfig(tp_plan=_TP_PLAN), ParallelismSizes(tp_size=2))
        with pytest.raises(ImportError, match="optional megatron-fsdp package"):
            parallelize_model(model, ctx)
    assert not isinstance(model.model.layers[1].self_attn.q_proj.weight, DTensor)  # nothing changed
