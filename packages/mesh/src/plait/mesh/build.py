"""Build the device meshes each strategy needs; every check runs before any collective."""

from __future__ import annotations

import warnings
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from plait.mesh.combinations import check_combination, combination_request
from plait.mesh.configs import FSDP2Config, MegatronFSDPConfig
from plait.mesh.consistency import check_ranks_agree, describe_arguments
from plait.mesh.sizes import ParallelismSizes
from plait.mesh.strategy import StrategyConfig, strategy_name

__all__ = [
    "FSDP2_DIMS",
    "FSDP2_FLATTENED",
    "MEGATRON_DIMS",
    "MeshPlan",
    "build_device_mesh",
    "build_moe_mesh",
    "build_planned_ddp_mesh",
    "build_planned_device_mesh",
    "build_planned_moe_mesh",
    "default_device_type",
    "plan_meshes",
]

FSDP2_DIMS: tuple[str, ...] = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
"""Root-mesh dims of FSDP2, outermost first."""
FSDP2_FLATTENED: dict[str, tuple[str, ...]] = {
    "dp": ("dp_replicate", "dp_shard"),
    "dp_shard_cp": ("dp_shard", "cp"),
    "dp_cp": ("dp_replicate", "dp_shard", "cp"),
}
"""Flattened views of the FSDP2 root mesh: data loading, FSDP shard axis, loss reduction."""
MEGATRON_DIMS: tuple[str, ...] = ("dp", "cp", "tp")
"""Root-mesh dims of Megatron-FSDP."""


@dataclass(frozen=True)
class MeshPlan:
    """The validated shape of the meshes to build (pure data; building it needs no process group)."""

    strategy: str
    """``fsdp2``, ``ddp`` or ``megatron_fsdp``."""
    sizes: ParallelismSizes
    """Sizes with ``dp_size`` resolved."""
    ranks: tuple[int, ...]
    """Global ranks the meshes span, in row-major mesh order."""
    dims: tuple[str, ...] | None
    """Root-mesh dim names; None = no device mesh (DDP)."""
    shape: tuple[int, ...] | None
    """Root-mesh shape, matching ``dims``."""
    flattened: tuple[tuple[str, tuple[str, ...]], ...]
    """Flattened views ``(name, root dims)`` to create on the root mesh."""

    @property
    def has_moe_mesh(self) -> bool:
        """Whether a ``(ep_shard, ep)`` mesh is built (``ep_size > 1``)."""
        return self.sizes.ep_size > 1


def _check_ranks(ranks: Sequence[int], world_size: int | None, sizes: ParallelismSizes) -> tuple[int, ...]:
    if isinstance(ranks, str | bytes) or not isinstance(ranks, Sequence):
        raise TypeError(f"ranks must be a list of global ranks, got {ranks!r} ({type(ranks).__name__})")
    bad = [r for r in ranks if isinstance(r, bool) or not isinstance(r, int) or r < 0]
    if bad:
        raise TypeError(f"ranks must be non-negative ints, got {bad} in {list(ranks)}")
    if not ranks:
        raise ValueError("ranks is empty; list the global ranks of the sub-job, or pass None for all ranks")
    duplicates = sorted(r for r, n in Counter(ranks).items() if n > 1)
    if duplicates:
        raise ValueError(f"ranks {list(ranks)} repeats rank(s) {duplicates}; each rank may appear once")
    if world_size is not None and world_size != len(ranks):
        raise ValueError(
            f"ranks lists {len(ranks)} ranks but world_size is {world_size}; the mesh spans exactly the "
            f"listed ranks, so drop world_size or make them agree"
        )
    if sizes.dp_size is not None:
        need = sizes.dp_size * sizes.pp_size * sizes.cp_size * sizes.tp_size
        if need != len(ranks):
            raise ValueError(
                f"ranks lists {len(ranks)} ranks but the mesh size dp*pp*cp*tp = {sizes.dp_size}*{sizes.pp_size}*"
                f"{sizes.cp_size}*{sizes.tp_size} = {need}; list {need} ranks or change the sizes"
            )
    return tuple(ranks)


def _default_world_size() -> int:
    if not dist.is_initialized():
        raise ValueError(
            "no world_size given and torch.distributed is not initialised; call plait.mesh.init_distributed() "
            "first, or pass world_size / ranks"
        )
    return dist.get_world_size()


def _check_reshard_group(config: FSDP2Config, sizes: ParallelismSizes) -> None:
    """An int ``reshard_after_forward`` must divide the shard group its layer units shard over."""
    value = config.reshard_after_forward
    if isinstance(value, bool) or not isinstance(value, int):
        return
    shard = sizes.dp_shard_size * sizes.cp_size
    if sizes.ep_size > 1:
        raise ValueError(
            f"FSDP2Config.reshard_after_forward={value} with ep_size={sizes.ep_size} is not supported (expert "
            "units shard over another group); use True or False with expert parallel"
        )
    if shard % value:
        divisors = [d for d in range(2, shard + 1) if shard % d == 0]
        raise ValueError(
            f"FSDP2Config.reshard_after_forward={value} must divide the FSDP shard group of {shard} ranks "
            f"(dp_shard {sizes.dp_shard_size} x cp {sizes.cp_size}); use one of {divisors} or True"
        )


def plan_meshes(
    strategy_config: StrategyConfig,
    sizes: ParallelismSizes | None = None,
    *,
    world_size: int | None = None,
    ranks: Sequence[int] | None = None,
) -> MeshPlan:
    """Validate sizes against the strategy and the world; return what to build, with no collective.

    Args:
        strategy_config: an :class:`FSDP2Config`, :class:`DDPConfig` or :class:`MegatronFSDPConfig`.
        sizes: parallelism sizes; None = all ranks data-parallel.
        world_size: ranks the mesh spans; default ``len(ranks)``, else the process group's world size.
        ranks: explicit global ranks in mesh order (unique; as many as the mesh has). Building
            the meshes additionally needs them to be exactly the default process group's ranks.

    Raises:
        TypeError: an unknown strategy config type, or malformed ``ranks``.
        ValueError: any size / strategy / ranks mismatch (see docs/behavior.md "Meshes").
    """
    strategy = strategy_name(strategy_config)
    sizes = sizes if sizes is not None else ParallelismSizes()
    if not isinstance(sizes, ParallelismSizes):
        raise TypeError(f"sizes must be a ParallelismSizes, got {sizes!r} ({type(sizes).__name__})")
    if ranks is not None:
        rank_list = _check_ranks(ranks, world_size, sizes)
        world_size = len(rank_list)
    else:
        world_size = world_size if world_size is not None else _default_world_size()
        rank_list = None
    check_combination(combination_request(strategy_config, sizes), layout_only=True)
    resolved = sizes.resolve(world_size, allow_pure_replication=not isinstance(strategy_config, FSDP2Config))
    if rank_list is None:
        rank_list = tuple(range(world_size))
    if isinstance(strategy_config, FSDP2Config):
        if strategy_config.sequence_parallel and resolved.tp_size == 1:
            warnings.warn("FSDP2Config.sequence_parallel is ignored because tp_size is 1", stacklevel=3)
        if strategy_config.cp_sequence_mixers != "refuse" and resolved.cp_size == 1:
            warnings.warn("FSDP2Config.cp_sequence_mixers is ignored because cp_size is 1", stacklevel=3)
        _check_reshard_group(strategy_config, resolved)
        s = resolved
        shape = (s.pp_size, s.dp_replicate_size, s.dp_shard_size, s.cp_size, s.tp_size)
        return MeshPlan(strategy, resolved, rank_list, FSDP2_DIMS, shape, tuple(FSDP2_FLATTENED.items()))
    if isinstance(strategy_config, MegatronFSDPConfig):
        shape = (resolved.dp_size, resolved.cp_size, resolved.tp_size)
        flattened = (("dp_cp", ("dp", "cp")),) if resolved.cp_size > 1 else ()
        return MeshPlan(strategy, resolved, rank_list, MEGATRON_DIMS, shape, flattened)
    return MeshPlan(strategy, resolved, rank_list, None, None, ())


def default_device_type() -> str:
    """``cuda`` when the default process group uses NCCL and CUDA is available, else ``cpu``."""
    if dist.is_initialized() and "nccl" in str(dist.get_backend()) and torch.cuda.is_available():
        return "cuda"
    return "cpu"


def _check_process_group(ranks: tuple[int, ...]) -> None:
    """The mesh must hold every rank of the default group: torch can slice and flatten a mesh only on its members."""
    if not dist.is_initialized():
        raise ValueError("torch.distributed is not initialised; call plait.mesh.init_distributed() first")
    world = dist.get_world_size()
    outside = [r for r in ranks if r >= world]
    if outside:
        raise ValueError(
            f"mesh ranks {outside[:8]} are outside the process group of world size {world}; "
            f"lower the sizes / world_size or list ranks below {world}"
        )
    if len(ranks) != world:
        raise ValueError(
            f"the mesh spans {len(ranks)} of the {world} ranks of the process group, but every rank of the "
            f"default process group must be in the mesh (torch slices and flattens a DeviceMesh only on its "
            f"members); run the sub-job in its own process group of {len(ranks)} ranks, or pass ranks / "
            f"world_size covering all {world} ranks"
        )


def build_planned_device_mesh(plan: MeshPlan, device_type: str | None = None) -> DeviceMesh | None:
    """Create the root mesh of ``plan`` and its flattened views (a collective on every rank).

    Raises:
        ValueError: the process group is not initialised, or the plan's ranks are not exactly its ranks.
    """
    if plan.dims is None or plan.shape is None:
        return None
    _check_process_group(plan.ranks)
    mesh_tensor = torch.tensor(plan.ranks, dtype=torch.int).reshape(plan.shape)
    mesh = DeviceMesh(device_type or default_device_type(), mesh_tensor, mesh_dim_names=plan.dims)
    for name, parts in plan.flattened:
        mesh[parts]._flatten(name)
    return mesh


def build_planned_ddp_mesh(plan: MeshPlan, device_type: str | None = None) -> DeviceMesh:
    """The 1-D ``dp`` mesh over every rank of a DDP plan, for data loading and loss reduction (a collective)."""
    _check_process_group(plan.ranks)
    ranks = torch.tensor(plan.ranks, dtype=torch.int)
    return DeviceMesh(device_type or default_device_type(), ranks, mesh_dim_names=("dp",))


def build_planned_moe_mesh(plan: MeshPlan, device_type: str | None = None) -> DeviceMesh | None:
    """Create the ``(ep_shard, ep)`` mesh of this rank's pipeline stage, ``ep`` innermost; None when ep is 1."""
    if not plan.has_moe_mesh:
        return None
    _check_process_group(plan.ranks)
    s = plan.sizes
    ep_shard = s.non_pp_size // s.ep_size
    device_type = device_type or default_device_type()
    ranks = torch.tensor(plan.ranks, dtype=torch.int)
    if s.pp_size == 1:
        return DeviceMesh(device_type, ranks.reshape(ep_shard, s.ep_size), mesh_dim_names=("ep_shard", "ep"))
    staged = DeviceMesh(
        device_type, ranks.reshape(s.pp_size, ep_shard, s.ep_size), mesh_dim_names=("pp", "ep_shard", "ep")
    )
    return staged["ep_shard", "ep"]


def build_device_mesh(
    strategy_config: StrategyConfig,
    sizes: ParallelismSizes | None = None,
    *,
    world_size: int | None = None,
    ranks: Sequence[int] | None = None,
    device_type: str | None = None,
) -> DeviceMesh | None:
    """Build the strategy's root device mesh (None for DDP); see :func:`plan_meshes` for the checks.

    FSDP2: dims ``(pp, dp_replicate, dp_shard, cp, tp)`` with flattened ``dp``, ``dp_shard_cp`` and
    ``dp_cp``. Megatron-FSDP: ``(dp, cp, tp)`` with ``dp_cp`` flattened when cp > 1. Every rank of
    the process group must call this (subgroup creation is collective).
    """
    arguments = describe_arguments(
        strategy_config=strategy_config,
        sizes=sizes,
        world_size=world_size,
        ranks=ranks,
        device_type=device_type,
    )
    check_ranks_agree("build_device_mesh", arguments)
    plan = plan_meshes(strategy_config, sizes, world_size=world_size, ranks=ranks)
    return build_planned_device_mesh(plan, device_type)


def build_moe_mesh(
    sizes: ParallelismSizes,
    *,
    world_size: int | None = None,
    ranks: Sequence[int] | None = None,
    device_type: str | None = None,
) -> DeviceMesh | None:
    """Build the MoE mesh ``(ep_shard, ep)`` of this rank's pipeline stage; None when ``ep_size`` is 1.

    ``ep_shard = dp*cp*tp // ep``; ``ep`` is the inner (fastest-varying) axis, so each expert-parallel
    group holds consecutive ranks. Every rank of the process group must call this.
    """
    check_ranks_agree(
        "build_moe_mesh",
        describe_arguments(sizes=sizes, world_size=world_size, ranks=ranks, device_type=device_type),
    )
    plan = plan_meshes(FSDP2Config(), sizes, world_size=world_size, ranks=ranks)
    return build_planned_moe_mesh(plan, device_type)
