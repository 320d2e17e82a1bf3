"""Reference dense, MoE and vision-language decoders with size presets (torch only).

The bottom of plait's layering: no other plait package is imported here, so the app, the tests and
the tools share one copy of each model. Each model class carries its own tensor-parallel plan as
Hugging Face style ``_tp_plan`` data, which plait.tp translates.
"""

from plait.models.attention import AttentionFn, sdpa_attention
from plait.models.dense import (
    LLAMA_TP_PLAN,
    DecoderConfig,
    DecoderModel,
    DenseDecoder,
    llama_tp_plan_for,
)
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
    "LLAMA_TP_PLAN",
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
    "llama_tp_plan_for",
    "preset_arch",
    "sdpa_attention",
]
