"""Hugging Face models: context-parallel attention through transformers' attention-function registry.

A model whose classes call ``ALL_ATTENTION_FUNCTIONS.get_interface(config._attn_implementation, ...)``
(``_supports_attention_backend``) is switched to the registered ``"plait_cp"`` function; each of its
attention modules carries the `ContextParallelAttention` that function hands the tensors to. No model
class is changed. transformers is imported lazily: plait-cp does not depend on it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from plait.cp.attention import ContextParallelAttention

ATTN_IMPLEMENTATION = "plait_cp"
"""The name registered in transformers' ``AttentionInterface``."""
CP_ATTRIBUTE = "cp_attention"
"""Attribute of each HF attention module holding its `ContextParallelAttention`."""


def is_hf_model(module: nn.Module) -> bool:
    """Whether ``module`` is a transformers ``PreTrainedModel`` (without importing transformers)."""
    return any(
        c.__name__ == "PreTrainedModel" and c.__module__.startswith("transformers.")
        for c in type(module).__mro__
    )


def hf_refusal(model: nn.Module) -> str | None:
    """Why the HF model ``model`` cannot run context-parallel attention, or None when it can."""
    config = model.config
    name = type(model).__name__
    if not getattr(type(model), "_supports_attention_backend", False):
        return f"{name} does not dispatch attention through transformers' AttentionInterface"
    if any(getattr(config, key, None) is not None for key in ("vision_config", "audio_config")):
        return f"{name} is multimodal: media tokens spliced into the sequence are not context-parallel yet"
    text = getattr(config, "text_config", None) or config
    if "sliding_attention" in (getattr(text, "layer_types", None) or ()) or getattr(
        text, "use_sliding_window", False
    ):
        return f"{name} uses sliding-window attention (config.layer_types / use_sliding_window), not built under cp"
    for key in ("attn_logit_softcapping", "sliding_window_pattern"):
        if getattr(text, key, None):
            return f"{name} sets config.{key}={getattr(text, key)!r}, which cp attention does not implement"
    if getattr(text, "attention_dropout", 0.0):
        return (
            f"{name} has attention_dropout={text.attention_dropout}; cp attention does not implement dropout"
        )
    return None


def hf_module_refusal(module: nn.Module) -> str | None:
    """Why one HF attention module cannot be handled (a per-layer sliding window), or None."""
    if getattr(module, "sliding_window", None) is not None:
        return f"sliding_window={module.sliding_window} (sliding-window attention is not built under cp)"
    return None


def attach_hf(
    model: nn.Module, attention_modules: list[nn.Module], attention: ContextParallelAttention
) -> None:
    """Register ``"plait_cp"``, switch ``model`` to it and give each attention module ``attention``."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, _hf_attention)
    for module in attention_modules:
        setattr(module, CP_ATTRIBUTE, attention)
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    if model.config._attn_implementation != ATTN_IMPLEMENTATION:
        raise ValueError(
            f"{type(model).__name__} refused attn_implementation {ATTN_IMPLEMENTATION!r} "
            f"(kept {model.config._attn_implementation!r}); it cannot run context-parallel attention"
        )


def _hf_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers attention-function signature; returns ``([B, L, H, D], None)``."""
    attention = getattr(module, CP_ATTRIBUTE, None)
    if attention is None:
        raise ValueError(
            f"{type(module).__name__} runs attn_implementation {ATTN_IMPLEMENTATION!r} but was not prepared "
            "by plait.cp.apply_context_parallel"
        )
    for key_name in ("sliding_window", "softcap", "s_aux"):
        if kwargs.get(key_name) is not None:
            raise ValueError(f"{type(module).__name__}: cp attention does not implement {key_name}")
    if is_causal is None:
        config = getattr(module, "config", None)
        is_causal = getattr(module, "is_causal", True) and getattr(config, "is_causal", True)
    out = attention(
        query, key, value, attention_mask, dropout, is_causal=is_causal, scale=scaling, enable_gqa=True
    )
    return out.transpose(1, 2).contiguous(), None
