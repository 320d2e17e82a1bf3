"""Reference models: HF-like names and shapes, tied weights, seeded determinism, TP-friendly attention,
the swappable attention call, global position ids, presets, and no TP plan of their own."""

import copy

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from plait.models import (
    DENSE_PRESETS,
    MOE_PRESETS,
    PRESETS,
    REFERENCE_MODELS,
    VLM,
    VLM_PRESETS,
    DecoderConfig,
    DenseDecoder,
    MoEDecoder,
    MoEDecoderConfig,
    VisionConfig,
    VLMConfig,
    freeze_vision,
    preset_arch,
    sdpa_attention,
)
from plait.testing import lm_loss, make_batch, run_on_ranks

_CFG = DecoderConfig(
    vocab_size=64, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2
)


def test_dense_decoder_has_llama_names_and_logit_shape():
    model = DenseDecoder(_CFG)
    ids, _ = make_batch(64, 3, 10)
    assert model(input_ids=ids).shape == (3, 10, 64)
    names = {name for name, _ in model.named_parameters()}
    assert "model.layers.1.self_attn.q_proj.weight" in names and "lm_head.weight" in names
    assert {"model.embed_tokens.weight", "model.norm.weight", "model.layers.0.mlp.gate_proj.weight"} <= names
    attn = model.model.layers[0].self_attn
    assert (attn.num_heads, attn.num_key_value_heads, attn.head_dim) == (4, 2, 8)
    assert attn.k_proj.weight.shape == (16, 32)
    assert model.model.rotary_emb.inv_freq.shape == (4,)
    assert model.get_input_embeddings() is model.model.embed_tokens
    assert model.get_output_embeddings() is model.lm_head
    assert model.config.use_cache is True


def test_tied_embeddings_share_one_parameter():
    model = DenseDecoder(DecoderConfig(tie_word_embeddings=True))
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert len(list(model.parameters())) == len(list(DenseDecoder(DecoderConfig()).parameters())) - 1


def test_same_seed_same_model_and_batch_different_seed_different():
    def build(seed: int) -> tuple[DenseDecoder, torch.Tensor]:
        torch.manual_seed(seed)
        model = DenseDecoder(_CFG)
        return model, model(make_batch(64, 2, 8, seed=3)[0])

    (a, out_a), (b, out_b), (_, out_c) = build(0), build(0), build(1)
    assert all(
        torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True)
    )
    assert torch.equal(out_a, out_b) and not torch.allclose(out_a, out_c)
    assert all(
        torch.equal(x, y) for x, y in zip(make_batch(64, 2, 8, 5), make_batch(64, 2, 8, 5), strict=True)
    )
    ids, labels = make_batch(64, 2, 8, 5)
    assert torch.equal(ids[:, 1:], labels[:, :-1])


def test_attention_works_on_a_tensor_parallel_slice_of_heads():
    attn = DenseDecoder(_CFG).model.layers[0].self_attn
    x = torch.randn(2, 8, 32)
    pos = DenseDecoder(_CFG).model.rotary_emb(x, torch.arange(8)[None])
    shards = []
    for half in (0, 1):
        part = copy.deepcopy(attn)
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            weight = getattr(attn, name).weight.detach()
            local = weight.chunk(2, dim=1 if name == "o_proj" else 0)[half]
            getattr(part, name).weight = torch.nn.Parameter(local.clone())
        shards.append(part(x, pos))
    torch.testing.assert_close(shards[0] + shards[1], attn(x, pos))


def _tp_sequence_parallel_logits_diff() -> float:
    torch.manual_seed(0)
    ref = DenseDecoder(_CFG)
    par = DenseDecoder(_CFG)
    par.load_state_dict(ref.state_dict())
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    plan = {
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "model.layers.*.input_layernorm": SequenceParallel(),
        "model.layers.*.post_attention_layernorm": SequenceParallel(),
        "model.layers.*.self_attn.q_proj": ColwiseParallel(input_layouts=Shard(1)),
        "model.layers.*.self_attn.k_proj": ColwiseParallel(input_layouts=Shard(1)),
        "model.layers.*.self_attn.v_proj": ColwiseParallel(input_layouts=Shard(1)),
        "model.layers.*.self_attn.o_proj": RowwiseParallel(output_layouts=Shard(1)),
        "model.layers.*.mlp.gate_proj": ColwiseParallel(input_layouts=Shard(1)),
        "model.layers.*.mlp.up_proj": ColwiseParallel(input_layouts=Shard(1)),
        "model.layers.*.mlp.down_proj": RowwiseParallel(output_layouts=Shard(1)),
        "model.norm": SequenceParallel(),
        "lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
    }
    parallelize_module(par, mesh, plan)
    ids, _ = make_batch(64, 2, 8)
    return (par(ids) - ref(ids)).abs().max().item()


def test_decoder_runs_under_tensor_and_sequence_parallel():
    assert max(run_on_ranks(_tp_sequence_parallel_logits_diff, 2)) < 1e-5


def test_vlm_with_and_without_images():
    torch.manual_seed(0)
    config = VLMConfig(
        text_config=DecoderConfig(vocab_size=64), vision_config=VisionConfig(image_size=8, patch_size=4)
    )
    model = VLM(config)
    ids, labels = make_batch(64, 2, 8)
    pixels = torch.randn(2, 3, 8, 8)
    text_only, with_image = model(ids), model(ids, pixel_values=pixels)
    assert text_only.shape == with_image.shape == (2, 8, 64)
    assert not torch.allclose(text_only[:, -1], with_image[:, -1]), "image features must reach later tokens"
    lm_loss(with_image, labels).backward()
    assert model.visual.blocks[1].attn.qkv.weight.grad is not None
    assert model.language_model.layers[0].self_attn.q_proj.weight.grad is not None
    assert model.config.get_text_config() is model.language_model.config
    with pytest.raises(ValueError, match="needs >= 4 tokens"):
        model(ids[:, :3], pixel_values=pixels)


def test_freeze_vision_stops_only_the_tower():
    model = freeze_vision(VLM())
    assert not any(p.requires_grad for p in model.visual.parameters())
    assert all(p.requires_grad for p in model.multi_modal_projector.parameters())
    assert all(p.requires_grad for p in model.language_model.parameters())


def test_config_rejects_inconsistent_heads():
    with pytest.raises(ValueError, match="multiple of num_key_value_heads"):
        DecoderConfig(num_attention_heads=4, num_key_value_heads=3)
    with pytest.raises(ValueError, match="set head_dim"):
        DecoderConfig(hidden_size=30, num_attention_heads=4)


def test_attention_fn_is_swappable_per_instance_with_sdpa_semantics():
    torch.manual_seed(0)
    model = DenseDecoder(_CFG)
    ids, _ = make_batch(64, 2, 8)
    expected = model(ids)
    calls: list[tuple[tuple[int, ...], tuple[int, ...], bool, bool]] = []

    def recording(q, k, v, *, is_causal, scale, enable_gqa):
        calls.append((tuple(q.shape), tuple(k.shape), is_causal, enable_gqa))
        return sdpa_attention(q, k, v, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)

    model.model.layers[1].self_attn.attention_fn = recording
    torch.testing.assert_close(model(ids), expected, rtol=0, atol=0)
    assert calls == [((2, 4, 8, 8), (2, 2, 8, 8), True, True)], "only the swapped layer calls it"
    model.model.layers[1].self_attn.attention_fn = lambda q, k, v, **kw: torch.zeros_like(q)
    assert not torch.allclose(model(ids), expected)
    q, k, v = torch.randn(1, 4, 5, 8), torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8)
    with pytest.raises(ValueError, match="enable_gqa=True"):
        sdpa_attention(q, k, v, is_causal=True)
    reference = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), is_causal=True, scale=0.3
    )
    torch.testing.assert_close(sdpa_attention(q, k, v, is_causal=True, scale=0.3, enable_gqa=True), reference)


def test_every_decoder_takes_global_position_ids():
    """A slice of the sequence with its global positions gives the same logits as the full run's slice
    for the first layer's rotary tables; the default positions are 0..seq-1."""
    torch.manual_seed(0)
    ids, _ = make_batch(64, 2, 8)
    models = [
        DenseDecoder(_CFG),
        MoEDecoder(MoEDecoderConfig(vocab_size=64)),
        VLM(VLMConfig(text_config=_CFG)),
    ]
    for model in models:
        default = model(ids)
        torch.testing.assert_close(model(ids, position_ids=torch.arange(8)[None]), default, rtol=0, atol=0)
        shifted = model(ids, position_ids=torch.arange(8)[None] + 5)
        assert not torch.allclose(shifted, default), type(model).__name__
    # Causal attention: the first half's logits do not depend on the rest of the sequence.
    dense = models[0]
    torch.testing.assert_close(dense(ids[:, :4], position_ids=torch.arange(4)[None]), dense(ids)[:, :4])


def test_presets_build_the_same_classes_and_test_is_the_defaults():
    assert preset_arch("dense", "test") == {k: v for k, v in DENSE_PRESETS["test"].items()}
    assert DecoderConfig(**preset_arch("dense", "test")) == DecoderConfig()
    assert MoEDecoderConfig(**preset_arch("moe", "test")) == MoEDecoderConfig()
    vlm_test = preset_arch("vlm", "test")
    assert VisionConfig(**vlm_test["vision_config"]) == VisionConfig()
    assert set(PRESETS) == set(REFERENCE_MODELS) == {"dense", "moe", "vlm"}
    for kind, table in PRESETS.items():
        config_cls, model_cls = REFERENCE_MODELS[kind]
        for name in table:
            arch = preset_arch(kind, name)
            if kind == "vlm":
                arch = {
                    "text_config": DecoderConfig(**arch["text_config"]),
                    "vision_config": VisionConfig(**arch["vision_config"]),
                }
            with torch.device("meta"):
                model = model_cls(config_cls(**arch))
            assert type(model) is model_cls, (kind, name)
    assert MOE_PRESETS["tiny"]["hidden_size"] == DENSE_PRESETS["tiny"]["hidden_size"] == 128
    assert VLM_PRESETS["tiny"]["text_config"] == DENSE_PRESETS["tiny"]
    merged = preset_arch(
        "vlm", "tiny", {"vision_config": {"image_size": 32}, "text_config": {"vocab_size": 5}}
    )
    assert merged["vision_config"]["patch_size"] == 8 and merged["vision_config"]["image_size"] == 32
    assert (
        merged["text_config"]["vocab_size"] == 5 and VLM_PRESETS["tiny"]["vision_config"]["image_size"] == 16
    )
    with pytest.raises(
        ValueError, match=r"model\.preset 'huge' is not a moe preset; choose one of: tiny, small"
    ):
        preset_arch("moe", "huge")


def test_the_decoders_carry_no_tp_plan():
    """The tensor-parallel plan lives in plait.tp, registered there by class name."""
    for cls in (DenseDecoder, MoEDecoder, VLM):
        assert not hasattr(cls, "_tp_plan"), cls.__name__


def test_meta_build_and_reset_buffers_recompute_non_persistent_buffers():
    config = MoEDecoderConfig(zero_token_experts=(3,))
    torch.manual_seed(0)
    cpu = MoEDecoder(config)
    with torch.device("meta"):
        meta = MoEDecoder(config)
    meta.to_empty(device="cpu")
    for module in meta.modules():
        if hasattr(module, "reset_buffers"):
            module.reset_buffers()
    for (name, a), b in zip(cpu.named_buffers(), meta.buffers(), strict=True):
        assert torch.equal(a, b), name
    router = cpu.model.layers[0].mlp.router
    assert float(router.expert_bias[3]) < -1e3 and float(router.expert_bias[0]) == 0.0
    _, indices = router(torch.randn(64, config.hidden_size))
    assert 3 not in indices.unique().tolist()


def test_moe_config_rejects_impossible_routing():
    with pytest.raises(ValueError, match=r"num_experts_per_tok \(3\) must be in \[1, 2\]"):
        MoEDecoderConfig(num_experts=4, num_experts_per_tok=3, zero_token_experts=(0, 1))
    with pytest.raises(ValueError, match="expert indices in"):
        MoEDecoderConfig(num_experts=4, zero_token_experts=(7,))
