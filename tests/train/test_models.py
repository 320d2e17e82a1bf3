"""Reference models: HF Llama naming, presets, the experts contract, VLM shapes, pretrained loading."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from plait.models import GroupedExperts
from plait.strategies import num_experts_of
from plait.train.config import ModelConfig
from plait.train.init import SafetensorsSource, materialize
from plait.train.models import build_model


def test_dense_model_uses_hf_llama_names_and_local_head_reshapes():
    model = build_model(ModelConfig(arch={"num_hidden_layers": 2}), "cpu")
    assert type(model).__name__ == "DenseDecoder"
    names = {n for n, _ in model.named_modules()}
    for expected in (
        "model.embed_tokens",
        "model.layers.1.self_attn.q_proj",
        "model.layers.1.self_attn.o_proj",
        "model.layers.0.mlp.gate_proj",
        "model.layers.0.mlp.down_proj",
        "model.layers.0.input_layernorm",
        "model.layers.0.post_attention_layernorm",
        "model.norm",
        "model.rotary_emb",
        "lm_head",
    ):
        assert expected in names, expected
    attn = model.model.layers[0].self_attn
    assert (attn.num_heads, attn.num_key_value_heads, attn.head_dim) == (4, 2, 32)
    assert model(torch.randint(0, 256, (2, 8))).shape == (2, 8, 272)


def test_presets_reach_the_llama3_70b_shape_on_meta():
    model = build_model(ModelConfig(preset="llama3-70b"), "meta")
    assert sum(p.numel() for p in model.parameters()) == 70_553_706_496
    with pytest.raises(
        ValueError, match=r"model\.preset 'huge' is not a dense preset; choose one of: tiny, small"
    ):
        build_model(ModelConfig(preset="huge"), "meta")
    with pytest.raises(ValueError, match=r"unknown recipe key 'model\.arch\.hiden_size'"):
        build_model(ModelConfig(arch={"hiden_size": 3}), "meta")


def test_moe_experts_follow_the_contract_and_work_on_a_dim0_shard():
    model = build_model(ModelConfig(source="moe", arch={"num_hidden_layers": 1}), "cpu")
    materialize(model, seed=0)
    experts = model.model.layers[0].mlp.experts
    assert num_experts_of(experts) == 8
    counts = torch.tensor([3, 2, 0, 1, 0, 0, 2, 1])
    tokens = torch.randn(int(counts.sum()), 128)
    full = experts(tokens, counts)
    half = GroupedExperts(4, 128, 128)
    with torch.no_grad():
        for name in ("w1", "w2", "w3"):
            getattr(half, name).copy_(getattr(experts, name)[4:])
    mine = int(counts[:4].sum())
    assert torch.allclose(half(tokens[mine:], counts[4:]), full[mine:], atol=1e-6)
    assert model(torch.randint(0, 256, (2, 8))).shape == (2, 8, 272)


def test_vlm_freezes_its_tower_and_returns_text_logits():
    model = build_model(ModelConfig(source="vlm"), "cpu")
    assert not any(p.requires_grad for p in model.visual.parameters())
    assert all(p.requires_grad for p in model.language_model.parameters())
    logits = model(torch.randint(0, 256, (2, 8)), pixel_values=torch.rand(2, 3, 16, 16))
    assert logits.shape == (2, 8, 272)


def test_meta_build_materialises_deterministically_with_rope_buffers():
    a = materialize(build_model(ModelConfig(), "meta"), seed=3)
    b = materialize(build_model(ModelConfig(), "cpu"), seed=3)
    c = materialize(build_model(ModelConfig(), "meta"), seed=4)
    for (name, pa), pb, pc in zip(
        a.state_dict().items(), b.state_dict().values(), c.state_dict().values(), strict=True
    ):
        assert torch.equal(pa, pb), name
        assert name.endswith("norm.weight") or not torch.equal(pa, pc), name
    inv_freq = a.model.rotary_emb.inv_freq
    assert torch.equal(inv_freq, b.model.rotary_emb.inv_freq) and float(inv_freq[0]) == 1.0


def test_pretrained_safetensors_are_loaded_by_name(tmp_path: Path):
    source = materialize(build_model(ModelConfig(), "cpu"), seed=11)
    save_file(
        {k: v.contiguous() for k, v in source.state_dict().items()}, str(tmp_path / "model.safetensors")
    )
    loaded = materialize(build_model(ModelConfig(), "meta"), seed=0, source=SafetensorsSource(tmp_path))
    for name, tensor in source.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    with pytest.raises(ValueError, match=r"has no \*\.safetensors file"):
        SafetensorsSource(tmp_path / "empty")
