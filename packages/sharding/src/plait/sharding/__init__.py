"""FSDP2 units, prefetch, embeddings, frozen multimodal towers and activation checkpointing."""

from plait.sharding._walk import UnitCandidate
from plait.sharding.checkpointing import SUBMODULE_ROLES, apply_activation_checkpointing
from plait.sharding.embeddings import (
    fully_shard_untied_embeddings,
    guard_tied_embeddings,
    plan_untied_embedding_units,
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
from plait.sharding.unit_policy import FSDPUnit, UnitRole, unit_reshard_after_forward
from plait.sharding.units import apply_fsdp_sharding, fully_shard_root, plan_layer_units, select_fsdp_units

__all__ = [
    "FSDPUnit",
    "UnitRole",
    "plan_layer_units",
    "plan_untied_embedding_units",
    "unit_reshard_after_forward",
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
    "tied_parameter_groups",
    "wire_fsdp_prefetch",
]
