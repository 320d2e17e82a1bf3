"""Megatron-FSDP through parallelize_model: the package is called last; what no parity run covers is refused.

The package itself runs on CUDA only; here a stand-in records its call (tests/strategies holds the
package-level tests and the GPU parity run).
"""

from __future__ import annotations

import sys
from typing import Any

import pytest
import torch
from torch.distributed.tensor import DTensor

from plait.mesh import MegatronFSDPConfig, MeshContext, ParallelismSizes
from plait.models import MoEDecoder, MoEDecoderConfig, MoEDecoderLayer
from plait.sidecar import parallelize_model
from tests.strategies._megatron_stand_in import install_stand_in

_TP_PLAN = {"model.layers.*.self_attn.q_proj": "colwise"}


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    return install_stand_in(monkeypatch)


def _model() -> MoEDecoder:
    torch.manual_seed(0)
    return MoEDecoder(MoEDecoderConfig())


def test_flow_calls_the_package_last_after_trainability(calls: list[dict[str, Any]], fake_pg: Any) -> None:
    model, order = _model(), []
    with fake_pg(4):
        ctx = MeshContext.build(
            MegatronFSDPConfig(zero_dp_strategy=2), reapply_trainability=lambda m: order.append(len(calls))
        )
        out = parallelize_model(model, ctx)
    assert out is model and order == [0] and len(calls) == 1
    call = calls[0]
    assert call["dp_shard_dim"] == "dp" and call["tp_dim"] == "tp"
    assert call["fsdp_unit_modules"] == [MoEDecoderLayer] and call["zero_dp_strategy"] == 2


@pytest.mark.parametrize(
    ("sizes", "ac", "refused"),
    [
        (ParallelismSizes(tp_size=2), False, "Megatron-FSDP does not support tp_size=2: no parity run"),
        (ParallelismSizes(), "full", "Megatron-FSDP does not support activation_checkpointing='full'"),
        (
            ParallelismSizes(),
            "selective",
            "Megatron-FSDP does not support activation_checkpointing='selective'",
        ),
    ],
)
def test_unverified_combinations_are_refused_before_anything_changes(
    calls: list[dict[str, Any]], fake_pg: Any, sizes: ParallelismSizes, ac: Any, refused: str
) -> None:
    model = _model()
    with fake_pg(4):
        ctx = MeshContext.build(MegatronFSDPConfig(tp_plan=_TP_PLAN), sizes, activation_checkpointing=ac)
        with pytest.raises(ValueError, match=refused):
            parallelize_model(model, ctx)
    assert not calls and not any(isinstance(p, DTensor) for p in model.parameters())


def test_missing_package_is_refused_by_the_plan(monkeypatch: pytest.MonkeyPatch, fake_pg: Any) -> None:
    monkeypatch.setitem(sys.modules, "megatron_fsdp", None)
    with fake_pg(4):
        ctx = MeshContext.build(MegatronFSDPConfig())
        with pytest.raises(ImportError, match="optional megatron-fsdp package"):
            parallelize_model(_model(), ctx)
