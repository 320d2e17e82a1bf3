"""Check attention head counts against the TP size; find the attention modules whose heads get sharded."""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from plait.tp.discovery import language_rank

__all__ = ["Q_HEAD_ATTRS", "KV_HEAD_ATTRS", "check_divisible", "validate_tp_mesh"]

Q_HEAD_ATTRS = ("num_heads", "num_attention_heads", "n_heads")
KV_HEAD_ATTRS = ("num_key_value_heads", "num_kv_heads", "n_kv_heads")


def _text_config(config: Any) -> Any:
    return getattr(config, "text_config", None) or config


def _language_config(model: nn.Module) -> Any:
    """``config.text_config`` first, else the config with ``num_attention_heads`` on the deepest language path."""
    root = getattr(model, "config", None)
    if getattr(root, "text_config", None) is not None:
        return root.text_config
    best: tuple[tuple[int, int], Any] | None = None
    for fqn, module in model.named_modules():
        config = _text_config(getattr(module, "config", None))
        if config is None or not hasattr(config, "num_attention_heads"):
            continue
        rank = (language_rank(fqn), fqn.count(".") + bool(fqn))
        if best is None or rank > best[0]:
            best = (rank, config)
    return None if best is None else best[1]


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

    Reads the language config (``config.text_config`` first, else the config with
    ``num_attention_heads`` on the deepest language path); ``num_key_value_heads`` defaults to
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
