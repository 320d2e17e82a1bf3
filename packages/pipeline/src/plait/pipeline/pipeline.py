"""`pipeline_model`: split a decoder into stages, parallelize each with the sidecar flow, schedule them."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from types import MappingProxyType
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage
from torch.distributed.tensor import DTensor

from plait.cp import check_cp_inputs
from plait.mesh import MeshContext, clip_grad_norm_
from plait.pipeline.config import PipelineConfig
from plait.pipeline.schedules import SCHEDULES, build_schedule, local_stage_indices
from plait.pipeline.split import (
    StageSpec,
    StageUnion,
    build_stage_module,
    check_untied_across_stages,
    find_decoder_parts,
    plan_stages,
    stage_tp_entries,
)
from plait.pipeline.stage_context import check_context, stage_context
from plait.sidecar import ParallelPlan, get_model_parallelizer, parallelize_model, plan_parallelism

__all__ = ["Pipeline", "pipeline_model"]

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class Pipeline:
    """This rank's pipeline stages and their schedule.

    ``step(inputs, labels)`` runs forward and backward over all microbatches and returns the loss
    (mean over microbatches) on every rank; gradients are left on the local stage parameters for
    the optimizer, averaged over microbatches exactly as one full-batch backward would give.
    """

    def __init__(
        self,
        modules: list[nn.Module],
        stage_indices: list[int],
        specs: list[StageSpec],
        schedule: Any,
        config: PipelineConfig,
        pp_mesh: DeviceMesh,
        device: torch.device,
        forward_kwargs: dict[str, Any],
        state_module: nn.Module,
    ) -> None:
        self.modules = modules
        """The local stage modules (each a pruned copy of the model, parallelized), in stage order."""
        self.stage_indices = stage_indices
        """Global indices of the local stages."""
        self.specs = specs
        """Every stage of the pipeline with the layers it runs (the same list on every rank)."""
        self.config = config
        self._schedule = schedule
        self._pp_group = pp_mesh.get_group()
        self._pp_size = pp_mesh.size()
        self._device = device
        self._forward_kwargs = dict(forward_kwargs)
        self._state_module = state_module
        num_stages = len(specs)
        self._has_first = 0 in stage_indices
        self._has_last = num_stages - 1 in stage_indices
        self._loss_owner = 0 if SCHEDULES[config.schedule].v_shape else self._pp_size - 1
        self.microbatches = config.num_microbatches(self._pp_size)

    @property
    def pp_group(self) -> dist.ProcessGroup:
        """The process group linking the stages (one rank per stage position)."""
        return self._pp_group

    def parameters(self) -> Iterator[nn.Parameter]:
        """Every parameter of the local stages (for the optimizer)."""
        for module in self.modules:
            yield from module.parameters()

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """Local parameters under the full model's names."""
        for module in self.modules:
            yield from module.named_parameters()

    def clip_grad_norm_(self, max_norm: float | None) -> torch.Tensor:
        """Clip the gradients of all stages to one global norm (DTensor-aware); return the norm before."""
        return clip_grad_norm_(list(self.parameters()), max_norm, extra_group=self._pp_group)

    def state_module(self) -> nn.Module:
        """The local stages as one module with the full model's names (for DCP's state-dict helpers).

        ``get_model_state_dict(pipe.state_module())`` / ``get_optimizer_state_dict(pipe.state_module(),
        optimizer)`` give this rank's part of the full model's state; its ``parameters()`` are the
        pipeline's. It has no forward.
        """
        return self._state_module

    def train(self, mode: bool = True) -> Pipeline:
        for module in self.modules:
            module.train(mode)
        return self

    def _check_batch(
        self, inputs: torch.Tensor, labels: torch.Tensor, model_kwargs: dict[str, torch.Tensor]
    ) -> dict[str, Any]:
        """The forward keyword arguments of every stage: the fixed ones and this batch's tensors."""
        if not isinstance(inputs, torch.Tensor) or not isinstance(labels, torch.Tensor):
            raise TypeError(
                "Pipeline.step(inputs, labels) takes tensors on every rank, got "
                f"{type(inputs).__name__} and {type(labels).__name__}"
            )
        batch = inputs.shape[0]
        if labels.shape[0] != batch:
            raise ValueError(f"inputs batch {batch} and labels batch {labels.shape[0]} differ")
        for name, value in model_kwargs.items():
            if not isinstance(value, torch.Tensor) or value.dim() == 0 or value.shape[0] != batch:
                got = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
                raise ValueError(
                    f"Pipeline.step keyword {name!r} must be a tensor of batch {batch} (split into "
                    f"microbatches with the inputs), got {got}"
                )
        if batch % self.microbatches:
            raise ValueError(
                f"the batch of {batch} samples does not split into microbatches={self.microbatches}; "
                "choose a batch size that is a multiple of the microbatch count."
            )
        kwargs = {**self._forward_kwargs, **{k: v.to(self._device) for k, v in model_kwargs.items()}}
        for module in self.modules:  # every rank, before the schedule: later stages would wait instead
            check_cp_inputs(module, kwargs)
        return kwargs

    def step(self, inputs: torch.Tensor, labels: torch.Tensor, **model_kwargs: torch.Tensor) -> torch.Tensor:
        """One forward + backward over the batch; return the loss (a detached fp32 scalar) on every rank.

        Every rank passes the same ``inputs`` and ``labels`` (the data of its data-parallel replica);
        only the first stage reads the inputs and only the last the labels. ``model_kwargs`` are
        batch-first tensors every stage's forward takes, split into microbatches with the inputs:
        under context parallel, the ``position_ids`` (and document ids) of ``plait.cp.shard_sequence``.
        """
        kwargs = self._check_batch(inputs, labels, model_kwargs)
        args = (inputs.to(self._device),) if self._has_first else ()
        target = labels.to(self._device) if self._has_last else None
        losses: list[torch.Tensor] = []
        self._schedule.step(*args, target=target, losses=losses if self._has_last else None, **kwargs)
        return self._share_loss(losses)

    @torch.no_grad()
    def evaluate(
        self, inputs: torch.Tensor, labels: torch.Tensor, **model_kwargs: torch.Tensor
    ) -> torch.Tensor:
        """Forward only (no gradients); return the loss on every rank. ``model_kwargs`` as in `step`."""
        kwargs = self._check_batch(inputs, labels, model_kwargs)
        args = (inputs.to(self._device),) if self._has_first else ()
        target = labels.to(self._device) if self._has_last else None
        losses: list[torch.Tensor] = []
        self._schedule.eval(*args, target=target, losses=losses if self._has_last else None, **kwargs)
        return self._share_loss(losses)

    def _share_loss(self, losses: list[torch.Tensor]) -> torch.Tensor:
        if self._has_last and self._pp_rank() == self._loss_owner:
            loss = torch.stack([item.detach().float() for item in losses]).mean()
        else:
            loss = torch.zeros((), dtype=torch.float32, device=self._device)
        dist.broadcast(loss, group=self._pp_group, group_src=self._loss_owner)
        return loss

    def _pp_rank(self) -> int:
        return dist.get_rank(self._pp_group)

    def state_dict(self) -> dict[str, Any]:
        """The local stages' state under the full model's keys (DTensor values; for torch.distributed.checkpoint)."""
        return self._state_module.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load the local stages' entries of a full-model-keyed ``state_dict`` (other stages' keys are ignored)."""
        own = self._state_module.state_dict().keys()
        missing = sorted(set(own) - set(state_dict))
        if missing:
            raise KeyError(f"state_dict lacks {len(missing)} keys of this rank's stages: {missing[:4]}")
        self._state_module.load_state_dict({k: state_dict[k] for k in own})


def _unwrap_output(loss_fn: LossFn) -> LossFn:
    """The loss on plain logits: HF models return ``(logits,)``; a TP head returns a vocab-sharded DTensor.

    Sharded logits are gathered (differentiably) so ``loss_fn`` need not know about DTensors or
    ``loss_parallel``, whose backward would have to run inside its context, i.e. inside the schedule.
    """

    def loss(output: Any, target: torch.Tensor) -> torch.Tensor:
        if isinstance(output, tuple | list):
            output = output[0]
        if isinstance(output, DTensor):
            output = output.full_tensor()
        return loss_fn(output, target)

    return loss


def _stage_forward_kwargs(module: nn.Module) -> dict[str, Any]:
    """Hugging Face models: no KV cache, tuple outputs (a pipeline stage sends tensors, not ModelOutput).

    ``return_dict=False`` goes to the outer forward only (the inner backbone still returns its
    ModelOutput to it); our reference models take no such argument. An MoE model's router logits
    stay inside its stage (a stage sends hidden states only; the schedule's loss reads logits, as the
    trainer's loss does without pipelining).
    """
    config = getattr(module, "config", None)
    if config is None or not hasattr(config, "return_dict"):
        return {}
    config.use_cache = False
    kwargs: dict[str, Any] = {"return_dict": False}
    if getattr(config, "output_router_logits", False):
        kwargs["output_router_logits"] = False
    return kwargs


def _device_of(mesh: DeviceMesh) -> torch.device:
    if mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(mesh.device_type)


def pipeline_model(
    model: nn.Module,
    mesh_context: MeshContext,
    loss_fn: LossFn,
    config: PipelineConfig | None = None,
) -> Pipeline:
    """Split ``model`` into ``pp_size x stages_per_rank`` stages and return this rank's `Pipeline`.

    Each local stage is a pruned copy of ``model`` sharing its parameters (state-dict keys of the
    full model), parallelized by ``parallelize_model`` on the mesh without the ``pp`` axis (FSDP
    does not reshard after forward unless configured), then compiled when the config asks. The
    model is consumed: use the pipeline's modules, not ``model``, afterwards.

    Every check runs on every rank before any collective: strategy and mesh, the decoder layout,
    tied embeddings, stages vs layers, and the schedule's microbatch rules.

    Args:
        model: A decoder (HF causal LM or a plait reference model) whose ``forward(input_ids)``
            returns logits.
        mesh_context: A context built with ``pp_size >= 2`` and ``FSDP2Config``.
        loss_fn: ``loss_fn(logits, labels) -> scalar``, a mean over the microbatch.
        config: Schedule and split options; default ``PipelineConfig()`` (1F1B, one stage per rank).
    """
    config = config if config is not None else PipelineConfig()
    check_context(mesh_context)
    assert mesh_context.device_mesh is not None
    pp_size = mesh_context.pp_size
    config.check_for(pp_size)
    sidecar = get_model_parallelizer(model)
    whole = plan_parallelism(model, mesh_context, sidecar)  # refusals and the TP plan, once
    parts = find_decoder_parts(model, sidecar.layer_group_paths)
    check_untied_across_stages(model, parts)
    num_stages = pp_size * config.local_stages
    specs = plan_stages(model, parts, num_stages, list(config.layers_per_stage or ()) or None)
    pp_mesh = mesh_context.device_mesh["pp"]
    indices = local_stage_indices(config.schedule, pp_mesh.get_local_rank(), pp_size, config.local_stages)
    device = _device_of(mesh_context.device_mesh)
    built = [build_stage_module(model, parts, specs[index], num_stages) for index in indices]
    forward_kwargs = _stage_forward_kwargs(model)
    modules = _parallelize_stages(built, whole, mesh_context, pp_mesh)  # first collective
    get_mesh = _mesh_lookup(mesh_context)
    stages = [
        PipelineStage(module, index, num_stages, device, group=pp_mesh.get_group(), get_mesh=get_mesh)
        for module, index in zip(modules, indices, strict=True)
    ]
    schedule = build_schedule(
        config.schedule, stages, config.num_microbatches(pp_size), _unwrap_output(loss_fn)
    )
    union = StageUnion(modules, parts)
    return Pipeline(
        modules,
        indices,
        specs,
        schedule,
        config,
        pp_mesh,
        device,
        forward_kwargs,
        union,
    )


def _mesh_lookup(mesh_context: MeshContext) -> Callable[[tuple[str, ...], Any], DeviceMesh | None]:
    """The mesh of a DTensor a stage receives, by its dim names (sequence parallel: ``Shard(1)`` on ``tp``).

    Every pp rank slices its meshes from the same world mesh, so the sending stage's ``tp`` mesh has
    the receiving rank's counterpart under the same name.
    """

    def get_mesh(mesh_dim_names: tuple[str, ...], _layout: Any) -> DeviceMesh | None:
        world = mesh_context.device_mesh
        assert world is not None
        try:
            return world[tuple(mesh_dim_names)]
        except (KeyError, RuntimeError, ValueError):
            return None

    return get_mesh


def _parallelize_stages(
    built: list[nn.Module], whole: ParallelPlan, mesh_context: MeshContext, pp_mesh: DeviceMesh
) -> list[nn.Module]:
    """Plan and run the sidecar flow on each local stage; an error on any stage is raised on every rank.

    Each stage's plan is made from the whole model's (its TP entries, no resharding after forward).
    Stages differ per pp rank, so one stage can fail where another succeeds: the ranks agree over
    the pp group before any rank enters the schedule's collectives, instead of leaving peers hanging.
    """
    modules: list[nn.Module] = []
    error: BaseException | None = None
    try:
        ctx = stage_context(mesh_context)
        for stage in built:
            cut = dataclasses.replace(whole, tp_plan=MappingProxyType(stage_tp_entries(whole.tp_plan, stage)))
            plan = plan_parallelism(stage, ctx, get_model_parallelizer(stage), stage_of=cut)
            modules.append(parallelize_model(stage, ctx, plan=plan))
    except Exception as exc:
        error = exc
    ok = torch.tensor([0 if error else 1], dtype=torch.int32, device=_device_of(pp_mesh))
    dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=pp_mesh.get_group())
    if error is not None:
        raise error
    if not ok.item():
        raise RuntimeError(
            "parallelizing a pipeline stage failed on another pp rank (its error names the cause); "
            "no stage was scheduled."
        )
    return modules
