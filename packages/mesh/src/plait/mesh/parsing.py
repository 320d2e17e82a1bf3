"""Strict mapping of YAML-style data onto dataclasses, and the parsers of the configs' special fields."""

from __future__ import annotations

import dataclasses
import difflib
import math
import types
import typing
from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy

__all__ = ["check_types", "from_dict", "parse_dtype", "parse_mp_policy", "parse_offload_policy"]

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


def from_dict(cls: type, data: object, path: str = "", *, what: str = "") -> Any:
    """Map YAML-style data onto the dataclass ``cls`` strictly: the one mapper of plait and its app.

    Keys must be fields (an unknown key is named with its full ``path`` and the closest field);
    nested dataclasses are mapped recursively; ``bool``/``int``/``float``/``str``/None, ``Literal``,
    unions, lists, tuples (from lists) and dicts are checked against the annotation (an int is
    accepted for a float; floats must be finite); other types, and dataclasses inside a union, are
    passed to the class, whose ``__post_init__`` parses them (e.g. a mixed-precision dict).

    Args:
        cls: the dataclass.
        data: the mapping (as ``yaml.safe_load`` returns it).
        path: where ``data`` sits (``"model.arch"``), prefixed to every key in messages.
        what: the noun of messages about unknown keys (``"recipe"``, a config class name).

    Raises:
        ValueError: an unknown key, a non-finite float or a value outside a ``Literal``.
        TypeError: ``data`` is not a mapping, or a value of the wrong type.
    """
    where = path or what or cls.__name__
    if not isinstance(data, Mapping):
        raise TypeError(f"{where} must be a mapping of keys to values, got {_value(data)}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls) if f.init]
    for key in data:
        if key not in names:
            near = difflib.get_close_matches(str(key), names, n=1)
            hint = f" (did you mean '{_join(path, near[0])}'?)" if near else ""
            noun = f"{what} key" if what else "key"
            raise ValueError(f"unknown {noun} '{_join(path, str(key))}'{hint}; allowed: {', '.join(names)}")
    return cls(**{key: _convert(hints[key], value, _join(path, key), what) for key, value in data.items()})


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _value(value: object) -> str:
    return "null" if value is None else f"{value!r} ({type(value).__name__})"


def _expected(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is typing.Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_expected(a) for a in typing.get_args(tp))
    if tp is type(None):
        return "null"
    if origin in (list, tuple) or tp in (list, tuple):
        return "a list"
    if origin is dict or tp is dict:
        return "a dict"
    return getattr(tp, "__name__", str(tp).replace("typing.", ""))


def _convert(tp: Any, value: Any, path: str, what: str, *, nested: bool = True) -> Any:
    """``value`` checked against ``tp``; a dataclass inside a union is the class's to parse."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        return from_dict(tp, value, path, what=what) if nested and not isinstance(value, tp) else value
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        refused: list[ValueError] = []
        for arm in args:
            try:
                return _convert(arm, value, path, what, nested=False)
            except ValueError as err:  # the right type, a wrong value (e.g. not finite): say that
                if typing.get_origin(arm) is not typing.Literal:
                    refused.append(err)
            except TypeError:
                continue
        if refused:
            raise refused[0]
        raise TypeError(f"{path} must be {_expected(tp)}, got {_value(value)}")
    if origin is typing.Literal:
        if any(value == a and type(value) is type(a) for a in args):
            return value
        raise ValueError(f"{path} must be one of {', '.join(repr(a) for a in args)}, got {value!r}")
    if origin in (list, tuple):
        if not isinstance(value, list | tuple):
            raise TypeError(f"{path} must be a list, got {_value(value)}")
        arms = [a for a in args if a is not Ellipsis]
        items = [_convert(arms[0], v, f"{path}[{i}]", what) if arms else v for i, v in enumerate(value)]
        return items if origin is list else tuple(items)
    if origin is dict or tp is dict:
        if not isinstance(value, Mapping):
            raise TypeError(f"{path} must be a mapping, got {_value(value)}")
        arm = args[1] if args else Any
        return {k: _convert(arm, v, _join(path, str(k)), what) for k, v in value.items()}
    return _convert_scalar(tp, value, path)


def _convert_scalar(tp: Any, value: Any, path: str) -> Any:
    if tp is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            if not math.isfinite(value):
                raise ValueError(f"{path} must be a finite number, got {value!r}")
            return float(value)
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp in (bool, str, type(None)):
        if type(value) is tp:
            return value
    else:
        return value  # a type the class parses itself (its __post_init__ checks it)
    raise TypeError(f"{path} must be {_expected(tp)}, got {_value(value)}")
