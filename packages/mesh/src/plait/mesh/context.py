"""MeshContext: the meshes and configs one ``parallelize_model`` call works from."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Self

import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from plait.mesh.axes import validate_axis_names
from plait.mesh.build import (
    build_planned_ddp_mesh,
    build_planned_device_mesh,
    build_planned_moe_mesh,
    plan_meshes,
)
from plait.mesh.configs import DDPConfig, FSDP2Config, MoEConfig
from plait.mesh.consistency import check_ranks_agree, describe_arguments
from plait.mesh.normalize import (
    ActivationCheckpointing,
    ActivationCheckpointingMode,
    normalize_activation_checkpointing,
)
from plait.mesh.sizes import ParallelismSizes
from plait.mesh.strategy import StrategyConfig

__all__ = ["MeshContext"]

_VIEW_PARTS: dict[str, tuple[str, ...]] = {
    "dp": ("dp_replicate", "dp_shard"),
    "dp_cp": ("dp_replicate", "dp_shard", "cp"),
    "dp_shard_cp": ("dp_shard", "cp"),
}
"""Flattened views and the root dims they span; a Megatron-style root ``dp`` axis stands for both dp dims
(so there ``dp_shard_cp`` is the same mesh as ``dp_cp``)."""


def _dim_size(mesh: DeviceMesh | None, name: str) -> int | None:
    if mesh is None or name not in (mesh.mesh_dim_names or ()):
        return None
    return mesh.size(mesh.mesh_dim_names.index(name))


def _concatenate(first: DeviceMesh, second: DeviceMesh) -> DeviceMesh:
    """2-D mesh ``(first, second)`` of two 1-D views of one root mesh, reusing their process groups."""
    if hasattr(DeviceMesh, "_concatenate"):
        return DeviceMesh._concatenate([first, second])
    root = first._get_root_mesh()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return root[first.mesh_dim_names[0], second.mesh_dim_names[0]]


@dataclass(frozen=True, eq=False)
class MeshContext:
    """Device meshes, strategy and options for one parallelization; sizes are read from the meshes.

    Construct with :meth:`build` (from sizes) or :meth:`from_meshes` (from existing meshes). Every
    rank must construct it: flattened views missing from a given mesh are created (a collective).
    """

    device_mesh: DeviceMesh | None = None
    """Root mesh: FSDP2 ``(pp, dp_replicate, dp_shard, cp, tp)``, Megatron-FSDP ``(dp, cp, tp)``; None for DDP."""
    moe_mesh: DeviceMesh | None = None
    """``(ep_shard, ep)`` mesh of this rank's pipeline stage; None when ep is 1."""
    strategy_config: StrategyConfig | Any = field(default_factory=FSDP2Config)
    """:class:`FSDP2Config`, :class:`DDPConfig` or :class:`MegatronFSDPConfig`."""
    moe_config: MoEConfig | None = None
    """Mixture-of-experts options; defaults to ``MoEConfig()`` when a MoE mesh is given."""
    activation_checkpointing: ActivationCheckpointingMode = False
    """False, ``"full"`` or ``"selective"`` (True is stored as ``"full"``)."""
    reapply_trainability: Callable[[nn.Module], None] | None = None
    """Called on the model after TP/AC wrapping to restore ``requires_grad`` flags; None = skip."""
    _views: dict[str, DeviceMesh] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.device_mesh is not None and not isinstance(self.device_mesh, DeviceMesh):
            raise TypeError(
                f"device_mesh must be a DeviceMesh or None, got {type(self.device_mesh).__name__}"
            )
        if self.moe_mesh is not None and not isinstance(self.moe_mesh, DeviceMesh):
            raise TypeError(f"moe_mesh must be a DeviceMesh or None, got {type(self.moe_mesh).__name__}")
        if self.moe_config is not None and not isinstance(self.moe_config, MoEConfig):
            raise TypeError(f"moe_config must be a MoEConfig or None, got {self.moe_config!r}")
        if self.reapply_trainability is not None and not callable(self.reapply_trainability):
            raise TypeError(
                f"reapply_trainability must be callable or None, got {self.reapply_trainability!r}"
            )
        object.__setattr__(
            self,
            "activation_checkpointing",
            normalize_activation_checkpointing(self.activation_checkpointing),
        )
        if self.device_mesh is not None:
            validate_axis_names(self.device_mesh.mesh_dim_names, what="device_mesh")
            self._prepare_dense_views(self.device_mesh)
        if self.moe_mesh is not None:
            names = validate_axis_names(self.moe_mesh.mesh_dim_names, what="moe_mesh")
            if "ep" not in names:
                raise ValueError(
                    f"moe_mesh dims {list(names)} have no 'ep' axis; name them ('ep_shard', 'ep')"
                )
            self._views["ep"] = self.moe_mesh["ep"]
            if "ep_shard" in names:
                self._views["ep_shard"] = self.moe_mesh["ep_shard"]
            if self.moe_config is None:
                object.__setattr__(self, "moe_config", MoEConfig())

    def _prepare_dense_views(self, mesh: DeviceMesh) -> None:
        dims = mesh.mesh_dim_names
        megatron_style = "dp" in dims and "dp_shard" not in dims
        flattened: dict[tuple[str, ...], DeviceMesh] = {}
        for name, parts in _VIEW_PARTS.items():
            if name in dims:
                self._views[name] = mesh[name]
                continue
            if megatron_style:
                parts = ("dp", *(p for p in parts if p == "cp"))
            present = tuple(p for p in parts if p in dims)
            if len(present) == 1:
                self._views[name] = mesh[present[0]]
            elif present:
                if present not in flattened:
                    flattened[present] = mesh[present]._flatten(name)
                self._views[name] = flattened[present]
        if "tp" in dims:
            self._views["tp"] = mesh["tp"]
        self._views["fsdp"] = self._make_fsdp_mesh(mesh)

    def _make_fsdp_mesh(self, mesh: DeviceMesh) -> DeviceMesh | None:
        dims = mesh.mesh_dim_names
        if "dp_shard" not in dims:
            return self._views.get("dp_cp" if self.cp_size > 1 else "dp")
        replicate = (self.dp_replicate_size or 1) > 1
        if self.cp_size > 1:
            shard_cp = self._views["dp_shard_cp"]
            return _concatenate(mesh["dp_replicate"], shard_cp) if replicate else shard_cp
        return mesh["dp_replicate", "dp_shard"] if replicate else mesh["dp_shard"]

    # -- constructors -------------------------------------------------------------------------

    @classmethod
    def build(
        cls,
        strategy_config: StrategyConfig,
        sizes: ParallelismSizes | None = None,
        *,
        world_size: int | None = None,
        ranks: Sequence[int] | None = None,
        moe_config: MoEConfig | None = None,
        activation_checkpointing: ActivationCheckpointing = False,
        reapply_trainability: Callable[[nn.Module], None] | None = None,
        device_type: str | None = None,
    ) -> Self:
        """Validate the sizes for the strategy, then build the meshes (every rank must call this).

        Args:
            strategy_config: :class:`FSDP2Config`, :class:`DDPConfig` or :class:`MegatronFSDPConfig`.
            sizes: parallelism sizes; None = all ranks data-parallel. ``dp_size`` None/-1 is inferred.
            world_size: ranks the mesh spans; default ``len(ranks)``, else the process group's size.
            ranks: global ranks in mesh order (unique; as many as the mesh has); they must be exactly
                the ranks of the default process group (a custom order), as torch needs every rank in it.
            moe_config: MoE options; default ``MoEConfig()`` when ``ep_size > 1``.
            activation_checkpointing: False, True (= "full"), "full" or "selective".
            reapply_trainability: callable re-freezing parameters after wrapping, or None.
            device_type: mesh device type; default ``cuda`` under NCCL with CUDA, else ``cpu``.

        Raises:
            TypeError / ValueError: before any collective, for every invalid combination, and when
                the ranks do not all pass the same arguments (compared with a short timeout).
        """
        normalize_activation_checkpointing(activation_checkpointing)
        if moe_config is not None and not isinstance(moe_config, MoEConfig):
            raise TypeError(f"moe_config must be a MoEConfig or None, got {moe_config!r}")
        if reapply_trainability is not None and not callable(reapply_trainability):
            raise TypeError(f"reapply_trainability must be callable or None, got {reapply_trainability!r}")
        check_ranks_agree(
            "MeshContext.build",
            describe_arguments(
                strategy_config=strategy_config,
                sizes=sizes,
                world_size=world_size,
                ranks=ranks,
                moe_config=moe_config,
                activation_checkpointing=activation_checkpointing,
                reapply_trainability=reapply_trainability,
                device_type=device_type,
            ),
        )
        plan = plan_meshes(strategy_config, sizes, world_size=world_size, ranks=ranks)
        ctx = cls(
            device_mesh=build_planned_device_mesh(plan, device_type),
            moe_mesh=build_planned_moe_mesh(plan, device_type),
            strategy_config=strategy_config,
            moe_config=moe_config,
            activation_checkpointing=activation_checkpointing,
            reapply_trainability=reapply_trainability,
        )
        if isinstance(strategy_config, DDPConfig) and dist.is_initialized():
            # No root mesh, yet a loop needs its data-parallel ranks (a plan without a group has none).
            ctx._views["dp"] = ctx._views["dp_cp"] = build_planned_ddp_mesh(plan, device_type)
        return ctx

    @classmethod
    def from_meshes(
        cls,
        device_mesh: DeviceMesh | None,
        moe_mesh: DeviceMesh | None = None,
        *,
        strategy_config: StrategyConfig | None = None,
        moe_config: MoEConfig | None = None,
        activation_checkpointing: ActivationCheckpointing = False,
        reapply_trainability: Callable[[nn.Module], None] | None = None,
    ) -> Self:
        """Wrap existing meshes; dim names must be :class:`MeshAxisName` values (else ValueError).

        Missing flattened views (``dp``, ``dp_shard_cp``, ``dp_cp``) are created with ``_flatten``,
        so every rank must call this. ``strategy_config`` defaults to ``FSDP2Config()``.
        """
        return cls(
            device_mesh=device_mesh,
            moe_mesh=moe_mesh,
            strategy_config=strategy_config if strategy_config is not None else FSDP2Config(),
            moe_config=moe_config,
            activation_checkpointing=activation_checkpointing,
            reapply_trainability=reapply_trainability,
        )

    # -- sizes ----------------------------------------------------------------------------------

    @property
    def pp_size(self) -> int:
        """Pipeline stages (1 without a ``pp`` axis)."""
        return _dim_size(self.device_mesh, "pp") or 1

    @property
    def tp_size(self) -> int:
        """Tensor-parallel ranks (1 without a ``tp`` axis)."""
        return _dim_size(self.device_mesh, "tp") or 1

    @property
    def cp_size(self) -> int:
        """Context-parallel ranks (1 without a ``cp`` axis)."""
        return _dim_size(self.device_mesh, "cp") or 1

    @property
    def ep_size(self) -> int:
        """Expert-parallel ranks (1 without a MoE mesh)."""
        return _dim_size(self.moe_mesh, "ep") or 1

    @property
    def dp_size(self) -> int | None:
        """Data-parallel ranks (replicas x shards); None without a device mesh."""
        if self.device_mesh is None:
            return None
        dp = _dim_size(self.device_mesh, "dp")
        if dp is not None:
            return dp
        return (_dim_size(self.device_mesh, "dp_replicate") or 1) * (
            _dim_size(self.device_mesh, "dp_shard") or 1
        )

    @property
    def dp_replicate_size(self) -> int | None:
        """Data-parallel replicas (HSDP outer axis); None without a device mesh."""
        if self.device_mesh is None:
            return None
        return _dim_size(self.device_mesh, "dp_replicate") or 1

    @property
    def dp_shard_size(self) -> int:
        """Ranks sharding parameters: the ``dp_shard`` axis, else a root ``dp`` axis (Megatron-FSDP), else 1."""
        return _dim_size(self.device_mesh, "dp_shard") or _dim_size(self.device_mesh, "dp") or 1

    # -- mesh accessors -------------------------------------------------------------------------

    def _view(self, name: str, why: str) -> DeviceMesh:
        view = self._views.get(name)
        if view is None:
            dims = None if self.device_mesh is None else list(self.device_mesh.mesh_dim_names)
            moe = None if self.moe_mesh is None else list(self.moe_mesh.mesh_dim_names)
            raise ValueError(
                f"no {why} mesh in this MeshContext (device_mesh dims {dims}, moe_mesh dims {moe})"
            )
        return view

    def fsdp_mesh(self) -> DeviceMesh:
        """The mesh FSDP shards over.

        ``dp_shard`` (1-D); ``(dp_replicate, dp_shard)`` for HSDP; the flattened ``dp_shard_cp``
        when cp > 1; ``(dp_replicate, dp_shard_cp)`` when both. Never a 2-D ``(dp_shard, cp)``
        slice, which ``fully_shard`` would read as HSDP and silently replicate over cp.
        """
        return self._view("fsdp", "FSDP (dp_shard)")

    def tp_mesh(self) -> DeviceMesh:
        """The 1-D ``tp`` mesh."""
        return self._view("tp", "'tp'")

    def dp_mesh(self) -> DeviceMesh:
        """All data-parallel ranks, flattened ``(dp_replicate, dp_shard)``; every rank under DDP (for data loading)."""
        return self._view("dp", "data-parallel ('dp')")

    def dp_cp_mesh(self) -> DeviceMesh:
        """Data- and context-parallel ranks, flattened ``(dp_replicate, dp_shard, cp)`` (for the loss)."""
        return self._view("dp_cp", "'dp_cp'")

    def ep_mesh(self) -> DeviceMesh:
        """The 1-D expert-parallel ``ep`` mesh of the MoE mesh."""
        return self._view("ep", "expert-parallel ('ep'; ep_size is 1)")

    def ep_shard_mesh(self) -> DeviceMesh:
        """The 1-D ``ep_shard`` mesh experts are FSDP-sharded over."""
        return self._view("ep_shard", "'ep_shard'")
