"""Hugging Face ``transformers`` models by class name, imported only when a recipe asks for one.

plait's runtime packages never import ``transformers`` at module load; the class is looked up
with ``importlib`` so the app works (and its other recipes run) without it installed.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

from torch import nn

__all__ = ["build_hf_model", "hf_logits"]


def _transformers() -> Any:
    try:
        return importlib.import_module("transformers")
    except ImportError:
        raise ValueError(
            "model.source 'hf' needs the `transformers` package; install it or use a built-in model "
            "(model.source: dense | moe | vlm)"
        ) from None


def build_hf_model(hf_class: str, hf_config: dict[str, Any], pretrained_path: str | None = None) -> nn.Module:
    """Instantiate ``transformers.<hf_class>`` from a config (the caller picks the device context).

    With ``pretrained_path`` the config is read from its ``config.json`` and ``hf_config`` updates it;
    the weights are loaded later by the materialisation step.

    Raises:
        ValueError: no such class, or a config key the class's config rejects.
    """
    module = _transformers()
    cls = getattr(module, hf_class, None)
    config_cls = getattr(cls, "config_class", None)
    if cls is None or config_cls is None:
        raise ValueError(
            f"model.hf_class {hf_class!r} is not a transformers model class with a config_class; "
            f"use e.g. 'LlamaForCausalLM', 'Qwen2ForCausalLM' or 'MistralForCausalLM'"
        )
    try:
        if pretrained_path is not None:
            if not (Path(pretrained_path) / "config.json").is_file():
                raise ValueError(f"model.pretrained_path {pretrained_path!r} has no config.json")
            config = config_cls.from_pretrained(pretrained_path, **hf_config)
        else:
            config = config_cls(**hf_config)
    except TypeError as err:
        raise ValueError(f"model.hf_config is not valid for {config_cls.__name__}: {err}") from None
    config.use_cache = False
    return cls(config)


def hf_logits(output: Any) -> Any:
    """The logits of a model output: ``output.logits`` for HF outputs, else the output itself."""
    return getattr(output, "logits", output)
