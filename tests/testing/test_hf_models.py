"""The tiny Hugging Face builders: seeded, at the stated sizes, noisy vectors only when asked."""

import pytest
import torch

from plait.testing import tiny_hf_config, tiny_hf_model

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
