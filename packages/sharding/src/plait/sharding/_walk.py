"""Structural walk over layer containers, shared by unit selection, the tie guard and layer groups."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from torch import nn


@dataclass(frozen=True)
class UnitCandidate:
    """One element of a layer container: a would-be FSDP unit."""

    fqn: str
    """Fully qualified name of the element inside the walked model."""
    module: nn.Module
    """The element itself."""
    parent: nn.Module
    """The container that holds it."""
    name: str
    """Its key inside ``parent``."""
    last: bool
    """Whether it is the last element of its container."""


def join_fqn(prefix: str, name: str) -> str:
    """Join a module prefix and a child name the way ``named_modules`` does."""
    return f"{prefix}.{name}" if prefix else name


def is_container(module: nn.Module) -> bool:
    """Whether ``module`` is a layer container (``nn.ModuleList`` or ``nn.ModuleDict``)."""
    return isinstance(module, nn.ModuleList | nn.ModuleDict)


def walk_unit_candidates(root: nn.Module, skip: frozenset[int] = frozenset()) -> Iterator[UnitCandidate]:
    """Yield every element of every container reached through ordinary modules, in registration order.

    Nested containers are walked into (never yielded themselves); elements are not walked into.
    Modules whose ``id`` is in ``skip`` are neither yielded nor walked into. A module reachable
    twice is yielded once.
    """
    seen: set[int] = set(skip)
    yield from _walk_module(root, "", seen)


def _walk_module(module: nn.Module, prefix: str, seen: set[int]) -> Iterator[UnitCandidate]:
    for name, child in module.named_children():
        if id(child) in seen:
            continue
        seen.add(id(child))
        fqn = join_fqn(prefix, name)
        if is_container(child):
            yield from _walk_container(child, fqn, seen)
        else:
            yield from _walk_module(child, fqn, seen)


def _walk_container(container: nn.Module, prefix: str, seen: set[int]) -> Iterator[UnitCandidate]:
    items = list(container.named_children())
    for index, (name, element) in enumerate(items):
        if id(element) in seen:
            continue
        seen.add(id(element))
        fqn = join_fqn(prefix, name)
        if is_container(element):
            yield from _walk_container(element, fqn, seen)
        else:
            yield UnitCandidate(fqn, element, container, name, index == len(items) - 1)


def owning_prefix(fqn: str, prefixes: list[str]) -> str:
    """Return the longest of ``prefixes`` that is ``fqn`` or a dotted ancestor of it, else ``""``."""
    best = ""
    for prefix in prefixes:
        if (fqn == prefix or fqn.startswith(prefix + ".")) and len(prefix) > len(best):
            best = prefix
    return best
