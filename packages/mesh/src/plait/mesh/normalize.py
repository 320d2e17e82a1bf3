"""Normalisers for the string-valued options of the configs (forgiving spelling, strict values)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Literal, TypeAlias

__all__ = [
    "AC_SCOPES",
    "FROZEN_MULTIMODAL_SHARDING",
    "STRATEGY_NAMES",
    "ActivationCheckpointing",
    "ActivationCheckpointingMode",
    "FrozenMultimodalSharding",
    "normalize_ac_scope",
    "normalize_activation_checkpointing",
    "normalize_frozen_multimodal_sharding",
    "normalize_strategy_name",
]

ActivationCheckpointing: TypeAlias = bool | Literal["full", "selective"]
"""What users may pass: False (off), True (= "full"), "full" or "selective"."""
ActivationCheckpointingMode: TypeAlias = Literal[False, "full", "selective"]
"""What :func:`normalize_activation_checkpointing` returns."""
FrozenMultimodalSharding: TypeAlias = Literal["root", "per_layer", "replicate"]

AC_SCOPES: tuple[str, ...] = ("all", "language", "vision", "audio", "multimodal")
"""Layer groups activation checkpointing may be limited to (``multimodal`` = vision + audio)."""
FROZEN_MULTIMODAL_SHARDING: tuple[str, ...] = ("root", "per_layer", "replicate")
STRATEGY_NAMES: tuple[str, ...] = ("fsdp2", "ddp", "megatron_fsdp")
_STRATEGY_ALIASES: dict[str, str] = {"megatron-fsdp": "megatron_fsdp", "mfsdp": "megatron_fsdp"}
_AC_SCOPE_ALIASES: dict[str, str] = {"default": "all", "auto": "all", "multi_modal": "multimodal"}
_AC_MODES: tuple[str, ...] = ("full", "selective")


def _canon(token: str) -> str:
    return token.strip().lower().replace("-", "_")


def normalize_ac_scope(scope: str | Iterable[str] | None) -> tuple[str, ...]:
    """Normalise an activation-checkpointing scope to a tuple of names from :data:`AC_SCOPES`.

    A string may list several scopes separated by ``,`` or ``+``; case is ignored and ``-``
    equals ``_``; ``default`` and ``auto`` mean ``all``; None means ``all``.

    Examples:
        ``"Vision+AUDIO"`` -> ``("vision", "audio")``; ``"multi-modal"`` -> ``("multimodal",)``.

    Raises:
        TypeError: ``scope`` is neither a string nor an iterable of strings.
        ValueError: an unknown scope name, an empty scope, or ``all`` mixed with other scopes.
    """
    if scope is None:
        return ("all",)
    if isinstance(scope, str):
        raw = scope.replace("+", ",").split(",")
    elif isinstance(scope, Iterable):
        raw = []
        for item in scope:
            if not isinstance(item, str):
                raise TypeError(
                    f"activation_checkpointing_scope entries must be strings, got {item!r} "
                    f"({type(item).__name__}) in {scope!r}"
                )
            raw.extend(item.replace("+", ",").split(","))
    else:
        raise TypeError(
            f"activation_checkpointing_scope must be a string or a list of strings, got {scope!r} "
            f"({type(scope).__name__})"
        )
    names: list[str] = []
    for token in raw:
        name = _canon(token)
        if not name:
            continue
        name = _AC_SCOPE_ALIASES.get(name, name)
        if name not in AC_SCOPES:
            raise ValueError(
                f"unknown activation_checkpointing_scope {token.strip()!r} in {scope!r}; "
                f"allowed: {', '.join(AC_SCOPES)} (or default/auto = all), several joined with ',' or '+'"
            )
        if name not in names:
            names.append(name)
    if not names:
        raise ValueError(
            f"activation_checkpointing_scope {scope!r} names no scope; use 'all' or e.g. 'language'"
        )
    if "all" in names and len(names) > 1:
        raise ValueError(
            f"activation_checkpointing_scope {scope!r} mixes 'all' with {[n for n in names if n != 'all']}; "
            f"use 'all' alone or list only the groups you want"
        )
    return tuple(names)


def normalize_activation_checkpointing(value: ActivationCheckpointing | None) -> ActivationCheckpointingMode:
    """Normalise an activation-checkpointing setting to ``False``, ``"full"`` or ``"selective"``.

    ``None`` and ``False`` are off; ``True`` is ``"full"``; strings are case-insensitive.

    Raises:
        TypeError: not a bool, None or string.
        ValueError: a string other than ``full`` / ``selective``.
    """
    if value is None or value is False:
        return False
    if value is True:
        return "full"
    if not isinstance(value, str):
        raise TypeError(
            f"activation_checkpointing must be a bool, 'full' or 'selective', got {value!r} "
            f"({type(value).__name__})"
        )
    mode = value.strip().lower()
    if mode not in _AC_MODES:
        raise ValueError(
            f"unknown activation_checkpointing {value!r}; use False, True (= 'full'), 'full' or 'selective'"
        )
    return mode  # type: ignore[return-value]


def normalize_frozen_multimodal_sharding(value: str) -> FrozenMultimodalSharding:
    """Normalise a frozen-multimodal sharding policy to ``root``, ``per_layer`` or ``replicate``.

    Case is ignored and ``-`` equals ``_`` (``"Per-Layer"`` -> ``"per_layer"``).

    Raises:
        TypeError: ``value`` is not a string.
        ValueError: any other policy name.
    """
    if not isinstance(value, str):
        raise TypeError(
            f"frozen_multimodal_sharding must be a string ({', '.join(FROZEN_MULTIMODAL_SHARDING)}), "
            f"got {value!r} ({type(value).__name__})"
        )
    policy = _canon(value)
    if policy not in FROZEN_MULTIMODAL_SHARDING:
        raise ValueError(
            f"unknown frozen_multimodal_sharding {value!r}; allowed: {', '.join(FROZEN_MULTIMODAL_SHARDING)}"
        )
    return policy  # type: ignore[return-value]


def normalize_strategy_name(name: str) -> str:
    """Normalise a strategy name to ``fsdp2``, ``ddp`` or ``megatron_fsdp``.

    Case is ignored; ``megatron-fsdp`` and ``mfsdp`` are aliases of ``megatron_fsdp``.

    Raises:
        TypeError: ``name`` is not a string.
        ValueError: an unknown strategy name.
    """
    if not isinstance(name, str):
        raise TypeError(f"strategy name must be a string, got {name!r} ({type(name).__name__})")
    key = name.strip().lower()
    key = _STRATEGY_ALIASES.get(key, key)
    if key not in STRATEGY_NAMES:
        raise ValueError(
            f"unknown strategy {name!r}; allowed: {', '.join(STRATEGY_NAMES)} "
            f"(aliases: {', '.join(_STRATEGY_ALIASES)})"
        )
    return key
