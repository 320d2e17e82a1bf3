"""Strict conversion of YAML-style dicts into config keyword arguments."""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy

__all__ = ["check_types", "kwargs_from_dict", "parse_dtype", "parse_mp_policy", "parse_offload_policy"]

_MP_KEYS: tuple[str, ...] = ("param_dtype", "reduce_dtype", "output_dtype", "cast_forward_inputs")


def parse_dtype(key: str, value: object) -> torch.dtype | None:
    """Read a dtype given as ``torch.dtype``, ``"bfloat16"``, ``"torch.float32"`` or None."""
    if value is None or isinstance(value, torch.dtype):
        return value
    if not isinstance(value, str):
        raise TypeError(
            f"{key} must be a dtype name such as 'bfloat16', got {value!r} ({type(value).__name__})"
        )
    name = value.strip().removeprefix("torch.")
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"{key} {value!r} is not a torch dtype; use e.g. 'bfloat16', 'float16' or 'float32'")
    return dtype


def parse_mp_policy(key: str, value: object) -> MixedPrecisionPolicy | None:
    """Read a mixed-precision policy given as a policy, None, or a dict of its four fields.

    Example: ``{param_dtype: bfloat16, reduce_dtype: float32, output_dtype: bfloat16,
    cast_forward_inputs: true}``; missing dtypes are None, ``cast_forward_inputs`` defaults to True.
    """
    if value is None or isinstance(value, MixedPrecisionPolicy):
        return value
    if not isinstance(value, Mapping):
        raise TypeError(
            f"{key} must be a dict with keys {list(_MP_KEYS)} or null, got {value!r} ({type(value).__name__})"
        )
    unknown = [k for k in value if k not in _MP_KEYS]
    if unknown:
        raise ValueError(f"unknown key(s) {unknown} in {key}; allowed keys: {list(_MP_KEYS)}")
    cast = value.get("cast_forward_inputs", True)
    if not isinstance(cast, bool):
        raise TypeError(f"{key}.cast_forward_inputs must be a bool, got {cast!r} ({type(cast).__name__})")
    return MixedPrecisionPolicy(
        param_dtype=parse_dtype(f"{key}.param_dtype", value.get("param_dtype")),
        reduce_dtype=parse_dtype(f"{key}.reduce_dtype", value.get("reduce_dtype")),
        output_dtype=parse_dtype(f"{key}.output_dtype", value.get("output_dtype")),
        cast_forward_inputs=cast,
    )


def parse_offload_policy(key: str, value: object) -> OffloadPolicy | None:
    """Read an offload policy given as a policy, None, ``"cpu"``, or ``{pin_memory: bool}`` (CPU offload)."""
    if value is None or isinstance(value, OffloadPolicy):
        return value
    if isinstance(value, str):
        if value.strip().lower() != "cpu":
            raise ValueError(
                f"{key} {value!r} is not an offload policy; use 'cpu', {{pin_memory: bool}} or null"
            )
        return CPUOffloadPolicy()
    if isinstance(value, Mapping):
        unknown = [k for k in value if k != "pin_memory"]
        if unknown:
            raise ValueError(f"unknown key(s) {unknown} in {key}; allowed keys: ['pin_memory']")
        pin = value.get("pin_memory", True)
        if not isinstance(pin, bool):
            raise TypeError(f"{key}.pin_memory must be a bool, got {pin!r} ({type(pin).__name__})")
        return CPUOffloadPolicy(pin_memory=pin)
    raise TypeError(
        f"{key} must be 'cpu', {{pin_memory: bool}} or null, got {value!r} ({type(value).__name__})"
    )


def _matches(value: object, hint: Any) -> bool:
    """Whether ``value`` fits the (simple) type ``hint``: scalars, unions, Literal, tuple, list, dict."""
    if hint is Any:
        return True
    if hint is type(None):
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_matches(value, arg) for arg in typing.get_args(hint))
    if origin is typing.Literal:
        return any(value == arg and type(value) is type(arg) for arg in typing.get_args(hint))
    if origin in (tuple, list):
        args = [a for a in typing.get_args(hint) if a is not Ellipsis]
        return isinstance(value, list | tuple) and all(_matches(v, args[0]) for v in value) if args else True
    if origin is dict or hint is dict:
        return isinstance(value, Mapping)
    if isinstance(hint, type):
        return isinstance(value, hint)
    return True


def _describe(hint: Any) -> str:
    return getattr(hint, "__name__", None) or str(hint).replace("typing.", "")


def check_types(obj: object) -> None:
    """Check every field of the dataclass instance ``obj`` against its annotation.

    Raises:
        TypeError: naming the field, the expected type and the value.
    """
    cls = type(obj)
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if not _matches(value, hints[f.name]):
            raise TypeError(
                f"{cls.__name__}.{f.name} must be {_describe(hints[f.name])}, got {value!r} ({type(value).__name__})"
            )


def kwargs_from_dict(cls: type, data: object) -> dict[str, Any]:
    """Check the keys of a YAML-style mapping against the dataclass ``cls``; return its keyword arguments.

    Lists become tuples; values are type-checked (and parsed) by the config's ``__post_init__``.

    Raises:
        TypeError: ``data`` is not a mapping.
        ValueError: a key is not a field of ``cls``.
    """
    if not isinstance(data, Mapping):
        raise TypeError(f"{cls.__name__}.from_dict expects a mapping, got {data!r} ({type(data).__name__})")
    fields = [f.name for f in dataclasses.fields(cls) if f.init]
    unknown = [k for k in data if k not in fields]
    if unknown:
        raise ValueError(f"unknown {cls.__name__} key(s) {unknown}; allowed keys: {sorted(fields)}")
    return {k: tuple(v) if isinstance(v, list) else v for k, v in data.items()}
