"""A minimal stand-in for the sidecar's hooks (plait.sidecar sits above plait.strategies)."""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from plait.mesh import MeshContext
from plait.sharding import LayerGroup, apply_activation_checkpointing
from plait.tp import validate_tp_mesh


class Hooks:
    """The shared flow's defaults: no plan factory, structural layer discovery, per-submodule AC."""

    tp_plan: Any = None
    layer_group_paths: Any = None

    def _validate_tp_mesh(self, model: nn.Module, tp_mesh: DeviceMesh) -> None:
        validate_tp_mesh(model, tp_mesh.size())

    def _finalize_tp_plan(self, model: nn.Module, plan: Any) -> Any:
        return plan

    def _checkpoint_activations(
        self, model: nn.Module, groups: list[LayerGroup], mesh_context: MeshContext
    ) -> int:
        return apply_activation_checkpointing(
            model,
            groups,
            mode=mesh_context.activation_checkpointing,
            scope=mesh_context.strategy_config.activation_checkpointing_scope,
        )
