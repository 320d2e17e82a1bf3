"""Pick a model's TP plan (six-step precedence), turn style strings into styles, check every pattern matches."""

from __future__ import annotations

import difflib
import importlib
import inspect
import warnings
from collections.abc import Callable, Mapping
from fnmatch import fnmatchcase
from typing import Any

from torch import nn
from torch.distributed.tensor.parallel import ParallelStyle

from plait.tp.hf import hf_tp_plan, is_remote_code_model
from plait.tp.llama import llama_tp_plan
from plait.tp.registry import model_class_plan, named_plan, registered_plan_names
from plait.tp.styles import parse_style

__all__ = ["ResolvedTPPlan", "normalize_plan", "resolve_tp_plan", "unmatched_message"]

_FORMS = (
    "a dict {fqn_pattern: ParallelStyle | style string}, a registered plan name, "
    "or an import path 'pkg.mod:ATTR' naming a dict or a function (model, sequence_parallel) -> dict"
)
_LENIENT_SOURCES = frozenset({"Hugging Face plan", "default Llama-style plan"})
Finalize = Callable[[nn.Module, dict[str, ParallelStyle]], "dict[str, ParallelStyle] | None"]


class ResolvedTPPlan(dict[str, ParallelStyle]):
    """A resolved plan ``{fqn_pattern: ParallelStyle}`` that says where it came from.

    ``source``: ``explicit tp_plan``, ``registered plan 'NAME'``, ``tp_plan 'pkg.mod:ATTR'``,
    ``sidecar tp_plan``, ``plan registered for CLASS``, ``Hugging Face plan`` or ``default
    Llama-style plan``.
    """

    def __init__(self, plan: Mapping[str, ParallelStyle], source: str) -> None:
        super().__init__(plan)
        self.source = source


def normalize_plan(plan: Mapping[str, Any], source: str) -> dict[str, ParallelStyle]:
    """Copy ``plan`` with style strings parsed into new style objects.

    Raises:
        TypeError: a non-string key or a value that is neither a ``ParallelStyle`` nor a string.
        ValueError: an unknown style string.
    """
    if not isinstance(plan, Mapping):
        raise TypeError(f"{source} must be a dict {{fqn_pattern: style}}, got {type(plan).__name__}")
    out: dict[str, ParallelStyle] = {}
    for key, style in plan.items():
        if not isinstance(key, str):
            raise TypeError(f"{source} keys must be module FQN patterns (str), got {key!r}")
        if isinstance(style, str):
            out[key] = parse_style(style)
        elif isinstance(style, ParallelStyle):
            out[key] = style
        else:
            raise TypeError(
                f"{source} value for {key!r} must be a ParallelStyle or a style string, got {type(style).__name__}"
            )
    return out


def _call_factory(factory: Callable[..., Any], model: nn.Module, sequence_parallel: bool) -> Any:
    try:
        inspect.signature(factory).bind(model, sequence_parallel)
    except (TypeError, ValueError):
        return factory()
    return factory(model, sequence_parallel)


def _import_plan(path: str, model: nn.Module, sequence_parallel: bool) -> Any:
    module_name, _, attr = path.partition(":")
    try:
        obj: Any = importlib.import_module(module_name)
        for part in attr.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError, ValueError) as exc:
        raise ValueError(f"invalid tp_plan import path {path!r}: {exc}; expected {_FORMS}") from None
    if isinstance(obj, Mapping):
        return obj
    if callable(obj):
        return _call_factory(obj, model, sequence_parallel)
    raise ValueError(f"tp_plan import path {path!r} names a {type(obj).__name__}; expected {_FORMS}")


def _from_user(plan: Any, model: nn.Module, sequence_parallel: bool, what: str) -> tuple[str, Any]:
    if isinstance(plan, Mapping):
        return f"explicit {what}", plan
    if isinstance(plan, str):
        factory = named_plan(plan)
        if factory is not None:
            found = factory(model, sequence_parallel)
            if found is None:
                raise ValueError(
                    f"registered plan {plan!r} has no plan for {type(model).__name__}; pass another tp_plan"
                )
            return f"registered plan {plan!r}", found
        if ":" in plan:
            return f"{what} {plan!r}", _import_plan(plan, model, sequence_parallel)
        raise ValueError(
            f"unknown {what} {plan!r}: not a registered plan name (registered: {', '.join(registered_plan_names())}) "
            f"nor an import path; expected {_FORMS}"
        )
    raise TypeError(f"{what} must be {_FORMS}; got {type(plan).__name__}")


def _pick(
    model: nn.Module, plan: Any, sequence_parallel: bool, tp_size: int, model_plan: Any
) -> tuple[str, Any]:
    if plan is not None:
        return _from_user(plan, model, sequence_parallel, "tp_plan")
    if model_plan is not None:
        if callable(model_plan) and not isinstance(model_plan, Mapping):
            found = model_plan(model, sequence_parallel)
            if found is not None:
                return "sidecar tp_plan", found
        else:
            return _from_user(model_plan, model, sequence_parallel, "sidecar tp_plan")
    factory = model_class_plan(model)
    if factory is not None:
        return f"plan registered for {type(model).__name__}", factory(model, sequence_parallel)
    found = hf_tp_plan(model, sequence_parallel)
    if found is not None:
        return "Hugging Face plan", found
    if tp_size > 1 and is_remote_code_model(model):
        name = type(model).__name__
        raise ValueError(
            f"{name} is remote code ({type(model).__module__}) with no tensor-parallel plan, so tp_size {tp_size} "
            f"cannot be applied safely; pass tp_plan= ({_FORMS}), or call "
            f"plait.tp.register_model_tp_plan({name!r}, factory), or use tp_size 1"
        )
    warnings.warn(
        f"no TP plan found for {type(model).__name__}; using the default Llama-style plan",
        UserWarning,
        stacklevel=3,
    )
    return "default Llama-style plan", llama_tp_plan(model, sequence_parallel)


def unmatched_message(model: nn.Module, pattern: str, fqns: list[str], source: str) -> str:
    """'pattern matches no module' with the closest module names as hints."""
    close = difflib.get_close_matches(pattern.replace("*", "0"), fqns, n=3, cutoff=0.6)
    hint = f"; similar modules: {', '.join(repr(c) for c in close)}" if close else ""
    return f"{source} pattern {pattern!r} matches no module of {type(model).__name__}{hint}"


def _check_patterns(
    model: nn.Module, plan: dict[str, ParallelStyle], lenient: set[str], source: str
) -> dict[str, ParallelStyle]:
    fqns = [fqn for fqn, _ in model.named_modules() if fqn]
    out: dict[str, ParallelStyle] = {}
    for pattern, style in plan.items():
        if any(fnmatchcase(fqn, pattern) for fqn in fqns):
            out[pattern] = style
            continue
        message = unmatched_message(model, pattern, fqns, source)
        if pattern not in lenient:
            raise ValueError(f"{message}; fix or remove the pattern")
        warnings.warn(f"{message}; skipping it", UserWarning, stacklevel=3)
    if lenient and not out:
        raise ValueError(
            f"the {source} matches no module of {type(model).__name__}; pass tp_plan= ({_FORMS})"
        )
    return out


def resolve_tp_plan(
    model: nn.Module,
    *,
    plan: Mapping[str, Any] | str | None = None,
    sequence_parallel: bool = False,
    tp_size: int,
    model_plan: Callable[[nn.Module, bool], Any] | Mapping[str, Any] | str | None = None,
    finalize: Finalize | None = None,
) -> ResolvedTPPlan:
    """Pick the TP plan for ``model``; first match wins.

    1. ``plan`` as a dict; 2. ``plan`` as a registered plan name; 3. ``plan`` as an import path
    ``"pkg.mod:ATTR"`` (a dict, or a function returning one); 4. ``model_plan``, the sidecar's factory
    ``(model, sequence_parallel)`` (returning ``None`` means "no opinion"), then a plan registered for the
    model's class; 5. the model's Hugging Face plan; 6. the default Llama-style plan (with a warning),
    except for remote-code models at ``tp_size > 1``. Then ``finalize(model, plan)`` (the sidecar's
    ``_finalize_tp_plan``; it may edit the plan in place or return a new one).

    Every pattern must match a module FQN (``fnmatch``): an unmatched pattern is an error, except in
    the Hugging Face / default plans, where it is dropped with a warning.

    Returns:
        ``{fqn_pattern: ParallelStyle}`` with fresh style objects, and its ``source``.

    Raises:
        ValueError / TypeError: an invalid plan form, unknown style, bad import path, unmatched pattern,
            or a remote-code model without a plan at ``tp_size > 1``.
    """
    source, raw = _pick(model, plan, sequence_parallel, tp_size, model_plan)
    styles = normalize_plan(raw, source)
    lenient = set(styles) if source in _LENIENT_SOURCES else set()
    if finalize is not None:
        finalized = finalize(model, styles)
        styles = normalize_plan(styles if finalized is None else finalized, "finalized tp_plan")
    return ResolvedTPPlan(_check_patterns(model, styles, lenient, source), source)
