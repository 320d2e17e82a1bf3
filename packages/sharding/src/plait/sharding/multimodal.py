"""Multimodal towers and projectors: discovery, frozen detection and the three sharding policies."""

from __future__ import annotations

import warnings

from torch import nn

from plait.mesh import normalize_frozen_multimodal_sharding
from plait.sharding._walk import owning_prefix

TOWER_NAMES: frozenset[str] = frozenset(
    {
        "visual",
        "vision",
        "vision_tower",
        "vision_model",
        "vit_model",
        "image_encoder",
        "vision_encoder",
        "audio_tower",
        "audio_encoder",
        "audio_model",
    }
)
"""Attribute names that mark a vision or audio tower."""

PROJECTOR_NAMES: frozenset[str] = frozenset(
    {
        "mm_projector",
        "multi_modal_projector",
        "multimodal_projector",
        "vision_projector",
        "audio_projector",
        "aligner",
        "embed_vision",
        "embed_audio",
    }
)
"""Attribute names that mark a multimodal projector."""


def find_multimodal_modules(model: nn.Module) -> dict[str, nn.Module]:
    """Return the multimodal towers and projectors of ``model`` by attribute name, keyed by FQN.

    Selection is maximal: nothing is selected again inside an already selected module.
    """
    found: dict[str, nn.Module] = {}
    for fqn, module in model.named_modules():
        if not fqn or owning_prefix(fqn, list(found)):
            continue
        if fqn.rsplit(".", 1)[-1] in TOWER_NAMES | PROJECTOR_NAMES:
            found[fqn] = module
    return found


def find_frozen_multimodal_modules(model: nn.Module) -> dict[str, nn.Module]:
    """Return the multimodal modules of ``model`` that have parameters and none requiring grad."""
    frozen: dict[str, nn.Module] = {}
    for fqn, module in find_multimodal_modules(model).items():
        params = list(module.parameters())
        if params and not any(p.requires_grad for p in params):
            frozen[fqn] = module
    return frozen


def frozen_multimodal_ignored_params(frozen: dict[str, nn.Module], policy: str) -> set[nn.Parameter]:
    """Return the parameters every FSDP unit must ignore: all of ``frozen``'s under ``replicate``, else none."""
    if normalize_frozen_multimodal_sharding(policy) != "replicate":
        return set()
    return {p for module in frozen.values() for p in module.parameters()}


def frozen_modules_to_skip(frozen: dict[str, nn.Module], policy: str) -> list[nn.Module]:
    """Return the frozen modules unit selection must not walk into under ``policy``.

    ``root`` and ``replicate`` keep frozen towers out of per-layer units; ``per_layer`` shards them
    like everything else and warns, because every rank must then run them in the same order each step.
    """
    value = normalize_frozen_multimodal_sharding(policy)
    if value == "per_layer":
        if frozen:
            warnings.warn(
                f"frozen_multimodal_sharding='per_layer' shards the frozen modules {sorted(frozen)} per layer: "
                "every rank must run them in the same order every step, or the job can hang. Use 'root' "
                "(default) when ranks may see different modalities in one step.",
                UserWarning,
                stacklevel=3,
            )
        return []
    return list(frozen.values())
