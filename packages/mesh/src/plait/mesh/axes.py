"""Names of device-mesh axes and their validation."""

from __future__ import annotations

from collections.abc import Iterable
from enum import StrEnum

__all__ = ["MeshAxisName", "validate_axis_names"]


class MeshAxisName(StrEnum):
    """Every axis name a plait device mesh may use; members compare equal to plain strings."""

    PP = "pp"
    """Pipeline-parallel stages."""
    DP = "dp"
    """All data-parallel ranks: flattened ``(dp_replicate, dp_shard)``, used for data loading."""
    DP_REPLICATE = "dp_replicate"
    """Replicas of the model (the outer, replicated axis of HSDP)."""
    DP_SHARD = "dp_shard"
    """Ranks that shard parameters with FSDP (the inner axis of HSDP)."""
    DP_SHARD_CP = "dp_shard_cp"
    """Flattened ``(dp_shard, cp)``: the axis FSDP shards over when context parallel is on."""
    DP_CP = "dp_cp"
    """Flattened ``(dp_replicate, dp_shard, cp)``: ranks that reduce the loss together."""
    CP = "cp"
    """Context-parallel ranks (sequence split across ranks inside attention)."""
    TP = "tp"
    """Tensor-parallel ranks."""
    EP = "ep"
    """Expert-parallel ranks (inner axis of the MoE mesh)."""
    EP_SHARD = "ep_shard"
    """Ranks that shard each expert's parameters with FSDP (outer axis of the MoE mesh)."""


_ALLOWED: frozenset[str] = frozenset(m.value for m in MeshAxisName)


def validate_axis_names(names: Iterable[str] | None, *, what: str = "device mesh") -> tuple[str, ...]:
    """Return ``names`` as a tuple after checking each is a :class:`MeshAxisName`.

    Args:
        names: the ``mesh_dim_names`` of a mesh.
        what: how to call the mesh in the error message.

    Raises:
        ValueError: the mesh has no dim names, repeats one, or uses a name outside :class:`MeshAxisName`.
    """
    if not names:
        raise ValueError(
            f"{what} has no mesh_dim_names; name its dims with MeshAxisName values, e.g. "
            f"init_device_mesh(..., mesh_dim_names=('dp_shard', 'tp'))"
        )
    names = tuple(str(n) for n in names)
    unknown = [n for n in names if n not in _ALLOWED]
    if unknown:
        raise ValueError(f"{what} has unknown dim name(s) {unknown}; allowed names: {sorted(_ALLOWED)}")
    if len(set(names)) != len(names):
        raise ValueError(f"{what} repeats a dim name in {list(names)}; each axis may appear once")
    return names
