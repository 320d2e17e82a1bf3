"""What one stage is parallelized with: the mesh without ``pp`` (its plan comes from the whole model's)."""

from __future__ import annotations

from plait.mesh import FSDP2Config, MeshContext

__all__ = ["check_context", "stage_context"]


def check_context(mesh_context: MeshContext) -> FSDP2Config:
    """Refuse a context without a ``pp`` axis of size >= 2; return the FSDP2 config.

    Strategies and axes that do not combine with pipeline stages are refused by the combination
    table (``plait.mesh``), through the whole model's plan.
    """
    if mesh_context.device_mesh is None or mesh_context.pp_size < 2:
        raise ValueError(
            f"pipeline_model needs a device mesh with a 'pp' axis of size >= 2, got pp_size="
            f"{mesh_context.pp_size}; for pp_size=1 use plait.sidecar.parallelize_model."
        )
    return mesh_context.strategy_config


def stage_context(mesh_context: MeshContext) -> MeshContext:
    """The context a stage is parallelized with: the same configs on the mesh without ``pp``.

    Collective: every rank calls it (the flattened data-parallel views of the sub-mesh are created).
    The stage's own rules (no reshard after forward, the whole model's TP plan) come from its plan.
    """
    mesh = mesh_context.device_mesh
    assert mesh is not None
    names = tuple(n for n in mesh.mesh_dim_names if n != "pp")
    return MeshContext.from_meshes(
        mesh[names],
        mesh_context.moe_mesh,
        strategy_config=mesh_context.strategy_config,
        moe_config=mesh_context.moe_config,
        activation_checkpointing=mesh_context.activation_checkpointing,
        reapply_trainability=mesh_context.reapply_trainability,
    )
