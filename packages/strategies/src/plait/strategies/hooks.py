"""The sidecar hooks the strategies call, as a Protocol (``plait.sidecar`` sits above this package)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

if TYPE_CHECKING:
    from plait.mesh import MeshContext
    from plait.sharding import LayerGroup

__all__ = ["SidecarHooks"]


class SidecarHooks(Protocol):
    """What a strategy needs of a ``plait.sidecar.ModelParallelizer``: its TP and checkpointing hooks."""

    tp_plan: Any
    layer_group_paths: Any

    def _validate_tp_mesh(self, model: nn.Module, tp_mesh: DeviceMesh) -> None: ...

    def _finalize_tp_plan(self, model: nn.Module, plan: Any) -> Any: ...

    def _checkpoint_activations(
        self, model: nn.Module, groups: list[LayerGroup], mesh_context: MeshContext
    ) -> int: ...
