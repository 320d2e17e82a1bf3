"""Mixture-of-experts parallelization: TP -> EP -> AC -> reapply_trainability -> FSDP.

Experts are sharded ``Shard(0)`` on the ``ep`` axis of the MoE mesh :class:`ExpertParallel` and get their
own FSDP unit on its ``ep_shard`` axis; everything else is sharded like a dense model on the FSDP mesh.

Gradient scaling. The dense units average gradients over the data-parallel ranks (``dp*cp``; TP ranks
see the same data). An expert's gradient on its owner rank already *sums* the contributions of every
rank of its ep group (the all-to-all's backward brings them home), and the ``ep_shard`` reduction then
sums over the ep groups: in total the sum over all ``dp*cp*tp`` ranks of the MoE mesh, where TP ranks
count the same tokens ``tp`` times. Dividing that sum by the MoE mesh size ``dp*cp*tp`` gives exactly the
dense units' average, so each experts unit gets ``set_gradient_divide_factor(moe_mesh.size())``.
"""

from __future__ import annotations

import fnmatch
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import Shard
from torch.distributed.tensor.parallel import ParallelStyle, parallelize_module

from plait.mesh import (
    ActivationCheckpointing,
    FSDP2Config,
    MeshContext,
    MoEConfig,
    normalize_activation_checkpointing,
)
from plait.sharding import (
    apply_activation_checkpointing,
    apply_fsdp_sharding,
    discover_layer_groups,
    fully_shard_root,
    guard_tied_embeddings,
)
from plait.strategies._moe_blocks import MoEBlockInfo, find_moe_blocks
from plait.strategies._routing_ac import save_routing_under_checkpoint
from plait.strategies.experts import ExpertParallel
from plait.tp import apply_tp, resolve_tp_plan, validate_tp_mesh

__all__ = ["parallelize_moe", "validate_moe_tp_plan"]

ShardFn = Callable[..., nn.Module]


def _dim(mesh: DeviceMesh | None, name: str) -> int:
    names = () if mesh is None else (mesh.mesh_dim_names or ())
    return mesh.size(names.index(name)) if mesh is not None and name in names else 1


def _check_meshes(device_mesh: DeviceMesh, moe_mesh: DeviceMesh) -> tuple[int, int]:
    """Return ``(ep, ep_shard)``; errors when the MoE mesh does not tile the non-pipeline ranks."""
    names = moe_mesh.mesh_dim_names or ()
    if "ep" not in names:
        raise ValueError(
            f"moe_mesh dims {list(names)} have no 'ep' axis; build it with plait.mesh.build_moe_mesh"
        )
    ep, ep_shard = _dim(moe_mesh, "ep"), _dim(moe_mesh, "ep_shard")
    cp, tp = _dim(device_mesh, "cp"), _dim(device_mesh, "tp")
    dense = device_mesh.size() // _dim(device_mesh, "pp")
    product = f"dp*cp*tp = {dense // (cp * tp)}*{cp}*{tp} = {dense}"
    if dense % ep != 0:
        raise ValueError(f"ep_size {ep} must divide {product}; pick an ep_size that divides {dense}")
    if ep * ep_shard != dense:
        raise ValueError(
            f"moe_mesh (ep_shard={ep_shard}, ep={ep}) spans {ep * ep_shard} ranks but {product}; "
            f"ep_shard must be {dense // ep}"
        )
    return ep, ep_shard


def validate_moe_tp_plan(model: nn.Module, plan: Mapping[str, Any], blocks: list[MoEBlockInfo]) -> None:
    """Fail closed: no plan pattern may touch an experts module, a router or a gate (or anything inside).

    Raises:
        ValueError: naming the pattern and the protected module it matches.
    """
    protected = [fqn for b in blocks for fqn in (b.experts_fqn, b.router_fqn) if fqn is not None]
    names = [name for name, _ in model.named_modules() if name]
    for pattern in plan:
        for name in fnmatch.filter(names, pattern):
            hit = next((p for p in protected if name == p or name.startswith(p + ".")), None)
            if hit is not None:
                raise ValueError(
                    f"tp_plan pattern {pattern!r} matches {name!r}, inside MoE experts/router {hit!r}; "
                    "experts are expert-parallel and routers/gates stay replicated — remove the pattern"
                )


def _resolve_plan(
    model: nn.Module,
    cfg: FSDP2Config,
    tp_size: int,
    blocks: list[MoEBlockInfo],
    model_tp_plan: Any,
    finalize_tp_plan: Callable[..., Any] | None,
) -> dict[str, ParallelStyle]:
    plan = resolve_tp_plan(
        model,
        plan=cfg.tp_plan,
        sequence_parallel=False,
        tp_size=tp_size,
        model_plan=model_tp_plan,
        finalize=finalize_tp_plan,
    )
    validate_moe_tp_plan(model, plan, blocks)
    return plan


def _experts_placement(ep_shard: int, local_experts: int) -> Callable[[nn.Parameter], Shard]:
    # More ep_shard ranks than local experts: dim-0 shards would be empty on some ranks, use dim 1.
    dim = 1 if ep_shard > local_experts else 0
    return lambda param: Shard(dim)


def _shard_experts(
    blocks: list[MoEBlockInfo],
    ctx: MeshContext,
    moe_cfg: MoEConfig,
    mp_policy: MixedPrecisionPolicy,
    offload_policy: OffloadPolicy,
    shard_fn: ShardFn,
) -> None:
    ep_shard_mesh = ctx.ep_shard_mesh()
    factor = float(ctx.moe_mesh.size())
    # A custom divide factor reduce-scatters with PREMUL_SUM, which only NCCL has; elsewhere sum, then
    # divide. (On one rank FSDP skips the collective and divides by the factor itself.)
    force_sum = ep_shard_mesh.size() > 1 and not (
        ep_shard_mesh.device_type == "cuda" and "nccl" in str(dist.get_backend(ep_shard_mesh.get_group()))
    )
    for block in blocks:
        local = block.num_experts // ctx.ep_size
        unit = shard_fn(
            block.experts,
            mesh=ep_shard_mesh,
            reshard_after_forward=moe_cfg.reshard_after_forward,
            mp_policy=mp_policy,
            offload_policy=offload_policy,
            shard_placement_fn=_experts_placement(ep_shard_mesh.size(), local),
        )
        unit = unit if isinstance(unit, nn.Module) else block.experts
        if not isinstance(unit, FSDPModule):
            raise TypeError(
                f"shard_fn {shard_fn!r} did not make {block.experts_fqn!r} an FSDP module; expert gradients "
                "need its gradient divide factor"
            )
        unit.set_gradient_divide_factor(factor)
        if force_sum:
            unit.set_force_sum_reduction_for_comms(True)


def _shard_lm_head(model: nn.Module, moe_cfg: MoEConfig, mesh: DeviceMesh, shard_fn: ShardFn) -> None:
    head_getter = getattr(model, "get_output_embeddings", None)
    head = head_getter() if callable(head_getter) else None
    if moe_cfg.lm_head_precision is None or head is None or isinstance(head, FSDPModule):
        return
    embed_getter = getattr(model, "get_input_embeddings", None)
    embed = embed_getter() if callable(embed_getter) else None
    if embed is not None and getattr(embed, "weight", None) is getattr(head, "weight", None):
        warnings.warn(
            f"MoEConfig.lm_head_precision={moe_cfg.lm_head_precision} is ignored: the output head is tied to "
            "the input embeddings, which stay in one FSDP unit",
            UserWarning,
            stacklevel=3,
        )
        return
    dtype = moe_cfg.lm_head_precision
    policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=dtype, output_dtype=dtype)
    shard_fn(head, mesh=mesh, reshard_after_forward=False, mp_policy=policy)


def _shard_top(
    model: nn.Module,
    moe_cfg: MoEConfig,
    mesh: DeviceMesh,
    mp_policy: MixedPrecisionPolicy,
    offload_policy: OffloadPolicy,
    shard_fn: ShardFn,
) -> nn.Module:
    if moe_cfg.wrap_outer_model:
        return fully_shard_root(
            model, mesh, mp_policy=mp_policy, offload_policy=offload_policy, shard_fn=shard_fn
        )
    for child in model.children():
        if not isinstance(child, FSDPModule) and any(True for _ in child.parameters()):
            shard_fn(
                child,
                mesh=mesh,
                reshard_after_forward=False,
                mp_policy=mp_policy,
                offload_policy=offload_policy,
            )
    return model


def parallelize_moe(
    model: nn.Module,
    device_mesh: DeviceMesh,
    moe_mesh: DeviceMesh,
    *,
    strategy_config: FSDP2Config | None = None,
    moe_config: MoEConfig | None = None,
    activation_checkpointing: ActivationCheckpointing = False,
    reapply_trainability: Callable[[nn.Module], None] | None = None,
    model_tp_plan: Any = None,
    finalize_tp_plan: Callable[..., Any] | None = None,
    validate_tp: Callable[[nn.Module, DeviceMesh], None] | None = None,
    layer_group_paths: Any = None,
    whole_layer_checkpointing: bool = False,
    shard_fn: ShardFn = fully_shard,
) -> nn.Module:
    """Parallelize a MoE model in place: TP -> EP -> AC -> ``reapply_trainability`` -> FSDP.

    Args:
        model: A model whose MoE blocks have an ``experts`` child following the experts contract
            (stacked parameters, dim 0 = expert) and a ``router`` or ``gate`` child.
        device_mesh: The dense FSDP2 root mesh ``(pp, dp_replicate, dp_shard, cp, tp)`` (any subset).
        moe_mesh: The ``(ep_shard, ep)`` mesh (:func:`plait.mesh.build_moe_mesh`).
        strategy_config: The :class:`FSDP2Config` (TP plan, AC scope, offload, prefetch); default ``FSDP2Config()``.
        moe_config: :class:`MoEConfig`; default ``MoEConfig()``. Its ``mp_policy`` (falling back to the
            strategy config's) applies to every unit; ``reshard_after_forward`` to the layer and expert units.
        activation_checkpointing: False, True / ``"full"`` or ``"selective"``.
        reapply_trainability: Called after TP/EP/AC wrapping, before FSDP, to restore ``requires_grad``.
        model_tp_plan: The sidecar's TP plan factory (``resolve_tp_plan``'s ``model_plan``).
        finalize_tp_plan: The sidecar's ``_finalize_tp_plan`` hook.
        validate_tp: The sidecar's ``_validate_tp_mesh`` hook; default :func:`plait.tp.validate_tp_mesh`.
        layer_group_paths: The sidecar's ``layer_group_paths`` for activation checkpointing.
        whole_layer_checkpointing: Checkpoint whole layers instead of per submodule (full mode).
        shard_fn: The FSDP primitive, called like ``fully_shard`` (the sidecar's ``_fully_shard_module``).

    Returns:
        The parallelized model (the root FSDP module).

    Raises:
        ValueError: before any collective — no experts found, ``num_experts % ep``, ep vs ``dp*cp*tp``,
            a TP plan touching experts/routers/gates, sequence parallel or async TP, head counts vs tp.
    """
    cfg = strategy_config if strategy_config is not None else FSDP2Config()
    moe_cfg = moe_config if moe_config is not None else MoEConfig()
    ac_mode = normalize_activation_checkpointing(activation_checkpointing)
    ep, _ = _check_meshes(device_mesh, moe_mesh)
    blocks = find_moe_blocks(model, ep)
    tp_size = _dim(device_mesh, "tp")
    if cfg.sequence_parallel or cfg.enable_async_tensor_parallel:
        raise ValueError(
            f"MoE models do not support sequence_parallel={cfg.sequence_parallel} / "
            f"enable_async_tensor_parallel={cfg.enable_async_tensor_parallel}: the MoE block expects "
            "replicated activations; set both to False"
        )
    plan = None
    if tp_size > 1:
        (validate_tp or validate_tp_mesh)(model, device_mesh["tp"])
        plan = _resolve_plan(model, cfg, tp_size, blocks, model_tp_plan, finalize_tp_plan)
    groups = discover_layer_groups(model, layer_group_paths) if ac_mode else []
    if not moe_cfg.wrap_outer_model and any(True for _ in model.parameters(recurse=False)):
        raise ValueError(
            f"MoEConfig.wrap_outer_model=False, but {type(model).__name__} owns parameters directly; they "
            "would never be sharded or synchronised — set wrap_outer_model=True"
        )
    guard_tied_embeddings(model)

    ctx = MeshContext.from_meshes(device_mesh, moe_mesh, strategy_config=cfg, moe_config=moe_cfg)
    if plan:
        apply_tp(model, ctx.tp_mesh(), plan)
    for block in blocks:
        parallelize_module(block.experts, ctx.ep_mesh(), ExpertParallel())
    if ac_mode:
        apply_activation_checkpointing(
            model,
            groups,
            mode=ac_mode,
            scope=cfg.activation_checkpointing_scope,
            whole_layer=whole_layer_checkpointing,
        )
        if moe_cfg.ignore_router_for_ac:
            routers = [b.router for b in blocks if b.router is not None]
            save_routing_under_checkpoint(model, routers, selective=ac_mode == "selective")
    if reapply_trainability is not None:
        reapply_trainability(model)

    mp_policy = moe_cfg.mp_policy or cfg.mp_policy or MixedPrecisionPolicy()
    offload_policy = cfg.offload_policy or OffloadPolicy()
    fsdp_mesh = ctx.fsdp_mesh()
    _shard_experts(blocks, ctx, moe_cfg, mp_policy, offload_policy, shard_fn)
    apply_fsdp_sharding(
        model,
        fsdp_mesh,
        mp_policy=mp_policy,
        offload_policy=offload_policy,
        reshard_after_forward=moe_cfg.reshard_after_forward,
        enable_prefetch=cfg.enable_fsdp2_prefetch,
        forward_prefetch_depth=cfg.fsdp2_forward_prefetch_depth,
        backward_prefetch_depth=cfg.fsdp2_backward_prefetch_depth,
        frozen_multimodal_sharding=cfg.frozen_multimodal_sharding,
        shard_fn=shard_fn,
        pipeline_parallel=ctx.pp_size > 1,
    )
    _shard_lm_head(model, moe_cfg, fsdp_mesh, shard_fn)
    return _shard_top(model, moe_cfg, fsdp_mesh, mp_policy, offload_policy, shard_fn)
