"""The one flow under each strategy config: unsharded FSDP2, DDP, MoE, and the errors."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from plait.mesh import DDPConfig, FSDP2Config, MeshContext, MoEConfig, ParallelismSizes
from plait.models import DecoderConfig, DenseDecoder, MoEDecoder, MoEDecoderConfig
from plait.sidecar import parallelize_model
from plait.testing import run_on_ranks
from tests.sidecar._parity import Parity, assert_parity, run_parity

VOCAB = 64


def _dense() -> nn.Module:
    return DenseDecoder(DecoderConfig(vocab_size=VOCAB))


def _summary(model: nn.Module) -> dict[str, Any]:
    return {
        "type": type(model).__name__,
        "fsdp": any(isinstance(m, FSDPModule) for m in model.modules()),
        "ddp": isinstance(model, DistributedDataParallel),
        "dtensors": sum(isinstance(p, DTensor) for p in model.parameters()),
        "checkpointed": sum(isinstance(m, CheckpointWrapper) for m in model.modules()),
        "trainable": sum(p.requires_grad for p in model.parameters()),
    }


def _freeze_norms(model: nn.Module) -> None:
    for name, p in model.named_parameters():
        if "norm" in name:
            p.requires_grad_(False)


def _single_rank_fsdp2() -> Parity:
    ctx = MeshContext.build(
        FSDP2Config(mp_policy=None), activation_checkpointing="full", reapply_trainability=_freeze_norms
    )
    return run_parity("world1", _dense, ctx, VOCAB, prepare=_freeze_norms, inspect=_summary)


def test_world_size_one_takes_the_unsharded_path_with_ac_and_trainability() -> None:
    (result,) = run_on_ranks(_single_rank_fsdp2, 1)
    assert_parity([result])
    s = result.extra
    assert not s["fsdp"] and s["dtensors"] == 0, s
    assert s["checkpointed"] == 8, s
    # embed, q/k/v/o + 3 MLP per layer, lm_head; every norm frozen by reapply_trainability.
    assert s["trainable"] == 1 + 2 * 7 + 1, s


def _ddp() -> Parity:
    ctx = MeshContext.build(DDPConfig(), activation_checkpointing="full")
    return run_parity("ddp", _dense, ctx, VOCAB, inspect=_summary)


def test_ddp_with_full_checkpointing_checkpoints_every_submodule_and_matches_reference() -> None:
    results = run_on_ranks(_ddp, 2)
    assert_parity(results)
    assert all(r.extra["ddp"] and r.extra["checkpointed"] == 8 for r in results), results


def _moe_model() -> nn.Module:
    return MoEDecoder(MoEDecoderConfig(vocab_size=VOCAB, num_experts=4, num_hidden_layers=2))


def _moe(ac: str | bool) -> Parity:
    ctx = MeshContext.build(
        FSDP2Config(mp_policy=None),
        ParallelismSizes(ep_size=2),
        moe_config=MoEConfig(),
        activation_checkpointing=ac,
    )
    return run_parity(f"moe/ac={ac}", _moe_model, ctx, VOCAB, inspect=_summary)


def _moe_cases() -> list[Parity]:
    return [_moe(False), _moe("full")]


def test_moe_with_expert_parallel_matches_reference() -> None:
    results = run_on_ranks(_moe_cases, 4)
    assert_parity(results)
    for rank in results:
        assert all(r.extra["fsdp"] and r.extra["dtensors"] for r in rank), rank
        assert rank[1].extra["checkpointed"] > 0, rank[1]


@dataclass(frozen=True)
class NotAStrategy:
    """A strategy config plait does not know."""


def test_unsupported_strategy_config_is_a_type_error() -> None:
    ctx = MeshContext(device_mesh=None, strategy_config=NotAStrategy())
    with pytest.raises(TypeError, match="NotAStrategy"):
        parallelize_model(_dense(), ctx)


def test_fsdp2_without_device_mesh_is_an_error() -> None:
    ctx = MeshContext(device_mesh=None, strategy_config=FSDP2Config())
    with pytest.raises(ValueError, match="device_mesh"):
        parallelize_model(_dense(), ctx)
