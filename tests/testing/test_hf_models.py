"""The tiny Hugging Face configs and builders: seeded, at the stated sizes, noisy vectors only when asked."""

import pytest
import torch

from plait.testing import (
    NAMED_HF_CONFIGS,
    SWEEP_HF_SIZES,
    hf_moe_config,
    named_hf_config,
    sweep_hf_config,
    tiny_hf_config,
    tiny_hf_model,
    tp_hf_config,
)

pytest.importorskip("transformers", reason="the builders build transformers models")


def test_tiny_models_are_seeded_and_sized() -> None:
    config = tiny_hf_config("qwen3", attn_implementation="sdpa", tie_word_embeddings=True)
    assert (config.hidden_size, config.head_dim, config._attn_implementation) == (32, 8, "sdpa")
    first, again = tiny_hf_model("llama"), tiny_hf_model("llama")
    assert type(first).__name__ == "LlamaForCausalLM" and first.config.num_hidden_layers == 2
    assert all(torch.equal(a, b) for a, b in zip(first.parameters(), again.parameters(), strict=True))
    norm = tiny_hf_model("llama", vector_noise=0.1).model.norm.weight
    assert torch.equal(first.model.norm.weight, torch.ones(32)) and not torch.equal(norm, torch.ones(32))
    assert tiny_hf_model("qwen3", tie_word_embeddings=True).lm_head.weight.dtype == torch.float32


def test_every_named_config_builds_at_its_sizes() -> None:
    for name, (model_type, fields) in NAMED_HF_CONFIGS.items():
        config = named_hf_config(name)
        assert config.model_type == model_type and all(getattr(config, k) == v for k, v in fields.items()), (
            name
        )
    assert named_hf_config("mixtral_proportions", attn_implementation="eager")._attn_implementation == "eager"
    assert tp_hf_config("qwen3", vocab=64).head_dim == 16 and tp_hf_config("llama").hidden_size == 64
    assert hf_moe_config("mixtral").num_local_experts == 4
    assert (sweep_hf_config("llama", 4).num_attention_heads, SWEEP_HF_SIZES["vocab_size"]) == (8, 128)
