"""The expert-parallel steps of the one FSDP2 flow (``ModelParallelizer._apply``), each a no-op at ep 1.

The plan (``plait.sidecar.plan_parallelism``) calls :func:`check_expert_parallel` (refusals, the blocks),
:func:`validate_moe_tp_plan` and :func:`routers_to_save` once; the flow then runs
:func:`apply_expert_parallel` after TP, :func:`shard_experts` before the layer units and
:func:`shard_moe_lm_head` after them, each over the planned blocks.

Gradient scaling. The dense units average gradients over the data-parallel ranks (``dp*cp``; TP ranks
see the same data). An expert's gradient on its owner rank already *sums* the contributions of every
rank of its ep group (the all-to-all's backward brings them home), and the ``ep_shard`` reduction then
sums over the ep groups: in total the sum over all ``dp*cp*tp`` ranks of the MoE mesh, where TP ranks
count the same tokens ``tp`` times. Dividing that sum by the MoE mesh size ``dp*cp*tp`` gives exactly the
dense units' average, so each experts unit gets ``set_gradient_divide_factor(moe_mesh.size())``.
"""

from __future__ import annotations

import fnmatch
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, OffloadPolicy
from torch.distributed.tensor import Shard
from torch.distributed.tensor.parallel import parallelize_module

from plait.mesh import MeshContext
from plait.strategies._moe_blocks import MoEBlockInfo, find_moe_blocks
from plait.strategies.experts import ExpertParallel, experts_convention

__all__ = [
    "apply_expert_parallel",
    "check_expert_parallel",
    "moe_head",
    "moe_reshard_after_forward",
    "replays_ops_in_layers",
    "routers_to_save",
    "shard_experts",
    "shard_moe_lm_head",
    "shard_top_children",
    "validate_moe_tp_plan",
    "wraps_root",
]

ShardFn = Callable[..., nn.Module]
_log = logging.getLogger(__name__)


def _check_mesh_tiling(mesh_context: MeshContext) -> None:
    ep = mesh_context.ep_size
    ep_shard = mesh_context.ep_shard_mesh().size() if "ep_shard" in _moe_dims(mesh_context) else 1
    dp, cp, tp = mesh_context.dp_size or 1, mesh_context.cp_size, mesh_context.tp_size
    dense = dp * cp * tp
    product = f"dp*cp*tp = {dp}*{cp}*{tp} = {dense}"
    if dense % ep != 0:
        raise ValueError(f"ep_size {ep} must divide {product}; pick an ep_size that divides {dense}")
    if ep * ep_shard != dense:
        raise ValueError(
            f"moe_mesh (ep_shard={ep_shard}, ep={ep}) spans {ep * ep_shard} ranks but {product}; "
            f"ep_shard must be {dense // ep}"
        )


def _moe_dims(mesh_context: MeshContext) -> tuple[str, ...]:
    mesh = mesh_context.moe_mesh
    return () if mesh is None else tuple(mesh.mesh_dim_names or ())


def check_expert_parallel(model: nn.Module, mesh_context: MeshContext) -> list[MoEBlockInfo]:
    """Refuse what expert parallel cannot do, on every rank, before any collective; return the blocks.

    Returns ``[]`` at ep 1.

    Raises:
        TypeError: no device mesh or MoEConfig, or an experts forward of neither supported convention.
        ValueError: ep vs ``dp*cp*tp``; no experts; ``num_experts % ep``; per-expert module lists;
            ``wrap_outer_model=False`` with root-owned parameters. (Strategies and techniques that do not
            combine with expert parallel are refused by the combination table in plait.mesh.)
    """
    if mesh_context.ep_size == 1:
        return []
    moe_cfg = mesh_context.moe_config
    if mesh_context.device_mesh is None or moe_cfg is None:
        raise TypeError(
            f"expert parallelism (ep_size={mesh_context.ep_size}) needs a device mesh and an MoEConfig; use "
            "MeshContext.build(FSDP2Config(...), ParallelismSizes(ep_size=...))."
        )
    _check_mesh_tiling(mesh_context)
    blocks = find_moe_blocks(model, mesh_context.ep_size)
    for block in blocks:
        experts_convention(block.experts)
    if replays_ops_in_layers(mesh_context) and moe_cfg.reshard_after_forward is True:
        raise ValueError(
            f"MoEConfig.reshard_after_forward=True under activation_checkpointing="
            f"{mesh_context.activation_checkpointing!r} (ignore_router_for_ac={moe_cfg.ignore_router_for_ac}): "
            "selective checkpointing replays the forward's ops, and an expert unit that reshards would "
            "all-gather again inside the recompute; unset MoEConfig.reshard_after_forward (expert units then "
            "stay unsharded between forward and backward)"
        )
    if moe_cfg.lm_head_precision is not None and _output_head(model)[1]:
        raise ValueError(
            f"MoEConfig.lm_head_precision={moe_cfg.lm_head_precision} needs an untied output head, but "
            f"{type(model).__name__} ties it to the input embeddings; unset lm_head_precision"
        )
    if not moe_cfg.wrap_outer_model and any(True for _ in model.parameters(recurse=False)):
        raise ValueError(
            f"MoEConfig.wrap_outer_model=False, but {type(model).__name__} owns parameters directly; they "
            "would never be sharded or synchronised - set wrap_outer_model=True"
        )
    return blocks


def validate_moe_tp_plan(
    model: nn.Module, plan: Mapping[str, Any], blocks: Sequence[MoEBlockInfo], *, model_default: bool = False
) -> dict[str, Any]:
    """Under ep > 1, keep experts, routers and gates out of the TP plan; return the plan to apply.

    Experts are expert-parallel and routers/gates stay replicated, so no pattern may touch them (or
    anything inside them). A user-written plan (``FSDP2Config.tp_plan``, a sidecar's plan, a plan
    registered for the class) touching them is refused. The model's own default plan (a Hugging Face
    ``base_model_tp_plan`` shards experts with ``moe_tp_experts``) has those entries dropped, each
    named in a log record; a default pattern matching both protected and other modules is refused.
    Without blocks (ep 1) the plan is returned unchanged.

    Raises:
        ValueError: naming the pattern and the protected module it matches.
    """
    if not blocks:
        return dict(plan)
    protected = [fqn for b in blocks for fqn in (b.experts_fqn, b.router_fqn) if fqn is not None]
    names = [name for name, _ in model.named_modules() if name]
    kept: dict[str, Any] = {}
    for pattern, style in plan.items():
        matches = fnmatch.filter(names, pattern)
        hits = [(n, hit) for n in matches if (hit := _protector(n, protected)) is not None]
        if not hits:
            kept[pattern] = style
        elif model_default and len(hits) == len(matches):
            _log.info(
                "expert parallel: dropped the default TP plan entry %r (experts are expert-parallel)", pattern
            )
        else:
            name, hit = hits[0]
            fix = "pass a tp_plan without it" if model_default else "remove the pattern"
            raise ValueError(
                f"tp_plan pattern {pattern!r} matches {name!r}, inside MoE experts/router {hit!r}; "
                f"experts are expert-parallel and routers/gates stay replicated - {fix}"
            )
    return kept


def _protector(name: str, protected: list[str]) -> str | None:
    """The experts / router FQN that ``name`` is or lies inside, else None."""
    return next((p for p in protected if name == p or name.startswith(p + ".")), None)


def apply_expert_parallel(blocks: Sequence[MoEBlockInfo], ep_mesh: DeviceMesh) -> None:
    """Shard every experts module ``Shard(0)`` on the ep mesh and route its tokens by all-to-all."""
    for block in blocks:
        parallelize_module(block.experts, ep_mesh, ExpertParallel())


def routers_to_save(blocks: Sequence[MoEBlockInfo], mesh_context: MeshContext) -> list[str]:
    """The routers whose ops activation checkpointing must save, never recompute (``ignore_router_for_ac``).

    A recomputed router can pick other experts than the forward did (ties in top-k, non-deterministic
    kernels), which changes the token counts of the all-to-all. Empty without checkpointing.
    """
    moe_cfg = mesh_context.moe_config
    if (
        not blocks
        or not mesh_context.activation_checkpointing
        or moe_cfg is None
        or not moe_cfg.ignore_router_for_ac
    ):
        return []
    return [b.router_fqn for b in blocks if b.router_fqn is not None]


def moe_reshard_after_forward(mesh_context: MeshContext) -> bool | None:
    """``MoEConfig.reshard_after_forward`` where the user set one (ep > 1), else ``FSDP2Config``'s."""
    moe_cfg = mesh_context.moe_config
    if mesh_context.ep_size > 1 and moe_cfg is not None and moe_cfg.reshard_after_forward is not None:
        return moe_cfg.reshard_after_forward
    return getattr(mesh_context.strategy_config, "reshard_after_forward", None)


def replays_ops_in_layers(mesh_context: MeshContext) -> bool:
    """Whether the layers run under torch's selective checkpoint (selective mode, or routing saved)."""
    moe_cfg, mode = mesh_context.moe_config, mesh_context.activation_checkpointing
    saves_routing = mesh_context.ep_size > 1 and moe_cfg is not None and moe_cfg.ignore_router_for_ac
    return mode == "selective" or bool(mode and saves_routing)


def _experts_placement(ep_shard: int, local_experts: int) -> Callable[[nn.Parameter], Shard]:
    # More ep_shard ranks than local experts: dim-0 shards would be empty on some ranks, use dim 1.
    dim = 1 if ep_shard > local_experts else 0
    return lambda param: Shard(dim)


def shard_experts(
    blocks: Sequence[MoEBlockInfo],
    mesh_context: MeshContext,
    shard_fn: ShardFn,
    *,
    reshard_after_forward: bool | int,
) -> None:
    """Give every experts module its own FSDP unit on the ``ep_shard`` mesh (before the layer units).

    Mixed precision: ``MoEConfig.mp_policy``, else the strategy's. Raises TypeError when ``shard_fn``
    (the sidecar's ``_fully_shard_module``) does not return an FSDP module.
    """
    cfg, moe_cfg = mesh_context.strategy_config, mesh_context.moe_config
    ep_shard_mesh = mesh_context.ep_shard_mesh()
    factor = float(mesh_context.moe_mesh.size())
    # A custom divide factor reduce-scatters with PREMUL_SUM, which only NCCL has; elsewhere sum, then
    # divide. (On one rank FSDP skips the collective and divides by the factor itself.)
    force_sum = ep_shard_mesh.size() > 1 and not (
        ep_shard_mesh.device_type == "cuda" and "nccl" in str(dist.get_backend(ep_shard_mesh.get_group()))
    )
    for block in blocks:
        unit = shard_fn(
            block.experts,
            mesh=ep_shard_mesh,
            reshard_after_forward=reshard_after_forward,
            mp_policy=moe_cfg.mp_policy or cfg.mp_policy or MixedPrecisionPolicy(),
            offload_policy=cfg.offload_policy or OffloadPolicy(),
            shard_placement_fn=_experts_placement(
                ep_shard_mesh.size(), block.num_experts // mesh_context.ep_size
            ),
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


def _output_head(model: nn.Module) -> tuple[nn.Module | None, bool]:
    """The output head (None without one) and whether it shares its weight with the input embeddings."""
    head_getter = getattr(model, "get_output_embeddings", None)
    head = head_getter() if callable(head_getter) else None
    embed_getter = getattr(model, "get_input_embeddings", None)
    embed = embed_getter() if callable(embed_getter) else None
    tied = (
        head is not None
        and embed is not None
        and getattr(embed, "weight", None) is getattr(head, "weight", 0)
    )
    return head, tied


def moe_head(model: nn.Module, mesh_context: MeshContext) -> nn.Module | None:
    """The output head that gets its own unit in ``MoEConfig.lm_head_precision``, or None."""
    moe_cfg = mesh_context.moe_config
    if mesh_context.ep_size == 1 or moe_cfg is None or moe_cfg.lm_head_precision is None:
        return None
    head, _ = _output_head(model)
    return None if head is None or isinstance(head, FSDPModule) else head


def shard_moe_lm_head(model: nn.Module, mesh_context: MeshContext, shard_fn: ShardFn) -> None:
    """Put the output head in its own unit computing in ``MoEConfig.lm_head_precision`` (if set)."""
    head = moe_head(model, mesh_context)
    if head is None:
        return
    dtype = mesh_context.moe_config.lm_head_precision
    policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=dtype, output_dtype=dtype)
    shard_fn(head, mesh=mesh_context.fsdp_mesh(), reshard_after_forward=False, mp_policy=policy)


def shard_top_children(model: nn.Module, mesh_context: MeshContext, shard_fn: ShardFn) -> nn.Module:
    """``MoEConfig.wrap_outer_model=False``: one unit per top-level child with parameters, no root unit."""
    cfg = mesh_context.strategy_config
    for child in model.children():
        if not isinstance(child, FSDPModule) and any(True for _ in child.parameters()):
            shard_fn(
                child,
                mesh=mesh_context.fsdp_mesh(),
                reshard_after_forward=False,
                mp_policy=cfg.mp_policy or MixedPrecisionPolicy(),
                offload_policy=cfg.offload_policy or OffloadPolicy(),
            )
    return model


def wraps_root(mesh_context: MeshContext) -> bool:
    """Whether the flow wraps the whole model as the root unit (``MoEConfig.wrap_outer_model``)."""
    moe_cfg = mesh_context.moe_config
    return mesh_context.ep_size == 1 or moe_cfg is None or moe_cfg.wrap_outer_model
