"""Per-layer ``torch.compile``, the last step of the flow, keeping state-dict keys unchanged."""

from __future__ import annotations

from typing import Any

from torch import nn

from plait.mesh import MeshContext
from plait.sharding import discover_layer_groups

__all__ = ["compile_layers", "compile_parallelized_model"]


def compile_layers(model: nn.Module, layer_group_paths: Any = None) -> int:
    """Compile each transformer layer in place (``layer.compile()``); return how many were compiled now.

    The layers are those `plait.sharding.discover_layer_groups` finds (after checkpointing, the
    checkpoint wrappers): the module objects stay in place, so state-dict keys carry no
    ``_orig_mod.`` prefix, and activation-checkpoint wrappers and FSDP hooks keep working. A layer
    compiled already is left as it is.
    """
    count = 0
    for group in discover_layer_groups(model, layer_group_paths):
        for layer in group.layers:
            if getattr(layer, "_compiled_call_impl", None) is None:
                layer.compile()
                count += 1
    return count


def compile_parallelized_model(model: nn.Module, mesh_context: MeshContext) -> None:
    """Compile the layers of a parallelized model when its plan asks for compile (else a no-op).

    `parallelize_model` compiles as the last step of its flow, so calling this afterwards changes
    nothing; it remains for code that parallelized without compile and decides later. Whether
    compile applies is the plan's decision (`FSDP2Config.enable_compile`, or async TP with tp > 1).
    """
    from plait.sidecar.plan import compile_requested
    from plait.sidecar.resolution import get_model_parallelizer

    if compile_requested(mesh_context):
        compile_layers(model, get_model_parallelizer(model).layer_group_paths)
