"""`ModelParallelizer`: the model-owned sidecar whose hooks shape the one shared FSDP2 flow (dense and MoE)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor.parallel import ParallelStyle

from plait.cp import apply_context_parallel
from plait.sharding import (
    LayerGroup,
    apply_activation_checkpointing,
    apply_fsdp_sharding,
    discover_layer_groups,
    find_frozen_multimodal_modules,
    frozen_multimodal_ignored_params,
    fully_shard_root,
    fully_shard_untied_embeddings,
    guard_tied_embeddings,
)
from plait.sidecar.dispatch import _apply_model_parallelizer
from plait.strategies import (
    apply_expert_parallel,
    check_expert_parallel,
    moe_reshard_after_forward,
    save_moe_routing,
    shard_experts,
    shard_moe_lm_head,
    shard_top_children,
    validate_moe_tp_plan,
    wraps_root,
)
from plait.tp import apply_tp, enable_async_tp, resolve_tp_plan, validate_tp_mesh
from plait.tp.registry import model_class_plan

if TYPE_CHECKING:
    from plait.mesh import MeshContext

TPPlan = dict[str, ParallelStyle | str]
TPPlanFactory = Callable[[nn.Module, bool], TPPlan | None]


class ModelParallelizer:
    """Single model-owned parallelization sidecar contract.

    A model opts in with a class attribute ``parallelizer = MySidecar()`` (or a registry entry) and
    overrides only the hooks it needs; everything else runs the shared flow. Instances hold policy
    only, never model state, so one instance serves every model of its class.

    Attributes:
        tp_plan: Factory ``(model, sequence_parallel) -> dict`` used when the config names no plan.
        layer_group_paths: Explicit layer-container paths for activation checkpointing and compile
            (see `plait.sharding.discover_layer_groups`); None = structural discovery.
    """

    tp_plan: TPPlanFactory | None = None
    layer_group_paths: Any = None

    def __init__(self, *, tp_plan: TPPlanFactory | None = None, layer_group_paths: Any = None) -> None:
        if tp_plan is not None:
            self.tp_plan = tp_plan
        if layer_group_paths is not None:
            self.layer_group_paths = layer_group_paths

    def parallelize(self, model: nn.Module, mesh_context: MeshContext, /) -> nn.Module:
        """Apply every requested parallelism and return the parallelized model."""
        return _apply_model_parallelizer(self, model, mesh_context)

    def _apply(self, model: nn.Module, mesh_context: MeshContext) -> nn.Module:
        """Apply the shared FSDP2 flow (TP, EP, AC, FSDP units, root) and return the root unit.

        One line per step, each a call into a lower package, in this order: refusals before any
        collective, TP before expert parallel, both before activation checkpointing, checkpointing
        before FSDP, trainability restored before FSDP reads it, expert units before layer units.
        """
        cfg, fsdp_mesh = mesh_context.strategy_config, mesh_context.fsdp_mesh()
        groups = discover_layer_groups(model, self.layer_group_paths)
        check_expert_parallel(model, mesh_context)
        apply_context_parallel(model, mesh_context)  # cp > 1: attention over the sharded sequence
        if mesh_context.tp_size > 1:
            self._apply_tensor_parallel(model, mesh_context)
        apply_expert_parallel(model, mesh_context)
        if mesh_context.activation_checkpointing:
            self._checkpoint_activations(model, groups, mesh_context)
            save_moe_routing(model, mesh_context)
        if mesh_context.reapply_trainability is not None:
            mesh_context.reapply_trainability(model)
        frozen = find_frozen_multimodal_modules(model)
        ignored = frozen_multimodal_ignored_params(frozen, cfg.frozen_multimodal_sharding)
        guard_tied_embeddings(model)
        shard_experts(model, mesh_context, shard_fn=self._fully_shard_module)
        self._apply_fsdp_sharding(
            model,
            fsdp_mesh,
            cfg.mp_policy,
            cfg.offload_policy,
            enable_fsdp2_prefetch=cfg.enable_fsdp2_prefetch,
            fsdp2_backward_prefetch_depth=cfg.fsdp2_backward_prefetch_depth,
            fsdp2_forward_prefetch_depth=cfg.fsdp2_forward_prefetch_depth,
            reshard_after_forward=moe_reshard_after_forward(mesh_context),
            frozen_multimodal_sharding=cfg.frozen_multimodal_sharding,
            ignored_multimodal_params=ignored,
        )
        shard_moe_lm_head(model, mesh_context, shard_fn=self._fully_shard_module)
        self._fully_shard_untied_input_output_embeddings(
            model,
            fsdp_mesh,
            cfg.mp_policy,
            cfg.offload_policy,
            input_reshard_after_forward=cfg.reshard_after_forward is not False,
            layer_groups=groups,
        )
        if not wraps_root(mesh_context):
            return shard_top_children(model, mesh_context, shard_fn=self._fully_shard_module)
        return fully_shard_root(
            model,
            fsdp_mesh,
            mp_policy=cfg.mp_policy,
            offload_policy=cfg.offload_policy,
            ignored_params=ignored,
            shard_fn=self._fully_shard_module,
        )

    def _apply_tensor_parallel(self, model: nn.Module, mesh_context: MeshContext) -> None:
        """Resolve the TP plan (config, sidecar, registry, Hugging Face, default), check it, apply it."""
        cfg, tp_mesh = mesh_context.strategy_config, mesh_context.tp_mesh()
        self._validate_tp_mesh(model, tp_mesh)
        plan = resolve_tp_plan(
            model,
            plan=cfg.tp_plan,
            sequence_parallel=cfg.sequence_parallel,
            tp_size=tp_mesh.size(),
            model_plan=self.tp_plan,
            finalize=self._finalize_tp_plan,
        )
        # The model's own default plan (Hugging Face's) may shard experts; under ep > 1 EP owns them.
        default = cfg.tp_plan is None and self.tp_plan is None and model_class_plan(model) is None
        default = default and type(self)._finalize_tp_plan is ModelParallelizer._finalize_tp_plan
        plan = validate_moe_tp_plan(model, plan, mesh_context, model_default=default)
        apply_tp(model, tp_mesh, plan)  # re-ties embeddings, rewrites local head counts
        if cfg.enable_async_tensor_parallel:
            enable_async_tp(tp_mesh, sequence_parallel=cfg.sequence_parallel)

    def _apply_fsdp_sharding(
        self,
        module: nn.Module,
        mesh: DeviceMesh,
        mp_policy: MixedPrecisionPolicy | None,
        offload_policy: OffloadPolicy | None = None,
        enable_fsdp2_prefetch: bool = True,
        fsdp2_backward_prefetch_depth: int = 2,
        fsdp2_forward_prefetch_depth: int = 1,
        reshard_after_forward: bool | None = None,
        frozen_multimodal_sharding: str = "root",
        ignored_multimodal_params: set[nn.Parameter] | None = None,
    ) -> None:
        """Wrap the model's submodules into FSDP2 units (one per layer-container element).

        Override to change how parameters are grouped into units without reimplementing the
        surrounding TP / AC / mixed-precision flow; override `_fully_shard_module` for a different
        primitive. The root is wrapped afterwards by the flow.
        """
        apply_fsdp_sharding(
            module,
            mesh,
            mp_policy=mp_policy,
            offload_policy=offload_policy,
            reshard_after_forward=reshard_after_forward,
            enable_prefetch=enable_fsdp2_prefetch,
            forward_prefetch_depth=fsdp2_forward_prefetch_depth,
            backward_prefetch_depth=fsdp2_backward_prefetch_depth,
            frozen_multimodal_sharding=frozen_multimodal_sharding,
            ignored_params=ignored_multimodal_params,
            shard_fn=self._fully_shard_module,
        )

    def _fully_shard_module(self, module: nn.Module | list[nn.Module], **kwargs: Any) -> nn.Module:
        """Apply the FSDP2 primitive used by this sidecar (``torch.distributed.fsdp.fully_shard``)."""
        return fully_shard(module, **kwargs)

    def _fully_shard_untied_input_output_embeddings(
        self,
        model: nn.Module,
        mesh: DeviceMesh,
        mp_policy: MixedPrecisionPolicy | None,
        offload_policy: OffloadPolicy | None,
        input_reshard_after_forward: bool,
        layer_groups: list[LayerGroup] | None = None,
    ) -> None:
        """Give large trainable untied embedding tables their own FSDP units.

        Keeps the root unit's gradient reduce-scatter buffer bounded by the larger table rather
        than the sum of both; tied and frozen tables are left alone.
        """
        fully_shard_untied_embeddings(
            model,
            mesh,
            mp_policy=mp_policy,
            offload_policy=offload_policy,
            input_reshard_after_forward=input_reshard_after_forward,
            shard_fn=self._fully_shard_module,
            layer_groups=layer_groups,
        )

    def _use_full_layer_activation_checkpointing(self, model: nn.Module) -> bool:
        """Return whether this model opts into whole-layer (instead of per-submodule) checkpointing."""
        return False

    def _validate_tp_mesh(self, model: nn.Module, tp_mesh: DeviceMesh) -> None:
        """Validate the model's attention topology (heads, KV heads) against its TP mesh."""
        validate_tp_mesh(model, tp_mesh.size())

    def _finalize_tp_plan(self, model: nn.Module, plan: TPPlan) -> TPPlan:
        """Return the resolved TP plan, adjusted for this model (default: unchanged)."""
        return plan

    def _checkpoint_activations(
        self, model: nn.Module, groups: list[LayerGroup], mesh_context: MeshContext
    ) -> int:
        """Checkpoint ``groups`` per the context's mode and scope and this sidecar's whole-layer policy."""
        return apply_activation_checkpointing(
            model,
            groups,
            mode=mesh_context.activation_checkpointing,
            scope=mesh_context.strategy_config.activation_checkpointing_scope,
            whole_layer=self._use_full_layer_activation_checkpointing(model),
        )
