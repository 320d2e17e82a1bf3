"""`plan_parallelism`: every decision of the flow, made once, before any collective — the `ParallelPlan`.

The plan says which techniques apply (each from one gate here), refuses every combination the
combination table in `plait.mesh` does not build, resolves the TP plan once (with its source), finds
the linears float8 converts, the layer groups, the MoE blocks and the frozen towers, and lists the
FSDP units in creation order, each with its `plait.sharding.unit_reshard_after_forward` value. `ModelParallelizer._apply` only applies it; the
trainer's ``validate`` and ``plan`` build the same object on meta tensors and a fake process group.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from torch import nn

from plait.cp import check_context_parallel_model, cp_attention_choice, cp_gathered_modules
from plait.float8 import float8_tp_plan, plan_float8
from plait.mesh import FSDP2Config, MeshContext, check_combination, context_request, strategy_name
from plait.sharding import (
    FSDPUnit,
    discover_layer_groups,
    find_frozen_multimodal_modules,
    find_multimodal_modules,
    frozen_multimodal_ignored_params,
    plan_layer_units,
    plan_untied_embedding_units,
    unit_reshard_after_forward,
)
from plait.sidecar.parallel_plan import ParallelPlan
from plait.strategies import (
    MoEBlockInfo,
    check_expert_parallel,
    check_megatron_fsdp,
    moe_head,
    moe_reshard_after_forward,
    replays_ops_in_layers,
    routers_to_save,
    validate_moe_tp_plan,
    wraps_root,
)
from plait.tp import resolve_tp_plan

if TYPE_CHECKING:
    from plait.sidecar.parallelizer import ModelParallelizer

__all__ = ["compile_requested", "model_features", "plan_parallelism"]

_MODEL_DEFAULT_SOURCES = frozenset({"Hugging Face plan", "default Llama-style plan"})


def model_features(model: nn.Module) -> list[str]:
    """The model features the combination table reads: ``moe`` (an experts block), ``multimodal`` (a tower)."""
    found = []
    if any(isinstance(getattr(m, "experts", None), nn.Module) for m in model.modules()):
        found.append("moe")
    if find_multimodal_modules(model):
        found.append("multimodal")
    return found


def plan_parallelism(
    model: nn.Module,
    mesh_context: MeshContext,
    sidecar: ModelParallelizer | None = None,
    *,
    stage_of: ParallelPlan | None = None,
) -> ParallelPlan:
    """Decide everything `parallelize_model` will do to ``model``; change nothing, call no collective.

    Args:
        model: The plain model (or one pipeline stage of it).
        mesh_context: The meshes and configs.
        sidecar: The model's sidecar; default `get_model_parallelizer(model)`.
        stage_of: When ``model`` is one pipeline stage, the whole model's plan with its TP plan
            already cut to the modules the stage holds (the pipeline knows which); it is used as
            is, never resolved again.

    Raises:
        ValueError / TypeError: every refusal of the flow, naming the setting and the fix.
    """
    if sidecar is None:
        from plait.sidecar.resolution import get_model_parallelizer

        sidecar = get_model_parallelizer(model)
    strategy = strategy_name(mesh_context.strategy_config)
    check_combination(context_request(mesh_context, features=model_features(model)))
    if strategy != "ddp" and mesh_context.device_mesh is None:
        raise ValueError(
            f"{strategy} needs mesh_context.device_mesh, got None; build the context with "
            "MeshContext.build(config, sizes) or MeshContext.from_meshes(device_mesh)."
        )
    if strategy == "megatron_fsdp":
        check_megatron_fsdp(model, mesh_context)
    blocks = tuple(check_expert_parallel(model, mesh_context))
    plan = ParallelPlan(
        strategy=strategy,
        sizes=_sizes(mesh_context),
        pipeline_stage=stage_of is not None,
        moe_blocks=blocks,
        **_tp_decisions(model, mesh_context, sidecar, blocks, stage_of),
        **_cp_decisions(model, mesh_context),
        **_ac_decisions(model, mesh_context, sidecar, blocks),
    )
    plan = dataclasses.replace(plan, **_float8_decisions(model, mesh_context, plan))
    if strategy == "fsdp2":
        with _trainability_restored(model, mesh_context):  # the FSDP step runs after trainability
            plan = dataclasses.replace(plan, **_fsdp_decisions(model, mesh_context, plan))
    return sidecar._adjust_plan(model, mesh_context, plan)


def compile_requested(mesh_context: MeshContext) -> bool:
    """Whether the flow compiles the layers: FSDP2 with ``enable_compile``, or async TP at tp > 1."""
    cfg = mesh_context.strategy_config
    if not isinstance(cfg, FSDP2Config) or mesh_context.device_mesh is None:
        return False
    return cfg.enable_compile or (cfg.enable_async_tensor_parallel and mesh_context.tp_size > 1)


def _sizes(mesh_context: MeshContext) -> tuple[tuple[str, int], ...]:
    sizes: dict[str, int] = {}
    for mesh in [m for m in (mesh_context.device_mesh, mesh_context.moe_mesh) if m is not None]:
        for name, size in zip(mesh.mesh_dim_names or (), mesh.mesh.shape, strict=True):
            if size > 1:
                sizes.setdefault(name, int(size))
    return tuple(sizes.items())


def _tp_decisions(
    model: nn.Module,
    mesh_context: MeshContext,
    sidecar: ModelParallelizer,
    blocks: tuple[MoEBlockInfo, ...],
    stage_of: ParallelPlan | None,
) -> dict[str, Any]:
    """The TP plan and its source, validated against the heads and the MoE blocks (tp 1: nothing)."""
    if mesh_context.tp_size == 1:
        return {}
    cfg = mesh_context.strategy_config
    sidecar._validate_tp_mesh(model, mesh_context.tp_mesh())
    sp = bool(getattr(cfg, "sequence_parallel", False))
    if stage_of is not None:
        plan, source = (
            dict(stage_of.tp_plan),
            f"{stage_of.tp_plan_source} (this stage's entries)",
        )
    else:
        plan = resolve_tp_plan(
            model,
            plan=cfg.tp_plan,
            sequence_parallel=sp,
            tp_size=mesh_context.tp_size,
            model_plan=sidecar.tp_plan,
            finalize=sidecar._finalize_tp_plan,
        )
        source = plan.source
        # The model's own default plan (Hugging Face's) may shard experts; under ep > 1 EP owns them.
        default = source in _MODEL_DEFAULT_SOURCES and not sidecar._finalizes_tp_plan()
        plan = validate_moe_tp_plan(model, plan, blocks, model_default=default)
    return {
        "tp_plan": MappingProxyType(dict(plan)),
        "tp_plan_source": source,
        "sequence_parallel": sp,
        "async_tp": bool(getattr(cfg, "enable_async_tensor_parallel", False)),
    }


def _float8_decisions(model: nn.Module, mesh_context: MeshContext, plan: ParallelPlan) -> dict[str, Any]:
    """The linears torchao converts and the TP plan with their float8 styles (no float8: nothing)."""
    config = getattr(mesh_context.strategy_config, "float8", None)
    if config is None:
        return {}
    device, tp_size = mesh_context.device_mesh.device_type, mesh_context.tp_size
    float8 = plan_float8(model, config, device_type=device, tp_plan=plan.tp_plan, tp_size=tp_size)
    return {"float8": float8, "tp_plan": MappingProxyType(float8_tp_plan(model, plan.tp_plan, float8))}


def _cp_decisions(model: nn.Module, mesh_context: MeshContext) -> dict[str, Any]:
    if mesh_context.cp_size == 1:
        return {}
    check_context_parallel_model(model, mesh_context)
    return {
        "cp_attention": cp_attention_choice(model, mesh_context).variant,  # "auto" resolved
        "cp_gathered": cp_gathered_modules(model, mesh_context),
    }


def _ac_decisions(
    model: nn.Module, mesh_context: MeshContext, sidecar: ModelParallelizer, blocks: tuple[MoEBlockInfo, ...]
) -> dict[str, Any]:
    """Checkpointing mode, scope and save list, and the layer groups (the FSDP2 flow always needs them)."""
    mode = mesh_context.activation_checkpointing
    strategy = strategy_name(mesh_context.strategy_config)
    needs_groups = bool(mode) or strategy == "fsdp2"
    decisions: dict[str, Any] = {
        "layer_groups": tuple(discover_layer_groups(model, sidecar.layer_group_paths)) if needs_groups else ()
    }
    if mode:
        scope = getattr(mesh_context.strategy_config, "activation_checkpointing_scope", "all")
        decisions |= {
            "ac_mode": "full" if mode is True else str(mode),
            "ac_scope": (scope,) if isinstance(scope, str) else tuple(scope),
            "ac_whole_layer": bool(sidecar._use_full_layer_activation_checkpointing(model)),
            "ac_save_inside": tuple(routers_to_save(list(blocks), mesh_context)),
        }
    return decisions


def _fsdp_decisions(model: nn.Module, mesh_context: MeshContext, plan: ParallelPlan) -> dict[str, Any]:
    """Frozen towers, compile, and the FSDP units in creation order (none on one unsharded rank)."""
    cfg: FSDP2Config = mesh_context.strategy_config
    frozen = find_frozen_multimodal_modules(model)
    ignored = frozen_multimodal_ignored_params(frozen, cfg.frozen_multimodal_sharding)
    decisions: dict[str, Any] = {
        "frozen_modules": tuple(frozen),
        "ignored_params": frozenset(ignored),
        "compile": compile_requested(mesh_context),
    }
    if mesh_context.pp_size > 1:  # the whole model under PP: each stage's plan has its units
        return decisions
    if mesh_context.fsdp_mesh().size() == 1 and mesh_context.tp_size == 1:
        return decisions
    stage = plan.pipeline_stage
    explicit = moe_reshard_after_forward(mesh_context)
    experts = [
        FSDPUnit(
            (b.experts_fqn,),
            "experts",
            unit_reshard_after_forward(
                "experts",
                explicit=explicit,
                pipeline_stage=stage,
                replays_ops=replays_ops_in_layers(mesh_context),
            ),
            mesh="ep_shard",
        )
        for b in plan.moe_blocks
    ]
    layer_explicit = False if explicit is None and stage else explicit
    layers = plan_layer_units(
        model,
        reshard_after_forward=layer_explicit,
        frozen_multimodal_sharding=cfg.frozen_multimodal_sharding,
        ignored_params=ignored,
        exclude=[b.experts for b in plan.moe_blocks],
    )
    units = [*experts, *layers, *_head_unit(model, mesh_context)]
    input_reshard = unit_reshard_after_forward(
        "input_embedding", explicit=cfg.reshard_after_forward, pipeline_stage=stage
    )
    units += plan_untied_embedding_units(
        model,
        [fqn for u in units for fqn in u.modules],
        input_reshard_after_forward=bool(input_reshard),
        layer_groups=plan.layer_groups,
    )
    units += _outer_units(model, mesh_context, units)
    return decisions | {"fsdp_units": tuple(units), "layer_reshard_after_forward": layer_explicit}


@contextlib.contextmanager
def _trainability_restored(model: nn.Module, mesh_context: MeshContext) -> Iterator[None]:
    """Inside, the model's ``requires_grad`` flags are as the FSDP step sees them (after
    ``reapply_trainability``); after, they are put back: the plan changes nothing."""
    flags = [(p, p.requires_grad) for p in model.parameters()]
    try:
        if mesh_context.reapply_trainability is not None:
            mesh_context.reapply_trainability(model)
        yield
    finally:
        for param, flag in flags:
            param.requires_grad_(flag)


def _head_unit(model: nn.Module, mesh_context: MeshContext) -> list[FSDPUnit]:
    head = moe_head(model, mesh_context)
    if head is None:
        return []
    fqn = next(name for name, m in model.named_modules() if m is head)
    return [FSDPUnit((fqn,), "head", unit_reshard_after_forward("head"))]


def _outer_units(model: nn.Module, mesh_context: MeshContext, inner: list[FSDPUnit]) -> list[FSDPUnit]:
    """The root unit, or (``MoEConfig.wrap_outer_model=False``) one unit per top-level child with parameters."""
    if wraps_root(mesh_context):
        return [FSDPUnit(("",), "root", unit_reshard_after_forward("root"))]
    taken = {fqn for u in inner for fqn in u.modules}
    return [
        FSDPUnit((name,), "child", unit_reshard_after_forward("child"))
        for name, child in model.named_children()
        if name not in taken and any(True for _ in child.parameters())
    ]
