"""Tiny models: HF-like names and shapes, tied weights, seeded determinism, TP-friendly attention."""

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

from plait.testing import (
    DecoderConfig,
    DenseDecoder,
    NestedContainerModel,
    TinyVLM,
    VisionConfig,
    VLMConfig,
    freeze_vision,
    lm_loss,
    make_batch,
    run_on_ranks,
)

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
    model = TinyVLM(config)
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
    model = freeze_vision(TinyVLM())
    assert not any(p.requires_grad for p in model.visual.parameters())
    assert all(p.requires_grad for p in model.multi_modal_projector.parameters())
    assert all(p.requires_grad for p in model.language_model.parameters())


def test_nested_container_model_layout_and_every_parameter_used():
    model = NestedContainerModel(hidden_size=16)
    modules = dict(model.named_modules())
    assert isinstance(modules["towers"], torch.nn.ModuleDict)
    assert isinstance(modules["towers.text"], torch.nn.ModuleList)
    assert isinstance(modules["stages.1.blocks"], torch.nn.ModuleList)
    assert isinstance(modules["grid.0"], torch.nn.ModuleList) and "grid.0.1" in modules
    assert isinstance(modules["mixer"], torch.nn.Linear)
    model(torch.randn(2, 4, 16)).sum().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())


def test_config_rejects_inconsistent_heads():
    with pytest.raises(ValueError, match="multiple of num_key_value_heads"):
        DecoderConfig(num_attention_heads=4, num_key_value_heads=3)
    with pytest.raises(ValueError, match="set head_dim"):
        DecoderConfig(hidden_size=30, num_attention_heads=4)
