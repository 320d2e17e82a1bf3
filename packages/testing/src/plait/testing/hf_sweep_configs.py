"""The Hugging Face TP sweep's families and their tiny configs (hidden 128, 2 layers, vocab 128).

Every causal-LM family of the installed transformers whose config declares a ``base_model_tp_plan``
(``tools/hf_sweep``), built from :data:`SWEEP_HF_SIZES`, the heads for the TP size and the few
per-family :data:`SWEEP_HF_OVERRIDES`. ``transformers`` is imported inside the functions.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "SWEEP_CP_WINDOWS",
    "SWEEP_HF_HEADS",
    "SWEEP_HF_OVERRIDES",
    "SWEEP_HF_SIZES",
    "sweep_hf_config",
    "sweep_hf_families",
]

_VOCAB = 128

SWEEP_HF_SIZES: dict[str, Any] = {
    "vocab_size": _VOCAB,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "max_position_embeddings": 128,
    "use_cache": False,
    "tie_word_embeddings": False,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    # MoE sizes, read only by the configs that have them
    "num_experts": 4,
    "num_local_experts": 4,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 64,
    "shared_expert_intermediate_size": 64,
    "n_shared_experts": 1,
    "first_k_dense_replace": 1,
    "n_group": 1,
    "topk_group": 1,
}
SWEEP_HF_HEADS: dict[int, dict[str, int]] = {
    2: {"num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32},
    4: {"num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 16},
}
# latent (MLA) attention at this size; there head_dim is the rope part (which the common head_dim would overwrite)
_LATENT = {
    "kv_lora_rank": 32,
    "q_lora_rank": 64,
    "qk_rope_head_dim": 16,
    "qk_nope_head_dim": 16,
    "v_head_dim": 16,
    "head_dim": 16,
}
# a vision / audio tower of one small block (the text model alone is under test)
_TINY_TOWER = {"hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 2}
SWEEP_HF_OVERRIDES: dict[str, dict[str, Any]] = {
    # families whose configs need more than the common fields to build at this size
    "axk1": _LATENT,
    "beam": {
        "mlp_layer_types": ["dense", "sparse"]
    },  # both dense by default at 2 layers: no experts to shard
    "codegen": {"rotary_dim": 16},  # rotary part of each head: at most head_dim (16 at tp 4)
    "cohere_compass_text": {  # rope per layer type; the default has no entry for its full-attention layers
        "rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 10000.0}}
    },
    "deepseek_v2": _LATENT,
    "deepseek_v3": _LATENT,
    # hash routing reads a token -> expert table that is all zeros until a checkpoint fills it: each token
    # picks expert 0 twice, so the gate's gradient is exactly 0 and the sweep would compare rounding noise
    "deepseek_v4": {"mlp_layer_types": ["moe", "moe"]},
    "dots3_note_text": _LATENT,
    "flint": {"mlp_only_layers": [0]},  # every layer dense by default at this size
    "gemma4_text": {  # the MoE block is off by default; per-layer input embeddings: 262k x 512 by default
        "enable_moe_block": True,
        "top_k_experts": 2,
        "vocab_size_per_layer_input": _VOCAB,
    },
    "gemma3n_text": {  # one of the two layers reuses the other's KV (default: the last 15 of 35 layers)
        "num_kv_shared_layers": 1,
        "vocab_size_per_layer_input": _VOCAB,  # per-layer input embeddings: 262k x 256 per layer by default
        "hidden_size_per_layer_input": 16,
    },
    "gptj": {"rotary_dim": 16},  # rotary part of each head: at most head_dim (16 at tp 4)
    # no default layer types; by default both layers would be dense (2 dense layers first)
    "lfm2_moe": {"layer_types": ["conv", "full_attention"], "num_dense_layers": 1},
    # num_layers counts (attention, MLP) pairs: 1 gives the 2 hidden layers; 2 identity experts, not 256
    "longcat_flash": {
        **_LATENT,
        "num_layers": 1,
        "zero_expert_num": 2,
        "expert_ffn_hidden_size": 64,
        "ffn_hidden_size": 256,
    },
    "phimoe": {"router_jitter_noise": 0.0},  # 0.01 by default: random router noise in training
    "phi4_multimodal": {  # the towers are built by the causal LM too (27 + 24 large blocks by default)
        "vision_config": {**_TINY_TOWER, "num_hidden_layers": 1},
        "audio_config": {
            **_TINY_TOWER,
            "num_blocks": 1,
            "ext_pw_out_channel": 32,
            "depthwise_separable_out_channel": 32,
            "nemo_conv_channels": 32,
        },
    },
    "seed_oss": {"attention_dropout": 0.0, "residual_dropout": 0.0},  # 0.1 by default: random masks
    "youtu": _LATENT,
}


SWEEP_CP_WINDOWS: dict[str, int] = {"sliding_window": 5, "attention_chunk_size": 8}
"""Under cp, local windows shrunk to fit the sweep's 16 tokens (a default of 4096 would hide them): a
5-token window and 8-token chunks cross the cp2 chunk boundaries. Set only where the config has one."""


def sweep_hf_families(only: list[str] | None = None) -> list[str]:
    """Causal-LM model types of the installed transformers whose config declares a ``base_model_tp_plan``."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    found = []
    for model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        try:
            config_cls = CONFIG_MAPPING[model_type]
        except (KeyError, ImportError):
            continue
        if getattr(config_cls, "base_model_tp_plan", None):
            found.append(model_type)
    if only:
        unknown = sorted(set(only) - set(found))
        if unknown:
            raise SystemExit(f"not causal-LM families with a TP plan: {unknown}")
        found = list(dict.fromkeys(only))  # the caller's order
    return found


def sweep_hf_config(model_type: str, tp: int, cp: int = 1) -> Any:
    """The family's tiny config for ``tp`` (4 heads / 2 KV heads at tp 2, 8 / 4 at tp 4), eager attention, no dropout.

    ``cp > 1``: the windows of :data:`SWEEP_CP_WINDOWS` that the config sets, shrunk.
    """
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    fields = {**SWEEP_HF_SIZES, **SWEEP_HF_HEADS[tp], **SWEEP_HF_OVERRIDES.get(model_type, {})}
    config_cls = CONFIG_MAPPING[model_type]
    if hasattr(config_cls, "kv_lora_rank"):  # latent attention: keys/values come per query head
        fields["num_key_value_heads"] = fields["num_attention_heads"]
    if "text_config" in config_cls.sub_configs:  # a composite config: the causal LM builds from its text part
        fields = {"text_config": fields}
    config = AutoConfig.for_model(model_type, **fields)
    for name, value in config.to_dict().items():
        # Random per-process noise (dropout, router jitter) differs between the two copies.
        if ("dropout" in name or "jitter" in name) and isinstance(value, float) and value > 0:
            setattr(config, name, 0.0)
    if cp > 1:
        _shrink_windows(getattr(config, "text_config", None) or config)
    config._attn_implementation = "eager"
    return config


def _shrink_windows(config: Any) -> None:
    for name, value in SWEEP_CP_WINDOWS.items():
        if isinstance(getattr(config, name, None), int) and getattr(config, name) > value:
            setattr(config, name, value)
