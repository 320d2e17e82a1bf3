"""Structure at scale: a 32-layer decoder on 1,024 fake ranks, built on the meta device."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule

from plait.models import DecoderConfig, DenseDecoder
from plait.sharding import apply_fsdp_sharding, fully_shard_root, fully_shard_untied_embeddings
from plait.testing.fake_pg import fake_process_group

_LAYERS, _VOCAB, _HIDDEN = 32, 4096, 64


def _local_rows(rows: int, shards: int, index: int) -> int:
    chunk = -(-rows // shards)
    return max(0, min(chunk, rows - index * chunk))


@pytest.mark.parametrize(
    ("shape", "rank"),
    # rank 0 of each mesh: tools/slow_tests (the last shard's uneven remainder is the case that runs here)
    [
        pytest.param((1024,), 0, marks=pytest.mark.slow),
        ((1024,), 1000),
        pytest.param((8, 128), 0, marks=pytest.mark.slow),
        ((8, 128), 1023),
    ],
)
def test_32_layers_on_1024_ranks(shape: tuple[int, ...], rank: int) -> None:
    config = DecoderConfig(
        vocab_size=_VOCAB,
        hidden_size=_HIDDEN,
        intermediate_size=128,
        num_hidden_layers=_LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
    )
    with torch.device("meta"):
        model = DenseDecoder(config)
    full_shapes = {name: p.shape for name, p in model.named_parameters()}
    names = ("dp_replicate", "dp_shard") if len(shape) == 2 else ("dp_shard",)
    with fake_process_group(1024, rank=rank):
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
        units = apply_fsdp_sharding(model, mesh)
        fully_shard_untied_embeddings(
            model, mesh, mp_policy=None, offload_policy=None, input_reshard_after_forward=True
        )
        fully_shard_root(model, mesh, mp_policy=None, offload_policy=None)
        shard_index = mesh.get_local_rank(mesh_dim=len(shape) - 1)

    assert units == list(model.model.layers)
    wrapped = [fqn for fqn, m in model.named_modules() if isinstance(m, FSDPModule)]
    layers = [f"model.layers.{i}" for i in range(_LAYERS)]
    assert wrapped == ["", "model.embed_tokens", *layers, "model.norm", "lm_head"]  # norm: the head's unit
    reshard = [u._get_fsdp_state()._fsdp_param_group.post_forward_mesh_info is not None for u in units]
    assert reshard == [True] * (_LAYERS - 1) + [False]
    for name, param in model.named_parameters():
        assert param.device.type == "meta"
        rows, *rest = full_shapes[name]
        assert tuple(param.to_local().shape) == (_local_rows(rows, shape[-1], shard_index), *rest), name
        assert tuple(param.shape) == tuple(full_shapes[name]), name
