"""FSDP2 / HSDP units on real gloo ranks match the unsharded model; tied embeddings stay one parameter."""

from __future__ import annotations

from functools import partial
from typing import Any

import pytest
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from plait.models import DecoderConfig, DenseDecoder
from plait.sharding import (
    apply_activation_checkpointing,
    apply_fsdp_sharding,
    discover_layer_groups,
    fully_shard_root,
    fully_shard_untied_embeddings,
)
from plait.testing import Parity, paired, run_on_ranks, run_parity, token_batches


def _decoder(vocab: int, tied: bool) -> DenseDecoder:
    return DenseDecoder(
        DecoderConfig(vocab_size=vocab, tie_word_embeddings=tied)  # hidden 32, 2 layers of 9,216
    )


def _mesh(shape: tuple[int, ...]) -> DeviceMesh:
    names = ("dp_replicate", "dp_shard") if len(shape) == 2 else ("dp_shard",)
    return init_device_mesh("cpu", shape, mesh_dim_names=names)


def _shard_dense(model: nn.Module, mesh: DeviceMesh) -> nn.Module:
    """The sidecar's FSDP2 order: layer units, untied-embedding units, the root last."""
    apply_fsdp_sharding(model, mesh)
    fully_shard_untied_embeddings(
        model, mesh, mp_policy=None, offload_policy=None, input_reshard_after_forward=True
    )
    return fully_shard_root(model, mesh, mp_policy=None, offload_policy=None)


def _structure(ref: nn.Module, par: nn.Module) -> dict[str, Any]:
    embed, head = par.model.embed_tokens.weight, par.lm_head.weight
    root_group = par._get_fsdp_state()._fsdp_param_group
    root_params = [p.sharded_param for p in root_group.fsdp_params] if root_group is not None else []
    return {
        "units": [fqn for fqn, m in par.named_modules() if isinstance(m, FSDPModule)],
        "tied": embed is head,
        "embed_owners_in_root": sum(p is embed for p in root_params),
        "all_dtensor": all(isinstance(p, DTensor) for p in par.parameters()),
        "embed_local_rows": embed.to_local().shape[0],
        "embed_unshards_in_backward": [
            group.unshard_in_backward for group in par.model.embed_tokens._get_fsdp_state()._fsdp_param_groups
        ]
        if isinstance(par.model.embed_tokens, FSDPModule)
        else None,
    }


def _dense_parity(shape: tuple[int, ...], vocab: int, tied: bool) -> Parity:
    mesh = _mesh(shape)
    batches = token_batches(vocab, dist.get_world_size())
    return run_parity(
        paired(partial(_decoder, vocab, tied), partial(_shard_dense, mesh=mesh)),
        batches,
        dp_rank=dist.get_rank(),
        inspect=_structure,
    )


# One layer holds 9,216 elements: with vocab >= 145 the two 32-wide tables outweigh it and get units.
@pytest.mark.parametrize(
    ("shape", "vocab"),
    [
        ((2,), 160),
        ((4,), 163),  # vocab not divisible by the world size: FSDP pads the last shard
        ((2, 2), 160),  # HSDP: replicate over dim 0, shard over dim 1
        ((2,), 64),  # tables lighter than a layer stay in the root
    ],
)
def test_fsdp_untied_decoder_matches_reference(shape: tuple[int, ...], vocab: int) -> None:
    world = 1
    for size in shape:
        world *= size
    results = run_on_ranks(_dense_parity, world, shape, vocab, False)
    split = vocab > 144
    for rank, result in enumerate(results):
        result.check()
        # Split: the final norm shares the head's unit (both modules become FSDP modules).
        tables = ["model.embed_tokens", "lm_head", "model.norm"] if split else []
        assert sorted(result.extra["units"]) == sorted(["", "model.layers.0", "model.layers.1", *tables])
        # The input table reshards after forward but is not gathered again for its backward.
        assert result.extra["embed_unshards_in_backward"] == ([False] if split else None)
        assert result.extra["all_dtensor"] and not result.extra["tied"]
        shard = shape[-1]
        expected_rows = min(-(-vocab // shard), max(vocab - (rank % shard) * -(-vocab // shard), 0))
        assert result.extra["embed_local_rows"] == expected_rows


def test_tied_embeddings_stay_one_parameter_owned_by_the_root() -> None:
    results = run_on_ranks(_dense_parity, 4, (4,), 67, True)
    for result in results:
        result.check()
        assert result.extra["tied"], "lm_head and embed_tokens no longer share their weight after training"
        assert result.extra["embed_owners_in_root"] == 1
        assert result.extra["units"] == ["", "model.layers.0", "model.layers.1"]


def _checkpointed_then_sharded(model: nn.Module, mesh: DeviceMesh, mode: str) -> nn.Module:
    groups = discover_layer_groups(model)
    assert [(g.kind, g.path) for g in groups] == [("language", "model.layers")]
    assert apply_activation_checkpointing(model, groups, mode=mode) > 0  # AC after TP, before FSDP
    return _shard_dense(model, mesh)


def _ac_parity(mode: str) -> Parity:
    mesh = _mesh((dist.get_world_size(),))
    return run_parity(
        paired(partial(_decoder, 64, False), partial(_checkpointed_then_sharded, mesh=mesh, mode=mode)),
        token_batches(64, dist.get_world_size()),
        dp_rank=dist.get_rank(),
        inspect=_structure,
    )


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_activation_checkpointing_under_fsdp_matches_reference(mode: str) -> None:
    for result in run_on_ranks(_ac_parity, 2, mode):
        result.check()
        assert "model.layers.1" in result.extra["units"]
