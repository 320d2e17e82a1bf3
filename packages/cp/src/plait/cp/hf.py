"""Hugging Face models: context-parallel attention through transformers' attention-function registry.

A model whose classes call ``ALL_ATTENTION_FUNCTIONS.get_interface(config._attn_implementation, ...)``
(``_supports_attention_backend``) is switched to the registered ``"plait_cp"`` function; each of its
attention modules carries the `ContextParallelAttention` that function hands the tensors to. No model
class is changed. transformers is imported lazily: plait-cp does not depend on it.
"""

from __future__ import annotations

import ast
import functools
import inspect
import textwrap
from typing import Any

import torch
from torch import nn

from plait.cp.attention import ContextParallelAttention
from plait.cp.layout import DOCUMENTS_KEY

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
    can_set = getattr(type(model), "_can_set_attn_implementation", None)
    if can_set is None or not can_set():
        return f"{name} does not dispatch attention through transformers' AttentionInterface"
    if any(getattr(config, key, None) is not None for key in ("vision_config", "audio_config")):
        return f"{name} is multimodal: media tokens spliced into the sequence are not context-parallel yet"
    text = getattr(config, "text_config", None) or config
    if getattr(text, "sliding_window_pattern", None) and not getattr(text, "layer_types", None):
        return (
            f"{name} sets config.sliding_window_pattern={text.sliding_window_pattern!r} without "
            "config.layer_types; cp cannot tell which layers slide"
        )
    if "chunked_attention" in (getattr(text, "layer_types", None) or ()):
        return (
            f"{name} has chunked attention layers (config.attention_chunk_size="
            f"{getattr(text, 'attention_chunk_size', None)!r}): the chunks live in the mask alone, which cp "
            "attention does not see"
        )
    if getattr(text, "attention_dropout", 0.0):
        return (
            f"{name} has attention_dropout={text.attention_dropout}; cp attention does not implement dropout"
        )
    return None


_DISPATCH_MARKERS = ("ALL_ATTENTION_FUNCTIONS", "attention_interface")
"""What the forward of a transformers attention module that dispatches by ``_attn_implementation`` contains."""
_FEATURE_KWARGS = {"sliding_window": "window", "softcap": "softcap", "s_aux": "sinks"}
"""The attention-function keywords of transformers' attention modules cp honours, and its own names."""
_KNOWN_TENSOR_KWARGS = frozenset({"s_aux", "position_ids", DOCUMENTS_KEY})
"""Tensor keywords an attention function may receive that cp attention honours (sinks) or reads
elsewhere (positions, documents); any other tensor is refused rather than dropped."""


def hf_module_refusal(module: nn.Module) -> str | None:
    """Why one HF attention module cannot be handled, or None.

    A window, soft-cap or sinks reach cp attention only as the keyword the module passes to its
    attention function; a module that has one but whose ``forward`` does not pass it (the mask alone
    would carry a window cp does not see) is refused.
    """
    config = getattr(module, "config", None)
    has = {
        "sliding_window": getattr(module, "sliding_window", None) is not None
        or _slides(getattr(config, "text_config", None) or config),
        "softcap": bool(getattr(config, "attn_logit_softcapping", None)),
        "s_aux": getattr(module, "sinks", None) is not None,
    }
    if isinstance(compressor := getattr(module, "compressor", None), nn.Module):
        return (
            f"{type(module).__name__} has compressor ({type(compressor).__name__}): compressed attention pools "
            "keys over windows of the whole sequence, which cp splits"
        )
    source = _forward_source(type(module))
    for keyword, present in has.items():
        if present and f"{keyword}=" not in source:
            return (
                f"{type(module).__name__} has {_FEATURE_KWARGS[keyword]} but its forward does not pass "
                f"{keyword}= to the attention function; cp attention cannot see it"
            )
    return None


def sparse_refusal(module: nn.Module) -> str | None:
    """Why an HF attention module picks keys over the whole sequence (a DSA indexer), or None."""
    if isinstance(indexer := getattr(module, "indexer", None), nn.Module):
        return (
            f"{type(module).__name__} has indexer ({type(indexer).__name__}): sparse attention picks keys over "
            "the whole sequence, which cp splits"
        )
    return None


def own_mask_refusal(module: nn.Module) -> str | None:
    """Why an HF attention module hands its attention function a mask it builds itself (Doge's dynamic
    mask: scores of keys across the whole sequence), or None; read from its ``forward``'s source."""
    mask = _mask_argument(type(module))
    if mask in (None, "attention_mask", "None"):
        return None
    return (
        f"{type(module).__name__} hands its attention function a mask it builds itself ({mask}); cp "
        "attention takes none (the mask would span ranks)"
    )


@functools.cache
def _mask_argument(cls: type) -> str | None:
    """The source of the mask argument of the ``attention_interface(...)`` call in ``cls.forward``, or None."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls.forward)))
    except (OSError, TypeError, SyntaxError):
        return None
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id == "attention_interface"
        ):
            named = [k.value for k in node.keywords if k.arg == "attention_mask"]
            mask = named[0] if named else node.args[4] if len(node.args) > 4 else None
            return None if mask is None else ast.unparse(mask)
    return None


def own_forward_refusal(module: nn.Module) -> str | None:
    """Why an HF ``*Attention`` module never reaches transformers' attention functions (linear or
    lightning attention computed in its own forward), or None (also when no source can be read)."""
    cls = type(module)
    sources = [_forward_source(c) for c in cls.__mro__ if "forward" in vars(c) and c is not nn.Module]
    if not any(sources) or any(marker in src for src in sources for marker in _DISPATCH_MARKERS):
        return None
    return (
        f"{cls.__name__} computes attention in its own forward (it does not call transformers' attention "
        "functions, where cp attention is registered)"
    )


def sequence_mixer_refusal(module: nn.Module) -> str | None:
    """Why a non-attention module of an HF model mixes tokens along the sequence (a convolution), or None.

    A causal ``Conv1d`` over time (Mamba mixers, short convolutions) would read only this rank's
    chunks: its first tokens would miss the previous chunk's.
    """
    if isinstance(module, nn.Conv1d) and module.kernel_size[0] > 1:
        return (
            f"a convolution over the sequence (Conv1d, kernel {module.kernel_size[0]}): its window crosses "
            "the cp chunk boundaries, where this rank does not hold the previous tokens"
        )
    return None


def dispatches_attention(module: nn.Module) -> bool:
    """Whether ``module``'s forward (or an ancestor class's) calls transformers' attention functions."""
    sources = [
        _forward_source(c) for c in type(module).__mro__ if "forward" in vars(c) and c is not nn.Module
    ]
    return any("ALL_ATTENTION_FUNCTIONS.get_interface(" in src for src in sources)


def _slides(config: Any) -> bool:
    layer_types = getattr(config, "layer_types", None) or ()
    return "sliding_attention" in layer_types or bool(getattr(config, "use_sliding_window", False))


def _forward_source(cls: type) -> str:
    try:
        return inspect.getsource(cls.forward)
    except (OSError, TypeError):
        return ""


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
    missed = [  # a module without a config reads none: nothing to switch
        m
        for m in attention_modules
        if getattr(m, "config", None) is not None
        and getattr(m.config, "_attn_implementation", None) != ATTN_IMPLEMENTATION
    ]
    if missed:  # a module holding another config than the model's would run its old attention on chunks
        raise ValueError(
            f"{len(missed)} attention modules of {type(model).__name__} ({type(missed[0]).__name__} first) read "
            f"a config other than the model's, still {getattr(missed[0].config, '_attn_implementation', None)!r}; cp attention "
            "cannot reach them: give them the model's config"
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
    extra = getattr(attention, "extra_kwargs", ())  # what a gathered module's attention also takes
    unknown = sorted(
        k
        for k, v in kwargs.items()
        if isinstance(v, torch.Tensor) and k not in _KNOWN_TENSOR_KWARGS and k not in extra
    )
    if unknown:
        raise ValueError(
            f"{type(module).__name__} hands its attention function {unknown} (tensors cp attention does not "
            "apply, e.g. an additive position bias); run this model with cp_size 1"
        )
    features = {ours: kwargs.get(theirs) for theirs, ours in _FEATURE_KWARGS.items()}
    features["documents"] = kwargs.get(DOCUMENTS_KEY)  # handed down by the model's forward (**kwargs)
    if is_causal is None:
        config = getattr(module, "config", None)
        is_causal = getattr(module, "is_causal", True) and getattr(config, "is_causal", True)
    out = attention(
        query,
        key,
        value,
        attention_mask,
        dropout,
        is_causal=is_causal,
        scale=scaling,
        enable_gqa=True,
        **features,
        **{k: kwargs[k] for k in extra if kwargs.get(k) is not None},
    )
    return out.transpose(1, 2).contiguous(), None
