"""Layer groups: the transformer-layer containers of a model, by explicit path or by structure."""

from __future__ import annotations

import warnings
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

from torch import nn

from plait.sharding._walk import is_container, join_fqn
from plait.sharding.multimodal import TOWER_NAMES

LayerKind = Literal["language", "vision", "audio"]
LayerGroupPaths = Mapping[str, str | Sequence[str]] | Sequence[str | Sequence[str]]

_KINDS: tuple[str, ...] = ("language", "vision", "audio")
_AUDIO_TOKENS = frozenset(name for name in TOWER_NAMES if "audio" in name) | {"audio"}
_VISION_TOKENS = TOWER_NAMES - _AUDIO_TOKENS


@dataclass
class LayerGroup:
    """One container of transformer layers."""

    kind: LayerKind
    """``language``, ``vision`` or ``audio``."""
    path: str
    """FQN of the container inside the model."""
    layers: list[nn.Module] = field(default_factory=list)
    """The container's elements, in order."""


def classify_path(path: str) -> LayerKind:
    """Classify a module path by its tokens: audio or vision tower names, else language."""
    tokens = path.split(".")
    if any(t in _AUDIO_TOKENS or "audio" in t for t in tokens):
        return "audio"
    if any(t in _VISION_TOKENS or "vision" in t or "visual" in t for t in tokens):
        return "vision"
    return "language"


def _layers_of(container: nn.Module) -> list[nn.Module]:
    return list(container.children())


def _is_layer_container(module: nn.Module) -> bool:
    if isinstance(module, nn.ModuleList):
        return len(module) > 0
    if isinstance(module, nn.ModuleDict):
        return len(module) > 0 and all(key.isdigit() for key in module)
    return False


def _iter_containers(module: nn.Module, prefix: str = "") -> Iterator[tuple[str, nn.Module]]:
    """Yield layer containers reached through ordinary modules and nested containers, not inside layers."""
    for name, child in module.named_children():
        fqn = join_fqn(prefix, name)
        if is_container(child):
            yield from _iter_in_container(child, fqn)
        else:
            yield from _iter_containers(child, fqn)


def _iter_in_container(container: nn.Module, fqn: str) -> Iterator[tuple[str, nn.Module]]:
    layered = _is_layer_container(container)
    if layered:
        yield fqn, container
    for name, element in container.named_children():
        if is_container(element):
            yield from _iter_in_container(element, join_fqn(fqn, name))
        elif not layered:
            yield from _iter_containers(element, join_fqn(fqn, name))


def _explicit_groups(model: nn.Module, paths: LayerGroupPaths) -> list[LayerGroup]:
    if isinstance(paths, Mapping):
        entries: list[tuple[str | None, Sequence[str]]] = [
            (kind, [cands] if isinstance(cands, str) else list(cands)) for kind, cands in paths.items()
        ]
    else:
        entries = [(None, [cands] if isinstance(cands, str) else list(cands)) for cands in paths]
    groups: list[LayerGroup] = []
    for kind, candidates in entries:
        if kind is not None and kind not in _KINDS:
            raise ValueError(f"layer_group_paths kind {kind!r} is unknown; use one of {', '.join(_KINDS)}.")
        for fqn in candidates:
            try:
                container = model.get_submodule(fqn)
            except AttributeError:
                continue
            if not _is_layer_container(container):
                raise ValueError(
                    f"layer_group_paths entry {fqn!r} resolves to {type(container).__name__}, not a "
                    "non-empty nn.ModuleList or numeric-key nn.ModuleDict of layers."
                )
            groups.append(LayerGroup(kind or classify_path(fqn), fqn, _layers_of(container)))  # type: ignore[arg-type]
            break
    return groups


def discover_layer_groups(
    model: nn.Module, layer_group_paths: LayerGroupPaths | None = None
) -> list[LayerGroup]:
    """Return the layer groups of ``model``.

    Explicit ``layer_group_paths`` come first: either ``{kind: fqn | [candidate fqns]}`` or a list
    of groups, each an FQN or a list of candidate FQNs (kind classified from the path); per group
    the first FQN that resolves is used. When no explicit path resolves, discovery is structural:
    every non-empty ``nn.ModuleList`` or numeric-key ``nn.ModuleDict`` reached through ordinary
    modules (not inside a layer) is classified by its path, and the longest container of each
    kind is kept.

    Raises:
        ValueError: naming the model class when it has no layer container, or for a bad explicit path.
    """
    if layer_group_paths:
        groups = _explicit_groups(model, layer_group_paths)
        if groups:
            return groups
        warnings.warn(
            f"None of layer_group_paths {layer_group_paths!r} resolves in {type(model).__name__}; "
            "falling back to structural layer discovery.",
            UserWarning,
            stacklevel=2,
        )
    best: dict[str, tuple[str, nn.Module]] = {}
    for fqn, container in _iter_containers(model):
        kind = classify_path(fqn)
        if kind not in best or len(container) > len(best[kind][1]):
            best[kind] = (fqn, container)
    if not best:
        raise ValueError(
            f"{type(model).__name__} has no layer container (a non-empty nn.ModuleList or numeric-key "
            "nn.ModuleDict of layers); set layer_group_paths on its ModelParallelizer to name the "
            "layer containers."
        )
    return [LayerGroup(kind, fqn, _layers_of(c)) for kind, (fqn, c) in best.items()]  # type: ignore[arg-type]
