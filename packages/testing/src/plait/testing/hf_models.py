"""The tiny Hugging Face configs that tests and tools build, in one place, and seeded models from them.

Random weights, no download. Each config variant is named after what uses it; a parity test's
sizes are its tolerance's premise, so add a variant rather than change one. ``transformers`` is
imported inside the functions: plait-testing does not depend on it, and a test suite without it
never calls these. (The TP sweep's per-family configs are in :mod:`plait.testing.hf_sweep_configs`.)
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = [
    "HF_MOE_FAMILIES",
    "HF_MOE_SIZES",
    "NAMED_HF_CONFIGS",
    "TINY_HF_SIZES",
    "TP_FAMILY_HF_SIZES",
    "TP_TRANSLATION_HF_SIZES",
    "hf_moe_config",
    "named_hf_config",
    "tiny_hf_config",
    "tiny_hf_model",
    "tp_hf_config",
]

TINY_HF_SIZES: dict[str, Any] = {
    "vocab_size": 96,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
    "use_cache": False,
    "tie_word_embeddings": False,
}
"""The defaults: 2 layers, hidden 32, 4 query and 2 KV heads, untied, no KV cache."""

TP_FAMILY_HF_SIZES: dict[str, Any] = {
    "vocab_size": 96,
    "hidden_size": 64,
    "intermediate_size": 96,
    "head_dim": 16,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
"""Overrides of :data:`TINY_HF_SIZES` for the TP family parity tests (hidden 64, vocab 96)."""

TP_TRANSLATION_HF_SIZES: dict[str, Any] = {
    "vocab_size": 96,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
}
"""The TP plan-translation tests' sizes (no forward): hidden 64, 2 layers, 4 heads, vocab 96."""

_TP_SIZES = {"hidden_size": 64, "intermediate_size": 128}

NAMED_HF_CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    # a dense model under ep_size 2 (refused): 1 layer, 4 heads (and KV heads: the default)
    "llama_one_layer": (
        "llama",
        {
            "vocab_size": 64,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 1,
            "num_attention_heads": 4,
        },
    ),
    # Mixtral's proportions (8 experts, top-2, intermediate 3.5 x hidden, few KV heads): experts hold
    # most weights (the TP memory test and tools/bench/moe_bench.py)
    "mixtral_proportions": (
        "mixtral",
        {
            "vocab_size": 256,
            "hidden_size": 64,
            "intermediate_size": 224,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "num_local_experts": 8,
            "num_experts_per_tok": 2,
            "tie_word_embeddings": False,
        },
    ),
    # per-expert ModuleDict experts (refused under expert parallel)
    "switch_transformers": (
        "switch_transformers",
        {
            "vocab_size": 64,
            "d_model": 16,
            "d_ff": 32,
            "d_kv": 4,
            "num_heads": 2,
            "num_layers": 2,
            "num_decoder_layers": 2,
            "num_sparse_encoder_layers": 1,
            "num_sparse_decoder_layers": 1,
            "num_experts": 2,
        },
    ),
    # sliding-window attention on every layer
    "qwen3_sliding_window": (
        "qwen3",
        {
            "vocab_size": 32,
            "hidden_size": 16,
            "intermediate_size": 32,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "use_sliding_window": True,
            "sliding_window": 4,
            "max_window_layers": 0,
        },
    ),
    # TP plan translation: Phi's final norm is `final_layernorm`; Mixtral's fused experts; Granite-SWA's sinks
    "phi_translation": ("phi", TP_TRANSLATION_HF_SIZES),
    "mixtral_translation": (
        "mixtral",
        TP_TRANSLATION_HF_SIZES | {"num_key_value_heads": 2, "num_local_experts": 4},
    ),
    "granite_swa_translation": ("granite_swa", TP_TRANSLATION_HF_SIZES | {"num_key_value_heads": 2}),
}
"""One-off configs: name -> (model type, fields), each built as ``AutoConfig.for_model`` builds it."""

HF_MOE_SIZES: dict[str, Any] = {
    "vocab_size": 64,
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
    "use_cache": False,
    "output_router_logits": True,
    "tie_word_embeddings": False,
}
"""What every Hugging Face MoE family of :data:`HF_MOE_FAMILIES` shares (the expert-parallel tests)."""

HF_MOE_FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "mixtral": ("MixtralConfig", {"intermediate_size": 16, "num_local_experts": 4, "num_experts_per_tok": 2}),
    "qwen2_moe": (
        "Qwen2MoeConfig",
        {
            "intermediate_size": 32,
            "moe_intermediate_size": 16,
            "shared_expert_intermediate_size": 16,
            "num_experts": 4,
            "num_experts_per_tok": 2,
        },
    ),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        {"moe_intermediate_size": 16, "num_experts": 4, "num_experts_per_tok": 2, "head_dim": 8},
    ),
    "olmoe": ("OlmoeConfig", {"intermediate_size": 16, "num_experts": 4, "num_experts_per_tok": 2}),
    "deepseek_v3": (
        "DeepseekV3Config",
        {
            "intermediate_size": 32,
            "moe_intermediate_size": 16,
            "n_routed_experts": 4,
            "n_shared_experts": 1,
            "num_experts_per_tok": 2,
            "first_k_dense_replace": 1,
            "n_group": 1,
            "topk_group": 1,
            "q_lora_rank": 16,
            "kv_lora_rank": 16,
            "qk_rope_head_dim": 4,
            "qk_nope_head_dim": 4,
            "v_head_dim": 8,
            "num_key_value_heads": 4,
        },
    ),
    "gpt_oss": (
        "GptOssConfig",
        {"intermediate_size": 16, "num_local_experts": 4, "num_experts_per_tok": 2, "head_dim": 8},
    ),
}
"""Family -> (``transformers`` config class, fields over :data:`HF_MOE_SIZES`)."""


def tiny_hf_config(model_type: str, *, attn_implementation: str = "eager", **overrides: Any) -> Any:
    """The ``transformers`` config of ``model_type`` (``"llama"``, ``"qwen3"``, ...) at tiny sizes.

    Args:
        model_type: a ``transformers`` model type, as ``AutoConfig.for_model`` takes it.
        attn_implementation: ``"eager"`` or ``"sdpa"``.
        **overrides: config fields replacing :data:`TINY_HF_SIZES` or adding to them; ``head_dim``
            defaults to ``hidden_size // num_attention_heads`` (Qwen3's own default is 128).
    """
    import transformers

    fields = TINY_HF_SIZES | overrides
    fields.setdefault("head_dim", fields["hidden_size"] // fields["num_attention_heads"])
    config = transformers.AutoConfig.for_model(model_type, **fields)
    config._attn_implementation = attn_implementation
    return config


def tiny_hf_model(
    model_type: str,
    *,
    seed: int | None = 0,
    vector_noise: float = 0.0,
    **config: Any,
) -> nn.Module:
    """A randomly initialised fp32 causal LM of ``model_type`` at tiny sizes.

    Args:
        model_type: as in :func:`tiny_hf_config`, which ``config`` (and ``attn_implementation``) go to.
        seed: ``torch.manual_seed`` before the weights are drawn; ``None`` leaves the RNG alone.
        vector_noise: scale of Gaussian noise added to every 1-D parameter: zero-initialised norm
            weights (Gemma's ``1 + w``) would otherwise hide the errors in their gradients.
    """
    import transformers

    hf_config = tiny_hf_config(model_type, **config)
    if seed is not None:
        torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(hf_config).float()
    if vector_noise:
        with torch.no_grad():
            for param in model.parameters():
                if param.ndim == 1:
                    param.add_(vector_noise * torch.randn_like(param))
    return model


def tp_hf_config(kind: str, *, vocab: int = 101, layers: int = 2, tie: bool = False, **overrides: Any) -> Any:
    """The TP tests' Llama / Qwen3 config: hidden 64, 4 heads, 2 KV heads (Qwen3: head_dim 16), eager."""
    if kind not in ("llama", "qwen3"):
        raise ValueError(f"unknown kind {kind!r}")
    qwen3 = {"head_dim": 16} if kind == "qwen3" else {}
    return tiny_hf_config(
        kind,
        **_TP_SIZES,
        **qwen3,
        vocab_size=vocab,
        num_hidden_layers=layers,
        tie_word_embeddings=tie,
        **overrides,
    )


def named_hf_config(name: str, *, attn_implementation: str | None = None, **overrides: Any) -> Any:
    """The config :data:`NAMED_HF_CONFIGS` names, ``overrides`` over its fields.

    ``attn_implementation`` is set when given (``None`` leaves transformers' choice).
    """
    import transformers

    model_type, fields = NAMED_HF_CONFIGS[name]
    config = transformers.AutoConfig.for_model(model_type, **(fields | overrides))
    if attn_implementation is not None:
        config._attn_implementation = attn_implementation
    return config


def hf_moe_config(family: str) -> Any:
    """The tiny config of a :data:`HF_MOE_FAMILIES` family (eager attention, router logits out)."""
    import transformers

    config_name, extra = HF_MOE_FAMILIES[family]
    config = getattr(transformers, config_name)(**(HF_MOE_SIZES | extra))
    config._attn_implementation = "eager"
    return config
