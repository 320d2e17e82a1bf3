"""`ModelParallelizer`: the model-owned sidecar whose hooks shape the one shared FSDP2 flow (dense and MoE)."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor.parallel import ParallelStyle

from plait.cp import apply_context_parallel
from plait.float8 import apply_float8
from plait.sharding import (
    LayerGroup,
    apply_activation_checkpointing,
    apply_fsdp_sharding,
    fully_shard_root,
    fully_shard_untied_embeddings,
)
from plait.sidecar.compile import compile_layers
from plait.sidecar.parallel_plan import ParallelPlan
from plait.sidecar.plan import plan_parallelism
from plait.strategies import (
    apply_expert_parallel,
    shard_experts,
    shard_megatron_fsdp,
    shard_moe_lm_head,
    shard_top_children,
    wrap_ddp,
)
from plait.tp import apply_tp, enable_async_tp, validate_tp_mesh

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
        return self._apply(model, mesh_context, plan_parallelism(model, mesh_context, self))

    def _apply(
        self, model: nn.Module, mesh_context: MeshContext, plan: ParallelPlan | None = None
    ) -> nn.Module:
        """The one flow, every strategy: gated steps over the plan, in the order docs/architecture.md gives."""
        plan = plan if plan is not None else plan_parallelism(model, mesh_context, self)
        if plan.float8:  # first: TP styles, checkpoint wrappers and FSDP units see the float8 linears
            apply_float8(model, plan.float8)
        if plan.cp:
            apply_context_parallel(model, mesh_context, variant=plan.cp_attention)
        if plan.tp:
            apply_tp(
                model, mesh_context.tp_mesh(), copy.deepcopy(dict(plan.tp_plan))
            )  # the plan stays as made
        if plan.async_tp:
            enable_async_tp(mesh_context.tp_mesh(), sequence_parallel=plan.sequence_parallel)
        if plan.ep:
            apply_expert_parallel(plan.moe_blocks, mesh_context.ep_mesh())
        if plan.ac_mode:
            self._checkpoint_activations(model, list(plan.layer_groups), mesh_context, plan)
        if mesh_context.reapply_trainability is not None:
            mesh_context.reapply_trainability(model)
        if plan.strategy == "ddp":
            return wrap_ddp(model, mesh_context)
        if plan.strategy == "megatron_fsdp":
            return shard_megatron_fsdp(model, mesh_context)
        if plan.shard:
            model = self._shard(model, mesh_context, plan)
        if plan.compile:
            compile_layers(model, self.layer_group_paths)
        return model

    def _shard(self, model: nn.Module, mesh_context: MeshContext, plan: ParallelPlan) -> nn.Module:
        """Create the plan's FSDP units: experts, layers (the hook), MoE head, untied tables, root."""
        cfg, mesh = mesh_context.strategy_config, mesh_context.fsdp_mesh()
        experts = [u for u in plan.fsdp_units if u.role == "experts"]
        if experts:
            shard_experts(
                plan.moe_blocks,
                mesh_context,
                shard_fn=self._fully_shard_module,
                reshard_after_forward=experts[0].reshard_after_forward,
            )
        self._apply_fsdp_sharding(
            model,
            mesh,
            cfg.mp_policy,
            cfg.offload_policy,
            enable_fsdp2_prefetch=cfg.enable_fsdp2_prefetch,
            fsdp2_backward_prefetch_depth=cfg.fsdp2_backward_prefetch_depth,
            fsdp2_forward_prefetch_depth=cfg.fsdp2_forward_prefetch_depth,
            reshard_after_forward=plan.layer_reshard_after_forward,
            frozen_multimodal_sharding=cfg.frozen_multimodal_sharding,
            ignored_multimodal_params=set(plan.ignored_params),
        )
        shard_moe_lm_head(model, mesh_context, shard_fn=self._fully_shard_module)
        inputs = [u for u in plan.fsdp_units if u.role == "input_embedding"]
        self._fully_shard_untied_input_output_embeddings(
            model,
            mesh,
            cfg.mp_policy,
            cfg.offload_policy,
            input_reshard_after_forward=bool(inputs[0].reshard_after_forward) if inputs else True,
            layer_groups=list(plan.layer_groups),
        )
        if plan.fsdp_units[-1].role == "child":
            return shard_top_children(model, mesh_context, shard_fn=self._fully_shard_module)
        return fully_shard_root(
            model,
            mesh,
            mp_policy=cfg.mp_policy,
            offload_policy=cfg.offload_policy,
            ignored_params=set(plan.ignored_params),
            shard_fn=self._fully_shard_module,
        )

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
        self,
        model: nn.Module,
        groups: list[LayerGroup],
        mesh_context: MeshContext,
        plan: ParallelPlan | None = None,
    ) -> int:
        """Checkpoint ``groups`` as the plan says (mode, scope, whole layers, the ops saved inside routers).

        Without a plan: the context's mode and scope and this sidecar's whole-layer policy.
        """
        if plan is None:
            plan = plan_parallelism(model, mesh_context, self)
        return apply_activation_checkpointing(
            model,
            groups,
            mode=plan.ac_mode or False,
            scope=plan.ac_scope or "all",
            whole_layer=plan.ac_whole_layer,
            save_inside=[model.get_submodule(fqn) for fqn in plan.ac_save_inside],
        )

    def _adjust_plan(self, model: nn.Module, mesh_context: MeshContext, plan: ParallelPlan) -> ParallelPlan:
        """Return the plan to apply (default: unchanged); a sidecar may replace decisions here."""
        return plan

    def _finalizes_tp_plan(self) -> bool:
        """Whether this sidecar overrides `_finalize_tp_plan` (its plan is then not the model's default)."""
        return type(self)._finalize_tp_plan is not ModelParallelizer._finalize_tp_plan
