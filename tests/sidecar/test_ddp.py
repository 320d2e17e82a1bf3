"""DDP through parallelize_model on real gloo ranks: with activation checkpointing it trains like the unsharded model."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
from torch.nn.parallel import DistributedDataParallel

from plait.mesh import DDPConfig, MeshContext
from plait.models import DecoderConfig, DenseDecoder
from plait.sidecar import parallelize_model
from plait.strategies import wrap_ddp
from plait.testing import run_on_ranks
from tests.strategies._parity import Parity, run_parity

_CFG = DecoderConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2)


def _build(ac: bool | str) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    ref = DenseDecoder(_CFG)
    par = parallelize_model(copy.deepcopy(ref), MeshContext.build(DDPConfig(), activation_checkpointing=ac))
    return ref, par


def _ddp_parity(ac: bool | str) -> tuple[Parity, str, int]:
    _, par = _build(ac)
    wrappers = sum(isinstance(m, CheckpointWrapper) for m in par.modules())
    return run_parity(lambda: _build(ac), _CFG.vocab_size), type(par).__name__, wrappers


@pytest.mark.parametrize(("world", "ac"), [(2, "full"), (4, "selective"), (4, False)])
def test_ddp_matches_reference(world: int, ac: bool | str) -> None:
    for parity, wrapper, checkpointed in run_on_ranks(_ddp_parity, world, ac):
        parity.check()
        assert wrapper == DistributedDataParallel.__name__
        assert (checkpointed > 0) == bool(ac)


def _single_rank(scope: str) -> tuple[str, list[str], bool, list[str]]:
    torch.manual_seed(0)
    model = DenseDecoder(_CFG)
    frozen = []

    def freeze_embeddings(m: nn.Module) -> None:
        m.model.embed_tokens.weight.requires_grad_(False)
        frozen.append(True)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ctx = MeshContext.build(
            DDPConfig(activation_checkpointing_scope=scope),
            activation_checkpointing=True,
            reapply_trainability=freeze_embeddings,
        )
        out = parallelize_model(model, ctx)
    wrapped = [n for n, m in out.named_modules() if isinstance(m, CheckpointWrapper)]
    refrozen = bool(frozen) and not out.model.embed_tokens.weight.requires_grad
    return type(out).__name__, wrapped, refrozen, [str(w.message) for w in caught]


def test_world_one_is_unwrapped_with_ac_per_scope() -> None:
    name, wrapped, refrozen, _ = run_on_ranks(_single_rank, 1, "language")[0]
    assert name == DenseDecoder.__name__
    assert "model.layers.0.mlp" in wrapped and "model.layers.1.self_attn" in wrapped
    assert refrozen


def test_scope_without_matching_layers_checkpoints_nothing() -> None:
    name, wrapped, _, warned = run_on_ranks(_single_rank, 1, "vision")[0]
    assert name == DenseDecoder.__name__ and wrapped == []
    assert any("scope ('vision',) selects no trainable layer" in w for w in warned), warned


def test_wrong_config_type() -> None:
    with pytest.raises(TypeError, match="wrap_ddp needs a DDPConfig, got dict"):
        wrap_ddp(nn.Linear(2, 2), MeshContext(device_mesh=None, strategy_config={}))


def _meta_model_error() -> str:
    with torch.device("meta"):
        model = DenseDecoder(DecoderConfig(vocab_size=64))
    try:
        parallelize_model(model, MeshContext.build(DDPConfig()))
    except ValueError as err:
        return str(err)
    return "accepted"


def test_a_meta_model_is_refused_on_every_rank_naming_the_fix() -> None:
    """DDP's wrap broadcasts real weights: a meta model used to fail in torch ("Cannot copy out of meta tensor")."""
    for message in run_on_ranks(_meta_model_error, 2):
        assert "are on the meta device; fill them before parallelize_model" in message, message
