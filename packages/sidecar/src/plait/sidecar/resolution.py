"""Which sidecar parallelizes a model: class attribute, then registry, then the shared default."""

from __future__ import annotations

import importlib
import weakref
from typing import Any

from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from plait.mesh import MeshContext, check_ranks_agree, describe_mesh_context, describe_module
from plait.sidecar.parallel_plan import ParallelPlan
from plait.sidecar.parallelizer import ModelParallelizer
from plait.sidecar.plan import plan_parallelism

__all__ = ["get_model_parallelizer", "get_parallel_plan", "parallelize_model", "register_model_parallelizer"]

_DEFAULT_PARALLELIZER = ModelParallelizer()
_REGISTRY: dict[str, Any] = {}
_PARALLELIZED: weakref.WeakSet[nn.Module] = weakref.WeakSet()
"""Models :func:`parallelize_model` has returned (and the ones it was given), so a second call is refused."""
_PLANS: weakref.WeakKeyDictionary[nn.Module, ParallelPlan] = weakref.WeakKeyDictionary()
"""The plan applied to each model :func:`parallelize_model` returned."""


def register_model_parallelizer(class_name: str, parallelizer: ModelParallelizer | str) -> None:
    """Register the sidecar for models whose class is ``class_name``.

    Args:
        class_name: Qualified (``"pkg.mod.Class"``) or bare (``"Class"``) class name; the qualified
            entry wins when both match.
        parallelizer: A sidecar instance, or a lazy ``"pkg.mod:ATTR"`` path to one (or to a sidecar
            class, instantiated with no arguments), imported on first use.

    Raises:
        TypeError / ValueError: for a non-string name, an empty name, or a malformed path.
    """
    if not isinstance(class_name, str) or not class_name.strip():
        raise TypeError(f"class_name must be a non-empty class name string, got {class_name!r}")
    if isinstance(parallelizer, str):
        module, sep, attr = parallelizer.partition(":")
        if not (sep and module and attr):
            raise ValueError(
                f"parallelizer path {parallelizer!r} must look like 'pkg.module:ATTR' (a sidecar instance or class)"
            )
    _REGISTRY[class_name] = parallelizer


def get_model_parallelizer(model: nn.Module) -> ModelParallelizer:
    """Return the sidecar for ``model``.

    Resolution order: the class attribute ``parallelizer`` (inherited from base classes too); else
    the registry entry for the class's qualified name, then its bare name; else the shared default
    ``ModelParallelizer()``. A sidecar class (rather than an instance) is instantiated.

    Raises:
        TypeError: when the resolved object has no callable ``parallelize``.
        ImportError / AttributeError: when a registered ``"pkg.mod:ATTR"`` path does not import.
    """
    cls = type(model)
    candidate = getattr(cls, "parallelizer", None)
    source = f"{cls.__qualname__}.parallelizer"
    if candidate is None:
        for key in (f"{cls.__module__}.{cls.__qualname__}", cls.__name__):
            if key in _REGISTRY:
                candidate, source = _load(key), f"register_model_parallelizer({key!r}, ...)"
                break
    if candidate is None:
        return _DEFAULT_PARALLELIZER
    if not callable(getattr(candidate, "parallelize", None)):
        raise TypeError(
            f"{source} for model class {cls.__qualname__} is {candidate!r} ({type(candidate).__name__}), "
            "which has no callable parallelize(model, mesh_context); use an instance of "
            "plait.sidecar.ModelParallelizer or a subclass of it."
        )
    return candidate() if isinstance(candidate, type) else candidate


def parallelize_model(
    model: nn.Module, mesh_context: MeshContext, *, plan: ParallelPlan | None = None
) -> nn.Module:
    """Apply every parallelism ``mesh_context`` requests through the model's sidecar; return the model.

    The sidecar's plan (`plan_parallelism`) is made first, before any collective, then applied; it
    stays readable with `get_parallel_plan(result)`. The returned model trains correctly with a plain
    loop (forward, loss, backward, optimizer step): no gradient synchronisation or rescaling is left
    to the caller.

    Args:
        model: The plain model.
        mesh_context: The meshes and configs.
        plan: A plan made for this model and context (a pipeline stage's); None = made here.

    Raises:
        TypeError: ``model`` is not an ``nn.Module`` or ``mesh_context`` not a ``MeshContext``.
        ValueError: ``model`` is already parallelized, a pp axis (use ``plait.pipeline.pipeline_model``),
            any refusal of the plan, or ranks that do not all pass the same model structure and mesh
            context (compared with a short timeout, before any collective).
    """
    _check_arguments(model, mesh_context)
    if mesh_context.pp_size > 1 and plan is None:
        raise ValueError(
            f"pp_size={mesh_context.pp_size}: parallelize_model does not split a model into pipeline stages; "
            "call plait.pipeline.pipeline_model(model, mesh_context, loss_fn) (package plait-pipeline), "
            "which runs this flow on each stage."
        )
    parallelizer = get_model_parallelizer(model)
    description = {**describe_mesh_context(mesh_context), **describe_module(model)}
    description["sidecar"] = f"{type(parallelizer).__module__}.{type(parallelizer).__qualname__}"
    mesh = mesh_context.device_mesh  # under PP each stage's ranks parallelize their own stage
    ranks = None if mesh is None else mesh.mesh.flatten().tolist()
    check_ranks_agree("parallelize_model", description, ranks=ranks)
    if not isinstance(parallelizer, ModelParallelizer):  # a duck-typed sidecar: its own parallelize
        result = parallelizer.parallelize(model, mesh_context)
    else:
        plan = plan if plan is not None else plan_parallelism(model, mesh_context, parallelizer)
        result = parallelizer._apply(model, mesh_context, plan)
        _PLANS[result] = plan
    _PARALLELIZED.add(model)
    _PARALLELIZED.add(result)
    return result


def get_parallel_plan(model: nn.Module) -> ParallelPlan | None:
    """The plan `parallelize_model` applied to ``model`` (its result), or None."""
    return _PLANS.get(model)


def _check_arguments(model: Any, mesh_context: Any) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"parallelize_model expects a torch.nn.Module, got {model!r} ({type(model).__name__}); "
            "wrap the computation in an nn.Module subclass"
        )
    if not isinstance(mesh_context, MeshContext):
        raise TypeError(
            f"parallelize_model expects a plait.mesh.MeshContext, got {type(mesh_context).__name__}; "
            "build one with MeshContext.build(strategy_config, sizes)"
        )
    reason = _parallelized_by(model)
    if reason is not None:
        raise ValueError(
            f"parallelize_model: this {type(model).__name__} is already parallelized ({reason}); call "
            "parallelize_model once, on the plain model (build a fresh model to parallelize it again)"
        )


def _parallelized_by(model: nn.Module) -> str | None:
    if model in _PARALLELIZED:
        return "returned by an earlier parallelize_model call"
    if isinstance(model, DistributedDataParallel):
        return "it is a DistributedDataParallel wrapper"
    if hasattr(model, "_orig_mod"):
        return "it is a torch.compile wrapper"
    for name, module in model.named_modules():
        if isinstance(module, FSDPModule):
            return f"module {name or '(root)'!r} is an FSDP2 unit"
    for name, param in model.named_parameters():
        if isinstance(param, DTensor):
            return f"parameter {name!r} is a DTensor"
    return None


def _load(key: str) -> Any:
    """Return the registry entry for ``key``, importing (once) a lazy ``"pkg.mod:ATTR"`` path."""
    entry = _REGISTRY[key]
    if isinstance(entry, str):
        module, _, attr = entry.partition(":")
        entry = getattr(importlib.import_module(module), attr)
        if isinstance(entry, type) and callable(getattr(entry, "parallelize", None)):
            entry = entry()
        _REGISTRY[key] = entry
    return entry
