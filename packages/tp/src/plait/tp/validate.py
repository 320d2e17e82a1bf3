"""Check attention head counts against the TP size; find the attention modules whose heads get sharded."""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from plait.tp.discovery import find_decoder, language_rank

__all__ = ["Q_HEAD_ATTRS", "KV_HEAD_ATTRS", "check_divisible", "validate_tp_mesh"]

Q_HEAD_ATTRS = ("num_heads", "num_attention_heads", "n_heads")
KV_HEAD_ATTRS = ("num_key_value_heads", "num_kv_heads", "n_kv_heads")


def _text_config(config: Any) -> Any:
    return getattr(config, "text_config", None) or config


def _heads_config(module: nn.Module) -> Any:
    config = _text_config(getattr(module, "config", None))
    return config if hasattr(config, "num_attention_heads") else None


def _language_config(model: nn.Module) -> Any:
    """The config that sizes the decoder's attention, never a nested (vision / audio) sub-model's.

    ``config.text_config`` first; else the config of the decoder stack or its nearest configured
    ancestor; else a configured module on a ``language_model`` / ``text_model`` path (shallowest),
    then the shallowest configured module.
    """
    root = getattr(model, "config", None)
    if getattr(root, "text_config", None) is not None:
        return root.text_config
    modules = dict(model.named_modules())
    decoder = find_decoder(model)
    if decoder is not None:
        parts = decoder[0].split(".") if decoder[0] else []
        for depth in range(len(parts), -1, -1):
            config = _heads_config(modules[".".join(parts[:depth])])
            if config is not None:
                return config
    found = [(fqn, c) for fqn, m in modules.items() if (c := _heads_config(m)) is not None]
    if not found:
        return None
    return min(found, key=lambda item: (-language_rank(item[0]), item[0].count(".") + bool(item[0])))[1]


def check_divisible(name: str, value: Any, tp_size: int) -> None:
    """Raise ``ValueError`` unless ``value`` is a positive int divisible by ``tp_size``, naming both."""
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    if value % tp_size:
        options = [d for d in range(1, value + 1) if value % d == 0]
        raise ValueError(
            f"{name} ({value}) must be divisible by tp_size ({tp_size}); use a tp_size in {options}, "
            f"or a model whose {name} is a multiple of {tp_size}"
        )


def validate_tp_mesh(model: nn.Module, tp_size: int | DeviceMesh) -> None:
    """Check the model's attention heads split evenly over ``tp_size`` ranks (a TP mesh is accepted too).

    Reads the language config (``config.text_config`` first, else the decoder stack's config, else
    the shallowest config with ``num_attention_heads`` on a language path); ``num_key_value_heads`` defaults to
    ``num_attention_heads``. A model without such a config has nothing to check. Runs no collective.

    Raises:
        ValueError: ``tp_size < 1``, non-positive head counts, or heads / KV heads not divisible by ``tp_size``.
    """
    size = tp_size.size() if isinstance(tp_size, DeviceMesh) else tp_size
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"tp_size must be a positive int, got {tp_size!r}")
    config = _language_config(model)
    if config is None:
        return
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None)
    kv_heads = heads if kv_heads is None else kv_heads
    check_divisible("num_attention_heads", heads, size)
    check_divisible("num_key_value_heads", kv_heads, size)
