"""Hugging Face ``transformers`` models by class name, imported only when a recipe asks for one.

plait's runtime packages never import ``transformers`` at module load; the class is looked up
with ``importlib`` so the app works (and its other recipes run) without it installed.
"""

from __future__ import annotations

import difflib
import importlib
import inspect
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

    With ``pretrained_path`` the config is its ``config.json``; ``hf_config`` may only repeat its
    values (a different value would silently change the checkpoint's model). The weights are
    loaded later by the materialisation step.

    Raises:
        ValueError: no such class, a config key the class's config rejects, or an ``hf_config``
            value that differs from the checkpoint's ``config.json``.
    """
    module = _transformers()
    cls = getattr(module, hf_class, None)
    config_cls = getattr(cls, "config_class", None)
    if cls is None or config_cls is None:
        raise ValueError(
            f"model.hf_class {hf_class!r} is not a transformers model class with a config_class; "
            f"use e.g. 'LlamaForCausalLM', 'Qwen2ForCausalLM' or 'MistralForCausalLM'"
        )
    _check_config_keys(config_cls, hf_config)
    try:
        if pretrained_path is not None:
            if not (Path(pretrained_path) / "config.json").is_file():
                raise ValueError(f"model.pretrained_path {pretrained_path!r} has no config.json")
            config = config_cls.from_pretrained(pretrained_path)
            _check_no_override(config, hf_config, pretrained_path)
        else:
            config = config_cls(**hf_config)
    except TypeError as err:
        raise ValueError(f"model.hf_config is not valid for {config_cls.__name__}: {err}") from None
    config.use_cache = False
    return cls(config)


_CONFIG_KWARGS = frozenset({"attn_implementation", "torch_dtype", "rope_theta", "rope_scaling"})
"""Keys every transformers config reads from its keyword arguments without declaring them."""


def _config_keys(config_cls: type) -> set[str]:
    """What a config class knows: its defaults' fields and the keyword arguments of its constructors."""
    keys = set(config_cls().to_dict())
    for klass in config_cls.__mro__:
        init = vars(klass).get("__init__")
        if init is not None:
            keys |= {
                n
                for n, p in inspect.signature(init).parameters.items()
                if p.kind is p.KEYWORD_ONLY or p.kind is p.POSITIONAL_OR_KEYWORD
            }
    keys |= set(getattr(config_cls, "attribute_map", {}) or {})
    return (keys | _CONFIG_KWARGS) - {"self"}


def _check_no_override(config: Any, hf_config: dict[str, Any], pretrained_path: str) -> None:
    """Refuse ``hf_config`` values that differ from the checkpoint's ``config.json``, naming them."""
    changed = [
        f"{key}: {value!r} in the recipe vs {getattr(config, key, None)!r} in config.json"
        for key, value in hf_config.items()
        if getattr(config, key, None) != value
    ]
    if changed:
        more = f" (+{len(changed) - 3} more)" if len(changed) > 3 else ""
        raise ValueError(
            f"model.hf_config would override model.pretrained_path {pretrained_path!r}'s config.json: "
            f"{'; '.join(changed[:3])}{more}; drop those keys (--set 'model.hf_config={{}}' uses the "
            "checkpoint's config as it is)"
        )


def _check_config_keys(config_cls: type, hf_config: dict[str, Any]) -> None:
    """Refuse a key the config class does not know (transformers would keep it as an unused attribute).

    Raises:
        ValueError: naming the key and the closest known one.
    """
    known = _config_keys(config_cls)
    for key in hf_config:
        if key not in known:
            near = difflib.get_close_matches(key, sorted(known), n=1)
            hint = f" (did you mean '{near[0]}'?)" if near else ""
            raise ValueError(f"model.hf_config key {key!r} is not a field of {config_cls.__name__}{hint}")


def hf_logits(output: Any) -> Any:
    """The logits of a model output: ``output.logits`` for HF outputs, else the output itself."""
    return getattr(output, "logits", output)
