"""Untied embeddings in their own units bound the largest reduce-scatter buffer by the larger table."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy
from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultReduceScatter

from plait.models import DecoderConfig, DenseDecoder
from plait.sharding import apply_fsdp_sharding, fully_shard_root, fully_shard_untied_embeddings
from plait.testing import run_on_ranks
from plait.testing.fake_pg import fake_process_group
from plait.testing.models import lm_loss, make_batch

_VOCAB, _HIDDEN = 512, 32  # one table: 16,384 elements; one layer: about 9,000


class _RecordingReduceScatter(DefaultReduceScatter):
    """FSDP's own reduce-scatter, installed through ``set_custom_reduce_scatter``, noting input sizes."""

    def __init__(self, sizes: list[int]) -> None:
        self.sizes = sizes

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):  # type: ignore[no-untyped-def, override]
        self.sizes.append(input_tensor.numel())
        return super().__call__(output_tensor, input_tensor, group, op, async_op)


def _largest_reduce_scatter(model: nn.Module, split: bool) -> dict[str, int | list[str]]:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    mp = MixedPrecisionPolicy(reduce_dtype=torch.float32)
    apply_fsdp_sharding(model, mesh, mp_policy=mp)
    wrapped = []
    if split:
        wrapped = fully_shard_untied_embeddings(
            model, mesh, mp_policy=mp, offload_policy=None, input_reshard_after_forward=True
        )
    fully_shard_root(model, mesh, mp_policy=mp, offload_policy=None)
    sizes: list[int] = []
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_custom_reduce_scatter(_RecordingReduceScatter(sizes))
    ids, labels = make_batch(_VOCAB, 2, 8, seed=dist.get_rank())
    lm_loss(model(input_ids=ids), labels).backward()
    names = {id(m): fqn for fqn, m in model.named_modules()}
    return {
        "largest": max(sizes),
        "calls": len(sizes),
        "wrapped": [names[id(m)] for m in wrapped],
        "root_has_params": model._get_fsdp_state()._fsdp_param_group is not None,
    }


def _measure() -> dict[str, dict]:
    config = DecoderConfig(
        vocab_size=_VOCAB,
        hidden_size=_HIDDEN,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
    )
    model = DenseDecoder(config)
    table = model.get_input_embeddings().weight.numel()
    head = model.get_output_embeddings().weight.numel()
    layer = sum(p.numel() for p in model.model.layers[0].parameters())
    return {
        "sizes": {"table": table, "head": head, "layer": layer},
        "split": _largest_reduce_scatter(copy.deepcopy(model), split=True),
        "joint": _largest_reduce_scatter(model, split=False),
    }


def test_untied_split_bounds_the_reduce_scatter_by_the_larger_table() -> None:
    for result in run_on_ranks(_measure, 2):
        sizes = result["sizes"]
        assert sizes["layer"] < min(sizes["table"], sizes["head"])  # otherwise the bound is not visible
        assert result["split"]["wrapped"] == ["model.embed_tokens", "lm_head"]
        root_rest = result["joint"]["largest"] - sizes["table"] - sizes["head"]
        assert 0 < root_rest < sizes["layer"]  # without the split the root carries both tables (+ the norm)
        # The final norm joins the head's unit: the root keeps no parameters and runs no reduce-scatter.
        assert result["joint"]["root_has_params"] and not result["split"]["root_has_params"]
        assert result["split"]["calls"] == result["joint"]["calls"] + 1
        assert result["split"]["largest"] == max(sizes["table"], sizes["head"] + root_rest)


def _split_on_fake_pg(model: nn.Module, input_reshard: bool = True) -> list[nn.Module]:
    with fake_process_group(2):
        mesh = init_device_mesh("cpu", (2,))
        apply_fsdp_sharding(model, mesh)
        return fully_shard_untied_embeddings(
            model, mesh, mp_policy=None, offload_policy=None, input_reshard_after_forward=input_reshard
        )


def test_tied_frozen_and_getterless_tables_are_not_split() -> None:
    tied = DenseDecoder(DecoderConfig(vocab_size=_VOCAB, tie_word_embeddings=True))
    assert _split_on_fake_pg(tied) == []
    frozen_head = DenseDecoder(DecoderConfig(vocab_size=_VOCAB))
    frozen_head.lm_head.requires_grad_(False)
    assert _split_on_fake_pg(frozen_head) == [frozen_head.model.embed_tokens]
    assert not isinstance(frozen_head.lm_head, FSDPModule)
    assert _split_on_fake_pg(nn.Sequential(nn.Embedding(4, 4), nn.Linear(4, 4))) == []


@pytest.mark.parametrize("input_reshard", [True, False])
def test_output_head_stays_gathered_and_input_follows_the_setting(input_reshard: bool) -> None:
    model = DenseDecoder(DecoderConfig(vocab_size=_VOCAB))
    assert _split_on_fake_pg(model, input_reshard) == [model.model.embed_tokens, model.lm_head]

    def reshards(table: nn.Module) -> bool:
        return table._get_fsdp_state()._fsdp_param_group.post_forward_mesh_info is not None

    assert reshards(model.model.embed_tokens) is input_reshard
    assert not reshards(model.lm_head)
    head_group = model.lm_head._get_fsdp_state()._fsdp_param_group
    assert {p._module_info.module for p in head_group.fsdp_params} == {model.lm_head, model.model.norm}


def test_tables_lighter_than_a_layer_stay_in_the_root() -> None:
    model = DenseDecoder(DecoderConfig(vocab_size=64))  # 2 x 2,048 elements; one layer 9,216
    assert _split_on_fake_pg(model) == []
    assert not isinstance(model.model.embed_tokens, FSDPModule)
    assert not isinstance(model.lm_head, FSDPModule)


class _NormalizedEmbedding(nn.Embedding):
    """A lookup whose backward needs the weight values (it divides by the row norms)."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return nn.functional.normalize(super().forward(input), dim=-1)


def _unshards_in_backward(table: nn.Module) -> list[bool]:
    return [group.unshard_in_backward for group in table._get_fsdp_state()._fsdp_param_groups]


def test_only_a_plain_resharding_lookup_skips_the_backward_all_gather() -> None:
    plain = DenseDecoder(DecoderConfig(vocab_size=_VOCAB))
    _split_on_fake_pg(plain)
    assert _unshards_in_backward(plain.model.embed_tokens) == [False]
    assert _unshards_in_backward(plain.lm_head) == [True]  # a Linear needs its weight for input grads

    custom = DenseDecoder(DecoderConfig(vocab_size=_VOCAB))
    custom.model.embed_tokens = _NormalizedEmbedding(_VOCAB, _HIDDEN)
    _split_on_fake_pg(custom)
    assert _unshards_in_backward(custom.model.embed_tokens) == [True]

    checkpointed = DenseDecoder(DecoderConfig(vocab_size=_VOCAB))
    checkpointed.model.embed_tokens = checkpoint_wrapper(checkpointed.model.embed_tokens)
    _split_on_fake_pg(checkpointed)  # the lookup reruns in backward: it needs its weight
    assert _unshards_in_backward(checkpointed.model.embed_tokens) == [True]

    kept = DenseDecoder(DecoderConfig(vocab_size=_VOCAB))
    _split_on_fake_pg(kept, input_reshard=False)  # never resharded: nothing to gather again
    assert _unshards_in_backward(kept.model.embed_tokens) == [True]
