"""Strategy dispatch for one sidecar: FSDP2 (sharded, unsharded or with experts), DDP or Megatron-FSDP."""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from plait.cp import check_context_parallel_support
from plait.mesh import DDPConfig, FSDP2Config, MegatronFSDPConfig
from plait.sharding import discover_layer_groups
from plait.strategies import check_expert_parallel, parallelize_ddp, parallelize_megatron_fsdp

if TYPE_CHECKING:
    from plait.mesh import MeshContext
    from plait.sidecar.parallelizer import ModelParallelizer


def _apply_model_parallelizer(
    parallelizer: ModelParallelizer, model: nn.Module, mesh_context: MeshContext
) -> nn.Module:
    """Run the strategy ``mesh_context`` asks for, with ``parallelizer``'s hooks; return the model."""
    _refuse_pipeline_parallel(mesh_context)
    config = mesh_context.strategy_config
    check_context_parallel_support(mesh_context)  # cp > 1 only where the cp step runs
    if mesh_context.ep_size > 1:
        check_expert_parallel(model, mesh_context)  # FSDP2 only: refuse DDP / Megatron-FSDP here
        return parallelizer._apply(model, mesh_context)
    if isinstance(config, FSDP2Config):
        return _parallelize_fsdp2(model, mesh_context, parallelizer)
    if isinstance(config, DDPConfig):
        return parallelize_ddp(model, mesh_context, parallelizer)
    if isinstance(config, MegatronFSDPConfig):
        return parallelize_megatron_fsdp(model, mesh_context, parallelizer)
    raise TypeError(
        f"parallelize_model does not support strategy_config={config!r} ({type(config).__name__}); "
        "use FSDP2Config, DDPConfig or MegatronFSDPConfig from plait.mesh."
    )


def _refuse_pipeline_parallel(mesh_context: MeshContext) -> None:
    """A pp axis > 1 needs the model split into stages, which this flow does not do (plait-pipeline does)."""
    if mesh_context.pp_size > 1:
        raise ValueError(
            f"pp_size={mesh_context.pp_size}: parallelize_model does not split a model into pipeline stages; "
            "call plait.pipeline.pipeline_model(model, mesh_context, loss_fn) (package plait-pipeline), "
            "which runs this flow on each stage."
        )


def _parallelize_fsdp2(
    model: nn.Module, mesh_context: MeshContext, parallelizer: ModelParallelizer
) -> nn.Module:
    if mesh_context.device_mesh is None:
        raise ValueError(
            "FSDP2 needs mesh_context.device_mesh, got None; build the context with "
            "MeshContext.build(FSDP2Config(...), sizes) or MeshContext.from_meshes(device_mesh)."
        )
    if mesh_context.fsdp_mesh().size() == 1 and mesh_context.tp_size == 1:
        return _parallelize_unsharded_fsdp2(model, mesh_context, parallelizer)
    return parallelizer._apply(model, mesh_context)


def _parallelize_unsharded_fsdp2(
    model: nn.Module, mesh_context: MeshContext, parallelizer: ModelParallelizer
) -> nn.Module:
    """One data-parallel rank and no TP: nothing to shard, so only checkpointing and trainability."""
    if mesh_context.activation_checkpointing:
        groups = discover_layer_groups(model, parallelizer.layer_group_paths)
        parallelizer._checkpoint_activations(model, groups, mesh_context)
    if mesh_context.reapply_trainability is not None:
        mesh_context.reapply_trainability(model)
    return model
