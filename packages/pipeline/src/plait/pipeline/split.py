"""Split a decoder at layer boundaries: find its parts, balance layers over stages, prune one stage.

A supported decoder has one language layer container (``model.layers``), an input embedding before
it, and a final norm plus an output head after it (the layout of Hugging Face causal LMs and of
plait's reference models). A stage is a copy of the model's module tree that shares the parameter
tensors with the original, keeps only its own layers (under their original indices, so state-dict
keys stay the full model's), and holds a parameter-free pass-through (`PrunedModule`) in place of
the embedding, norm and head it does not own; the model's own ``forward`` then runs unchanged.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Any

import torch
from torch import nn

from plait.sharding import discover_layer_groups, tied_parameter_groups

__all__ = [
    "stage_tp_entries",
    "DecoderParts",
    "PrunedModule",
    "StageSpec",
    "StageUnion",
    "build_stage_module",
    "check_untied_across_stages",
    "find_decoder_parts",
    "plan_stages",
]

_NORM_NAMES = ("norm", "final_layernorm", "final_layer_norm", "ln_f", "norm_f")
_HEAD_NAMES = ("lm_head", "output", "head")


class PrunedModule(nn.Module):
    """Stands in for a module that lives on another stage: passes its input through, holds nothing."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # A view (e.g. HF's logits_to_keep slice before the head) cannot be a stage output: the
        # zero-bubble schedules detach stage outputs in place, which views refuse.
        return x.clone() if x._is_view() else x


@dataclass(frozen=True)
class DecoderParts:
    """Module paths of the pieces a stage split needs (FQNs inside the model)."""

    layers: str
    """The layer container, e.g. ``model.layers``."""
    embedding: str
    """The input embedding, first stage only."""
    norm: str | None
    """The final norm (last stage), or None when the model has none."""
    head: str
    """The output head (last stage)."""


@dataclass(frozen=True)
class StageSpec:
    """One pipeline stage: its index and the original indices of the layers it runs."""

    index: int
    layers: tuple[int, ...]


def _fqn_of(model: nn.Module, target: nn.Module | None) -> str | None:
    if target is None:
        return None
    return next((name for name, m in model.named_modules() if m is target and name), None)


def _find_named(parent_fqn: str, parent: nn.Module, names: tuple[str, ...]) -> str | None:
    for name in names:
        if isinstance(getattr(parent, name, None), nn.Module):
            return f"{parent_fqn}.{name}" if parent_fqn else name
    return None


def find_decoder_parts(model: nn.Module, layer_group_paths: object = None) -> DecoderParts:
    """Locate the layer container, input embedding, final norm and output head of ``model``.

    Raises:
        ValueError: when there is not exactly one language layer container, no input embedding or
            output head, or a module with parameters that no stage would own (e.g. a vision tower).
    """
    groups = [g for g in discover_layer_groups(model, layer_group_paths) if g.kind == "language"]
    if len(groups) != 1 or len(groups[0].layers) == 0:
        raise ValueError(
            f"pipeline_model needs exactly one non-empty language layer container in "
            f"{type(model).__name__}, found {[g.path for g in groups]}; multimodal or encoder-decoder "
            "models are not supported by the pipeline split."
        )
    layers = groups[0].path
    parent_fqn = layers.rpartition(".")[0]
    parent = model.get_submodule(parent_fqn)
    getter = getattr(model, "get_input_embeddings", None)
    embedding = _fqn_of(model, getter() if callable(getter) else None)
    if embedding is None:
        embedding = next(
            (
                f"{parent_fqn}.{n}".lstrip(".")
                for n, c in parent.named_children()
                if isinstance(c, nn.Embedding)
            ),
            None,
        )
    getter = getattr(model, "get_output_embeddings", None)
    head = _fqn_of(model, getter() if callable(getter) else None) or _find_named("", model, _HEAD_NAMES)
    if embedding is None or head is None:
        raise ValueError(
            f"pipeline_model found no input embedding ({embedding}) or output head ({head}) in "
            f"{type(model).__name__}; define get_input_embeddings()/get_output_embeddings()."
        )
    parts = DecoderParts(layers, embedding, _find_named(parent_fqn, parent, _NORM_NAMES), head)
    _check_every_parameter_owned(model, parts)
    return parts


def _check_every_parameter_owned(model: nn.Module, parts: DecoderParts) -> None:
    owned = tuple(p for p in (parts.layers, parts.embedding, parts.norm, parts.head) if p)
    orphans = sorted(
        name for name, _ in model.named_parameters() if not any(name.startswith(o + ".") for o in owned)
    )
    if orphans:
        raise ValueError(
            f"pipeline_model cannot place parameters {orphans[:4]} of {type(model).__name__}: only the "
            f"embedding ({parts.embedding}), the layers ({parts.layers}), the final norm ({parts.norm}) "
            f"and the head ({parts.head}) are assigned to stages."
        )


def _param_count(module: nn.Module | None) -> int:
    return 0 if module is None else sum(p.numel() for p in module.parameters())


def _balanced_counts(costs: list[int], first: int, last: int, num_stages: int) -> list[int]:
    """Layers per stage minimising the largest stage's parameters (embedding on 0, norm+head on the last)."""
    n = len(costs)
    prefix = [0]
    for c in costs:
        prefix.append(prefix[-1] + c)

    def fits(limit: int) -> list[int] | None:
        counts, start = [], 0
        for s in range(num_stages):
            extra = (first if s == 0 else 0) + (last if s == num_stages - 1 else 0)
            remaining_stages = num_stages - s - 1
            end = start + 1
            if prefix[end] - prefix[start] + extra > limit:
                return None
            while end < n - remaining_stages and prefix[end + 1] - prefix[start] + extra <= limit:
                end += 1
            if s == num_stages - 1 and end != n:
                return None
            counts.append(end - start)
            start = end
        return counts

    lo, hi = 0, prefix[-1] + first + last
    best = fits(hi)
    while lo < hi:
        mid = (lo + hi) // 2
        found = fits(mid)
        if found is None:
            lo = mid + 1
        else:
            best, hi = found, mid
    assert best is not None
    return best


def plan_stages(
    model: nn.Module, parts: DecoderParts, num_stages: int, layers_per_stage: list[int] | None = None
) -> list[StageSpec]:
    """Assign consecutive layers to ``num_stages`` stages.

    Default: balanced by parameter count (the embedding counted on the first stage, norm and head
    on the last), every stage at least one layer. ``layers_per_stage`` sets the counts explicitly.

    Raises:
        ValueError: more stages than layers, or ``layers_per_stage`` of the wrong length/sum.
    """
    container = model.get_submodule(parts.layers)
    n = len(container)
    if num_stages > n:
        raise ValueError(
            f"{num_stages} pipeline stages but {type(model).__name__} has only {n} layers; use at most "
            f"{n} stages (pp_size x stages_per_rank)."
        )
    if layers_per_stage is not None:
        if len(layers_per_stage) != num_stages or sum(layers_per_stage) != n or min(layers_per_stage) < 1:
            raise ValueError(
                f"layers_per_stage={layers_per_stage} must list {num_stages} positive counts summing "
                f"to the model's {n} layers."
            )
        counts = list(layers_per_stage)
    else:
        costs = [_param_count(layer) for layer in container]
        first = _param_count(model.get_submodule(parts.embedding))
        last = _param_count(model.get_submodule(parts.head)) + (
            _param_count(model.get_submodule(parts.norm)) if parts.norm else 0
        )
        counts = _balanced_counts(costs, first, last, num_stages)
    specs, start = [], 0
    for index, count in enumerate(counts):
        specs.append(StageSpec(index, tuple(range(start, start + count))))
        start += count
    return specs


def check_untied_across_stages(model: nn.Module, parts: DecoderParts) -> None:
    """Refuse input/output embeddings that share a parameter: they would live on two stages."""
    for names in tied_parameter_groups(model):
        in_embed = any(n.startswith(parts.embedding + ".") for n in names)
        in_head = any(n.startswith(parts.head + ".") for n in names)
        if in_embed and in_head:
            raise ValueError(
                f"{type(model).__name__} ties its input embedding and output head ({sorted(names)}); under "
                "pipeline parallel they sit on the first and the last stage, which is not supported. "
                "Untie them (e.g. config.tie_word_embeddings=False) or use pp_size=1."
            )


def build_stage_module(model: nn.Module, parts: DecoderParts, spec: StageSpec, num_stages: int) -> nn.Module:
    """Return ``model`` pruned to ``spec``: a module tree copy sharing parameters, buffers and configs with ``model``.

    Layers keep their original index as their name inside the container; the embedding (unless
    first), final norm and head (unless last) become `PrunedModule`.
    """
    memo: dict[int, object] = {id(t): t for t in (*model.parameters(), *model.buffers())}
    # One config per model: the kept layers are the originals, so a copied config would leave their
    # modules reading another object than the stage's (an attention switch on the stage missed them).
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is not None and not isinstance(config, nn.Module | torch.Tensor):
            memo[id(config)] = config
    container = model.get_submodule(parts.layers)
    for layer in container:
        memo.setdefault(id(layer), None)
    kept = {str(i): container[i] for i in spec.layers}
    # Leave the layers out of the copy (memo maps them to None), then put back only this stage's.
    stage = copy.deepcopy(model, memo)
    local = type(container)() if isinstance(container, nn.ModuleList) else nn.ModuleDict()
    for key, layer in kept.items():
        local.add_module(key, layer)
    stage.set_submodule(parts.layers, local)
    if spec.index != 0:
        stage.set_submodule(parts.embedding, PrunedModule())
    if spec.index != num_stages - 1:
        stage.set_submodule(parts.head, PrunedModule())
        if parts.norm:
            stage.set_submodule(parts.norm, PrunedModule())
    return stage


class StageUnion(nn.Module):
    """One rank's stages as one module under the full model's names, sharing their submodules.

    Holds the local layers and whichever of embedding, norm and head a local stage owns, at their
    original paths; nothing else. For ``torch.distributed.checkpoint``'s model/optimizer state-dict
    helpers, which take one module: its state-dict keys are the union of the local stages' keys.
    """

    def __init__(self, stages: list[nn.Module], parts: DecoderParts) -> None:
        super().__init__()
        for stage in stages:
            layers = stage.get_submodule(parts.layers)
            for key, layer in layers.named_children():
                self._place(f"{parts.layers}.{key}", layer)
            for path in (parts.embedding, parts.norm, parts.head):
                module = stage.get_submodule(path) if path else None
                if module is not None and not isinstance(module, PrunedModule):
                    self._place(path, module)

    def _place(self, path: str, module: nn.Module) -> None:
        parent: nn.Module = self
        *heads, leaf = path.split(".")
        for name in heads:
            child = getattr(parent, name, None)
            if child is None:
                child = nn.Module()
                parent.add_module(name, child)
            parent = child
        parent.add_module(leaf, module)

    def forward(self, *args: object, **kwargs: object) -> None:
        raise TypeError("StageUnion holds the local stages' state only; run the pipeline with Pipeline.step")


def stage_tp_entries(plan: Mapping[str, Any], stage: nn.Module) -> dict[str, Any]:
    """The entries of the whole model's TP plan that match a module this stage really holds."""
    held = [fqn for fqn, m in stage.named_modules() if fqn and not isinstance(m, PrunedModule)]
    return {pattern: style for pattern, style in plan.items() if any(fnmatchcase(f, pattern) for f in held)}
