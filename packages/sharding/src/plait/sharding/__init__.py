"""FSDP2 units, prefetch, embeddings, frozen multimodal towers and activation checkpointing."""

from plait.sharding._walk import UnitCandidate
from plait.sharding.checkpointing import SUBMODULE_ROLES, apply_activation_checkpointing
from plait.sharding.embeddings import (
    fully_shard_untied_embeddings,
    guard_tied_embeddings,
    tied_parameter_groups,
)
from plait.sharding.layer_groups import LayerGroup, classify_path, discover_layer_groups
from plait.sharding.multimodal import (
    PROJECTOR_NAMES,
    TOWER_NAMES,
    find_frozen_multimodal_modules,
    find_multimodal_modules,
    frozen_multimodal_ignored_params,
)
from plait.sharding.prefetch import wire_fsdp_prefetch
from plait.sharding.selective import selective_context_fn, selective_policy
from plait.sharding.units import apply_fsdp_sharding, fully_shard_root, select_fsdp_units

__all__ = [
    "PROJECTOR_NAMES",
    "SUBMODULE_ROLES",
    "TOWER_NAMES",
    "LayerGroup",
    "UnitCandidate",
    "apply_activation_checkpointing",
    "apply_fsdp_sharding",
    "classify_path",
    "discover_layer_groups",
    "find_frozen_multimodal_modules",
    "find_multimodal_modules",
    "frozen_multimodal_ignored_params",
    "fully_shard_root",
    "fully_shard_untied_embeddings",
    "guard_tied_embeddings",
    "select_fsdp_units",
    "selective_context_fn",
    "selective_policy",
    "tied_parameter_groups",
    "wire_fsdp_prefetch",
]
