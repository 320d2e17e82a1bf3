"""The sidecar hooks the strategies call, as a Protocol (``plait.sidecar`` sits above this package)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from torch import nn

if TYPE_CHECKING:
    from plait.mesh import MeshContext
    from plait.sharding import LayerGroup

__all__ = ["SidecarHooks"]


class SidecarHooks(Protocol):
    """What a strategy needs of a ``plait.sidecar.ModelParallelizer``: its checkpointing hook.

    Everything else (the TP plan, the layer groups) the strategies get from the plan.
    """

    def _checkpoint_activations(
        self, model: nn.Module, groups: list[LayerGroup], mesh_context: MeshContext
    ) -> int: ...
