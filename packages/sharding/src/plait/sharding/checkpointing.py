"""Activation checkpointing of layer groups: per-submodule, whole-layer and selective."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Literal

from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl,
    CheckpointWrapper,
    checkpoint_wrapper,
)

from plait.mesh import normalize_ac_scope
from plait.sharding.layer_groups import LayerGroup
from plait.sharding.selective import ForwardDepth, policy_context_fn

CheckpointMode = Literal["full", "selective"]
ContextFor = Callable[[nn.Module], Callable[[], Any] | None]
"""The checkpoint ``context_fn`` for a module about to be wrapped (None: plain full recompute)."""

SUBMODULE_ROLES: tuple[tuple[str, ...], ...] = (
    ("mlp", "feed_forward", "ffn"),
    ("self_attn", "attention", "attn"),
    ("input_layernorm", "attention_norm", "norm1", "layer_norm1"),
    ("post_attention_layernorm", "ffn_norm", "norm2", "layer_norm2"),
)
"""Per-submodule checkpointing wraps the first existing child of each role: MLP, attention, pre-norm, post-norm."""

_SCOPE_KINDS: dict[str, frozenset[str]] = {
    "all": frozenset({"language", "vision", "audio"}),
    "language": frozenset({"language"}),
    "vision": frozenset({"vision"}),
    "audio": frozenset({"audio"}),
    "multimodal": frozenset({"vision", "audio"}),
}


def _wrap(module: nn.Module, context_fn: Callable[[], Any] | None) -> nn.Module:
    kwargs: dict[str, Any] = {"preserve_rng_state": True}
    if context_fn is not None:
        kwargs["context_fn"] = context_fn
    return checkpoint_wrapper(module, checkpoint_impl=CheckpointImpl.NO_REENTRANT, **kwargs)


def _replace_layer(container: nn.Module, layer: nn.Module, wrapped: nn.Module) -> None:
    for key, child in container.named_children():
        if child is layer:
            container.register_module(key, wrapped)
            return
    raise AssertionError(f"layer {type(layer).__name__} is not a child of its group's container")


def _checkpoint_submodules(layer: nn.Module, context_for: ContextFor) -> int | None:
    """Wrap each role's first existing child; None when the layer has no known role at all."""
    count, found = 0, False
    for role in SUBMODULE_ROLES:
        name = next((n for n in role if isinstance(getattr(layer, n, None), nn.Module)), None)
        if name is None:
            continue
        found = True
        child = getattr(layer, name)
        if not isinstance(child, CheckpointWrapper):
            setattr(layer, name, _wrap(child, context_for(child)))
            count += 1
    return count if found else None


def _disable_kv_cache(model: nn.Module) -> None:
    for module in model.modules():
        config = getattr(module, "config", None)
        for cfg in (config, getattr(config, "text_config", None)):
            if getattr(cfg, "use_cache", False):
                cfg.use_cache = False


def apply_activation_checkpointing(
    model: nn.Module,
    groups: Sequence[LayerGroup],
    *,
    mode: CheckpointMode | bool = "full",
    scope: str | Iterable[str] = ("all",),
    whole_layer: bool = False,
    save_inside: Sequence[nn.Module] = (),
) -> int:
    """Checkpoint the trainable layers of the groups ``scope`` selects; apply after TP, before FSDP.

    ``full`` wraps the first existing child of each role in :data:`SUBMODULE_ROLES` (a layer with
    none, or every layer with ``whole_layer``, is wrapped whole); ``selective`` wraps each layer with
    an op-level policy (docs/behavior.md, "Activation checkpointing"). Already-wrapped modules are
    skipped; the groups' ``layers`` lists are updated; a config's ``use_cache`` is set False.

    Args:
        model: The model owning ``groups``.
        groups: From :func:`discover_layer_groups`.
        mode: ``full`` (or True) or ``selective``.
        scope: ``all``, ``language``, ``vision``, ``audio``, ``multimodal`` (vision + audio), or several.
        whole_layer: Full mode only: wrap layers whole instead of per submodule.
        save_inside: Modules whose ops are all saved, never recomputed (e.g. MoE routers, so routing
            cannot change on recompute). In full mode the wrapped modules holding one of them run
            under the op-level policy too; the rest of their ops are recomputed.

    Returns:
        The number of modules newly wrapped.

    Raises:
        ValueError: for an unknown mode or scope.
    """
    selective = _is_selective(mode)
    kinds = frozenset().union(*(_SCOPE_KINDS[name] for name in normalize_ac_scope(scope)))
    context_for = _context_for(selective, save_inside)
    per_submodule = not selective and not whole_layer
    count, selected = 0, 0
    for group in (g for g in groups if g.kind in kinds):
        container = model.get_submodule(group.path)
        for index, layer in enumerate(group.layers):
            if not any(p.requires_grad for p in layer.parameters()):
                continue
            selected += 1
            if not isinstance(layer, CheckpointWrapper):
                count += _checkpoint_layer(container, group, index, context_for, per_submodule)
    if not selected:
        warnings.warn(
            f"Activation checkpointing scope {scope!r} selects no trainable layer among groups "
            f"{[(g.kind, g.path) for g in groups]}; nothing is checkpointed.",
            UserWarning,
            stacklevel=2,
        )
    if count:
        _disable_kv_cache(model)
    return count


def _is_selective(mode: CheckpointMode | bool) -> bool:
    """Whether ``mode`` is ``selective`` (``full`` and True are not).

    Raises:
        ValueError: for any other mode.
    """
    if mode is True:
        mode = "full"
    if mode not in ("full", "selective"):
        raise ValueError(f"Activation checkpointing mode must be 'full' or 'selective', got {mode!r}.")
    return mode == "selective"


def _context_for(selective: bool, save_inside: Sequence[nn.Module]) -> ContextFor:
    """Build the one policy's ``context_fn`` and say which modules get it (all of them when selective)."""
    if not selective and not save_inside:
        return lambda module: None
    depth = ForwardDepth(save_inside) if save_inside else None
    context_fn = policy_context_fn(selective=selective, save_inside=depth)
    if selective:
        return lambda module: context_fn
    ids = {id(m) for m in save_inside}
    return lambda module: context_fn if any(id(m) in ids for m in module.modules()) else None


def _checkpoint_layer(
    container: nn.Module,
    group: LayerGroup,
    index: int,
    context_for: ContextFor,
    per_submodule: bool,
) -> int:
    """Wrap ``group.layers[index]`` (per submodule when asked and possible, else whole); the count wrapped."""
    layer = group.layers[index]
    if per_submodule:
        wrapped_children = _checkpoint_submodules(layer, context_for)
        if wrapped_children is not None:
            return wrapped_children
    group.layers[index] = _wrap(layer, context_for(layer))
    _replace_layer(container, layer, group.layers[index])
    return 1
