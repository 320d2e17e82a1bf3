"""A 32-layer decoder at tp = 8 inside a 1,024-rank fake process group (meta device): placements, shapes."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from plait.models import DecoderConfig, DenseDecoder
from plait.testing.fake_pg import fake_process_group
from plait.tp import apply_tp, resolve_tp_plan, validate_tp_mesh

VOCAB, HIDDEN, FFN, HEADS, KV, LAYERS, TP = 1001, 128, 256, 16, 8, 32, 8
HEAD_DIM = HIDDEN // HEADS


def _expected(name: str, rank: int) -> tuple[tuple[object, ...], tuple[int, ...]]:
    """(placements, local shape) on TP rank ``rank`` for each parameter of the model."""
    if name.endswith(("q_proj.weight", "gate_proj.weight", "up_proj.weight")):
        out = HEADS * HEAD_DIM if "q_proj" in name else FFN
        return (Shard(0),), (out // TP, HIDDEN)
    if name.endswith(("k_proj.weight", "v_proj.weight")):
        return (Shard(0),), (KV * HEAD_DIM // TP, HIDDEN)
    if name.endswith("o_proj.weight"):
        return (Shard(1),), (HIDDEN, HEADS * HEAD_DIM // TP)
    if name.endswith("down_proj.weight"):
        return (Shard(1),), (HIDDEN, FFN // TP)
    if name.endswith("norm.weight"):
        return (Replicate(),), (HIDDEN,)
    assert name == "model.embed_tokens.weight", name  # tied with lm_head: listed once
    chunk = -(-VOCAB // TP)  # 126 rows per rank, the last rank gets 1001 - 7 * 126 = 119
    return (Shard(0),), (min(chunk, VOCAB - rank * chunk), HIDDEN)


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_32_layers_tp8_in_1024_ranks(sequence_parallel: bool) -> None:
    with fake_process_group(1024, rank=1023):
        mesh = init_device_mesh("cpu", (1024 // TP, TP), mesh_dim_names=("dp", "tp"))
        tp_mesh = mesh["tp"]
        config = DecoderConfig(
            vocab_size=VOCAB,
            hidden_size=HIDDEN,
            intermediate_size=FFN,
            num_hidden_layers=LAYERS,
            num_attention_heads=HEADS,
            num_key_value_heads=KV,
            tie_word_embeddings=True,
        )
        with torch.device("meta"):
            model = DenseDecoder(config)
        validate_tp_mesh(model, tp_mesh)
        apply_tp(model, tp_mesh, resolve_tp_plan(model, sequence_parallel=sequence_parallel, tp_size=TP))
        rank = tp_mesh.get_local_rank()
        assert rank == TP - 1
        params = dict(model.named_parameters())
        assert len(params) == 2 + LAYERS * 9  # embed/lm_head (tied) + final norm + 9 per layer
        for name, param in params.items():
            placements, local_shape = _expected(name, rank)
            assert isinstance(param, DTensor) and param.device_mesh == tp_mesh, name
            assert param.placements == placements, (name, param.placements)
            assert tuple(param.to_local().shape) == local_shape, (name, param.to_local().shape)
            assert param.is_meta
        assert model.lm_head.weight is model.model.embed_tokens.weight
        assert {
            (a.num_heads, a.num_key_value_heads, a.head_dim)
            for a in model.modules()
            if hasattr(a, "head_dim")
        } == {(HEADS // TP, KV // TP, HEAD_DIM)}
