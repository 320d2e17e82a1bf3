"""Optional per-layer ``torch.compile`` after parallelization, keeping state-dict keys unchanged."""

from __future__ import annotations

from torch import nn

from plait.mesh import FSDP2Config, MeshContext
from plait.sharding import discover_layer_groups
from plait.sidecar.resolution import get_model_parallelizer

__all__ = ["compile_parallelized_model"]


def compile_parallelized_model(model: nn.Module, mesh_context: MeshContext) -> None:
    """Compile each transformer layer in place when FSDP2 compile (or async TP) was requested.

    A no-op for other strategies, without a device mesh, or when neither ``enable_compile`` nor
    async TP (with tp > 1) is set. Each layer found by `plait.sharding.discover_layer_groups` (with
    the model's sidecar ``layer_group_paths``) gets ``layer.compile()``: the module object stays in
    place, so state-dict keys carry no ``_orig_mod.`` prefix, and activation-checkpoint wrappers and
    FSDP hooks keep working.
    """
    config = mesh_context.strategy_config
    if not isinstance(config, FSDP2Config) or mesh_context.device_mesh is None:
        return
    async_tp = config.enable_async_tensor_parallel and mesh_context.tp_size > 1
    if not (config.enable_compile or async_tp):
        return
    for group in discover_layer_groups(model, get_model_parallelizer(model).layer_group_paths):
        for layer in group.layers:
            layer.compile()
