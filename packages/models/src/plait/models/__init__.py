"""Reference dense, MoE and vision-language decoders with size presets (torch only).

The bottom of plait's layering: no other plait package is imported here, so the app, the tests and
the tools share one copy of each model. Their tensor-parallel plan is plait.tp's Llama-style plan:
registered there by class name for the dense and vision-language decoders, the default for MoE.
"""

from plait.models.attention import AttentionFn, sdpa_attention
from plait.models.dense import DecoderConfig, DecoderModel, DenseDecoder
from plait.models.moe import GroupedExperts, MoEDecoder, MoEDecoderConfig, MoEDecoderLayer, TopKRouter
from plait.models.presets import (
    DENSE_PRESETS,
    MOE_PRESETS,
    PRESETS,
    REFERENCE_MODELS,
    VLM_PRESETS,
    preset_arch,
)
from plait.models.vlm import VLM, VisionConfig, VLMConfig, freeze_vision

__all__ = [
    "DENSE_PRESETS",
    "MOE_PRESETS",
    "PRESETS",
    "REFERENCE_MODELS",
    "VLM",
    "VLM_PRESETS",
    "AttentionFn",
    "DecoderConfig",
    "DecoderModel",
    "DenseDecoder",
    "GroupedExperts",
    "MoEDecoder",
    "MoEDecoderConfig",
    "MoEDecoderLayer",
    "TopKRouter",
    "VLMConfig",
    "VisionConfig",
    "freeze_vision",
    "preset_arch",
    "sdpa_attention",
]
