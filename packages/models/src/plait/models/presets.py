"""Size presets of the reference models: ``test`` (the class defaults) up to the Llama-3-70B shape."""

from __future__ import annotations

from dataclasses import fields
from typing import Any

from torch import nn

from plait.models.dense import DecoderConfig, DenseDecoder
from plait.models.moe import MoEDecoder, MoEDecoderConfig
from plait.models.vlm import VLM, VisionConfig, VLMConfig

__all__ = ["DENSE_PRESETS", "MOE_PRESETS", "PRESETS", "REFERENCE_MODELS", "VLM_PRESETS", "preset_arch"]

_BYTE_VOCAB = 272
"""Byte-level tokenizer (256 bytes + specials), padded to a multiple of 16."""


def _defaults(config_cls: type) -> dict[str, Any]:
    """The ``test`` preset: every field of ``config_cls`` at its default (the sizes tests build)."""
    config = config_cls()
    return {f.name: getattr(config, f.name) for f in fields(config) if f.name != "head_dim"}


DENSE_PRESETS: dict[str, dict[str, Any]] = {
    "tiny": {
        "vocab_size": _BYTE_VOCAB,
        "hidden_size": 128,
        "intermediate_size": 384,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-5,
    },
    "small": {
        "vocab_size": _BYTE_VOCAB,
        "hidden_size": 512,
        "intermediate_size": 1536,
        "num_hidden_layers": 8,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "rms_norm_eps": 1e-5,
    },
    "llama3-8b": {
        "vocab_size": 128256,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "rope_theta": 500000.0,
        "rms_norm_eps": 1e-5,
    },
    "llama3-70b": {
        "vocab_size": 128256,
        "hidden_size": 8192,
        "intermediate_size": 28672,
        "num_hidden_layers": 80,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "rope_theta": 500000.0,
        "rms_norm_eps": 1e-5,
    },
    "test": _defaults(DecoderConfig),
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
    "test": {**_defaults(MoEDecoderConfig), "zero_token_experts": []},
}

VLM_PRESETS: dict[str, dict[str, Any]] = {
    "tiny": {
        "text_config": dict(DENSE_PRESETS["tiny"]),
        "vision_config": {
            "image_size": 16,
            "patch_size": 8,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
        },
    },
    "test": {"text_config": _defaults(DecoderConfig), "vision_config": _defaults(VisionConfig)},
}

PRESETS: dict[str, dict[str, dict[str, Any]]] = {
    "dense": DENSE_PRESETS,
    "moe": MOE_PRESETS,
    "vlm": VLM_PRESETS,
}

REFERENCE_MODELS: dict[str, tuple[type, type[nn.Module]]] = {
    "dense": (DecoderConfig, DenseDecoder),
    "moe": (MoEDecoderConfig, MoEDecoder),
    "vlm": (VLMConfig, VLM),
}
"""Model kind -> (config class, model class)."""


def preset_arch(kind: str, preset: str, arch: dict[str, Any] | None = None) -> dict[str, Any]:
    """The preset's fields updated with ``arch`` (nested dicts merged one level deep), as plain data.

    Raises:
        ValueError: an unknown kind or preset, naming the known ones.
    """
    if kind not in PRESETS:
        raise ValueError(f"unknown reference model {kind!r}; choose one of: {', '.join(PRESETS)}")
    table = PRESETS[kind]
    if preset not in table:
        raise ValueError(f"model.preset {preset!r} is not a {kind} preset; choose one of: {', '.join(table)}")
    merged = {k: dict(v) if isinstance(v, dict) else v for k, v in table[preset].items()}
    for key, value in (arch or {}).items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = {**merged[key], **value}
        else:
            merged[key] = value
    return merged
