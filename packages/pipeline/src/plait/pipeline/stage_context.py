"""What one stage is parallelized with: the mesh without ``pp``, FSDP's PP rules, the stage's TP plan."""

from __future__ import annotations

import dataclasses
from fnmatch import fnmatchcase

from torch import nn

from plait.mesh import FSDP2Config, MeshContext
from plait.pipeline.split import PrunedModule
from plait.sidecar import ModelParallelizer
from plait.tp import resolve_tp_plan

__all__ = ["check_context", "plan_for_stage", "stage_context", "stage_tp_plan"]


def check_context(mesh_context: MeshContext) -> FSDP2Config:
    """Refuse strategies and axes a pipeline cannot run; return the FSDP2 config."""
    config = mesh_context.strategy_config
    if not isinstance(config, FSDP2Config):
        raise TypeError(
            f"pipeline parallel runs each stage with FSDP2Config, got {type(config).__name__}; DDP and "
            "Megatron-FSDP do not compose with pipeline stages here. Use MeshContext.build(FSDP2Config(), "
            "ParallelismSizes(pp_size=...))."
        )
    if mesh_context.device_mesh is None or mesh_context.pp_size < 2:
        raise ValueError(
            f"pipeline_model needs a device mesh with a 'pp' axis of size >= 2, got pp_size="
            f"{mesh_context.pp_size}; for pp_size=1 use plait.sidecar.parallelize_model."
        )
    if mesh_context.cp_size > 1:
        raise ValueError(
            f"pipeline parallel with context parallel (cp_size={mesh_context.cp_size}) is not supported; "
            "set cp_size=1 or pp_size=1."
        )
    return config


def stage_tp_plan(
    model: nn.Module, sidecar: ModelParallelizer, config: FSDP2Config, tp_size: int
) -> dict[str, object]:
    """Resolve the TP plan on the whole model, as ``parallelize_model`` would (before the split)."""
    return dict(
        resolve_tp_plan(
            model,
            plan=config.tp_plan,
            sequence_parallel=config.sequence_parallel,
            tp_size=tp_size,
            model_plan=sidecar.tp_plan,
            finalize=sidecar._finalize_tp_plan,
        )
    )


def plan_for_stage(plan: dict[str, object], stage: nn.Module) -> dict[str, object]:
    """The plan's entries that match a module this stage really holds (not a `PrunedModule`)."""
    held = [fqn for fqn, m in stage.named_modules() if fqn and not isinstance(m, PrunedModule)]
    return {pattern: style for pattern, style in plan.items() if any(fnmatchcase(f, pattern) for f in held)}


def stage_context(
    mesh_context: MeshContext, config: FSDP2Config, tp_plan: dict[str, object] | None
) -> MeshContext:
    """The context a stage is parallelized with: the mesh without ``pp`` and the FSDP rules for PP.

    Under PP each microbatch runs forward and, later, backward through the stage: resharding after
    forward would all-gather every unit again per microbatch, so units keep their gathered
    parameters unless the config sets ``reshard_after_forward`` explicitly. Collective: every rank
    calls it (the flattened data-parallel views of the sub-mesh are created).
    """
    mesh = mesh_context.device_mesh
    assert mesh is not None
    names = tuple(n for n in mesh.mesh_dim_names if n != "pp")
    changes: dict[str, object] = {}
    if config.reshard_after_forward is None:
        changes["reshard_after_forward"] = False
    if tp_plan is not None:
        changes["tp_plan"] = tp_plan
    return MeshContext.from_meshes(
        mesh[names],
        mesh_context.moe_mesh,
        strategy_config=dataclasses.replace(config, **changes) if changes else config,
        moe_config=mesh_context.moe_config,
        activation_checkpointing=mesh_context.activation_checkpointing,
        reapply_trainability=mesh_context.reapply_trainability,
    )
