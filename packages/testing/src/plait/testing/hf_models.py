"""Tiny Hugging Face causal LMs built from configs with seeded random weights (no download).

``transformers`` is imported inside the functions: plait-testing does not depend on it, and a test
suite without it never calls these.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["TINY_HF_SIZES", "tiny_hf_config", "tiny_hf_model"]

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
