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
from plait.sharding.selective import save_only_context_fn, selective_context_fn

CheckpointMode = Literal["full", "selective"]

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


def _checkpoint_submodules(layer: nn.Module, context_fn: Callable[[], Any] | None) -> int | None:
    """Wrap each role's first existing child; None when the layer has no known role at all."""
    count, found = 0, False
    for role in SUBMODULE_ROLES:
        name = next((n for n in role if isinstance(getattr(layer, n, None), nn.Module)), None)
        if name is None:
            continue
        found = True
        child = getattr(layer, name)
        if not isinstance(child, CheckpointWrapper):
            setattr(layer, name, _wrap(child, context_fn))
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
    save_ops: Iterable[Any] | None = None,
) -> int:
    """Checkpoint the trainable layers of the groups ``scope`` selects; apply after TP, before FSDP.

    Modes:
        - ``full`` per-submodule (default): wrap the first existing child of each role in
          :data:`SUBMODULE_ROLES`; a layer with none of them is wrapped whole.
        - ``full`` with ``whole_layer=True``: wrap each layer (non-reentrant, RNG state preserved).
        - ``selective``: wrap each layer with an op-level policy that saves attention kernels,
          collectives and every other matmul, and recomputes the rest.
    ``save_ops`` are always saved (e.g. a MoE router's top-k, so routing cannot change on recompute).
    Already-wrapped modules are skipped. The groups' ``layers`` lists are updated to the wrapped
    layers. A model config with ``use_cache`` gets it set False.

    Args:
        model: The model owning ``groups``.
        groups: From :func:`discover_layer_groups`.
        mode: ``full`` (or True) or ``selective``.
        scope: ``all``, ``language``, ``vision``, ``audio``, ``multimodal`` (vision + audio), or several.
        whole_layer: Full mode only: wrap layers whole instead of per submodule.
        save_ops: Extra ops whose outputs are saved rather than recomputed.

    Returns:
        The number of modules newly wrapped.

    Raises:
        ValueError: for an unknown mode or scope.
    """
    if mode is True:
        mode = "full"
    if mode not in ("full", "selective"):
        raise ValueError(f"Activation checkpointing mode must be 'full' or 'selective', got {mode!r}.")
    kinds = frozenset().union(*(_SCOPE_KINDS[name] for name in normalize_ac_scope(scope)))
    if mode == "selective":
        context_fn: Callable[[], Any] | None = selective_context_fn(save_ops)
    else:
        context_fn = save_only_context_fn(save_ops) if save_ops else None
    count, selected = 0, 0
    for group in groups:
        if group.kind not in kinds:
            continue
        container = model.get_submodule(group.path)
        for index, layer in enumerate(group.layers):
            if not any(p.requires_grad for p in layer.parameters()):
                continue
            selected += 1
            if isinstance(layer, CheckpointWrapper):
                continue
            if mode == "full" and not whole_layer:
                wrapped_children = _checkpoint_submodules(layer, context_fn)
                if wrapped_children is not None:
                    count += wrapped_children
                    continue
            group.layers[index] = _wrap(layer, context_fn)
            _replace_layer(container, layer, group.layers[index])
            count += 1
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
