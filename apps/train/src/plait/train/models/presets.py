"""Size presets of the built-in reference models, up to the Llama-3-70B shape."""

from __future__ import annotations

from typing import Any

__all__ = ["DENSE_PRESETS", "MOE_PRESETS", "PRESETS", "VLM_PRESETS", "preset_arch"]

_BYTE_VOCAB = 272
"""Byte-level tokenizer (256 bytes + specials), padded to a multiple of 16."""

DENSE_PRESETS: dict[str, dict[str, Any]] = {
    "tiny": {
        "vocab_size": _BYTE_VOCAB,
        "hidden_size": 128,
        "intermediate_size": 384,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
    },
    "small": {
        "vocab_size": _BYTE_VOCAB,
        "hidden_size": 512,
        "intermediate_size": 1536,
        "num_hidden_layers": 8,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
    },
    "llama3-8b": {
        "vocab_size": 128256,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "rope_theta": 500000.0,
    },
    "llama3-70b": {
        "vocab_size": 128256,
        "hidden_size": 8192,
        "intermediate_size": 28672,
        "num_hidden_layers": 80,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "rope_theta": 500000.0,
    },
}

MOE_PRESETS: dict[str, dict[str, Any]] = {
    "tiny": {
        **DENSE_PRESETS["tiny"],
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 128,
    },
    "small": {
        **DENSE_PRESETS["small"],
        "num_experts": 16,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 512,
        "shared_expert_intermediate_size": 512,
    },
}

VLM_PRESETS: dict[str, dict[str, Any]] = {
    "tiny": {
        "text_config": dict(DENSE_PRESETS["tiny"]),
        "vision_config": {"image_size": 16, "patch_size": 8, "hidden_size": 64, "num_hidden_layers": 2},
    },
}

PRESETS: dict[str, dict[str, dict[str, Any]]] = {
    "dense": DENSE_PRESETS,
    "moe": MOE_PRESETS,
    "vlm": VLM_PRESETS,
}


def preset_arch(source: str, preset: str, arch: dict[str, Any]) -> dict[str, Any]:
    """The preset's fields updated with ``arch`` (nested dicts merged one level deep).

    Raises:
        ValueError: an unknown preset for the source, naming the known ones.
    """
    table = PRESETS[source]
    if preset not in table:
        raise ValueError(
            f"model.preset {preset!r} is not a {source} preset; choose one of: {', '.join(table)}"
        )
    merged = {k: dict(v) if isinstance(v, dict) else v for k, v in table[preset].items()}
    for key, value in arch.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = {**merged[key], **value}
        else:
            merged[key] = value
    return merged
