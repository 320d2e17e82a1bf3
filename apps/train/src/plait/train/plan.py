"""``plait-train plan`` and ``validate``: a dry run on torch's fake process group — no ranks, no weights.

The model is built on the meta device, planned and parallelized exactly as in training (the same
`plan_parallelism`, so ``validate`` refuses what a run refuses, with the same line), in one process
that plays rank 0 of ``world_size`` ranks. ``plan`` prints the plan the flow applied, and reads the
resulting shard layout: memory
per rank (parameters, gradients, AdamW state, by dtype; rank 0 holds the largest ``torch.chunk``
shard, so it is the maximum), the FSDP units, the TP placements, and an estimate of the bytes
each rank sends per optimizer step. Activations are not included.
"""

from __future__ import annotations

import contextlib
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from plait.mesh import FSDP2Config, MeshContext, StrategyConfig
from plait.sidecar import ParallelPlan, get_parallel_plan, plan_parallelism
from plait.train.config import Recipe
from plait.train.models import build_model
from plait.train.pipelining import build_pipeline, stages_text
from plait.train.plan_cp import cp_bytes, cp_text, model_dims
from plait.train.setup import build_mesh_context, build_parallel_model, check_recipe
from plait.train.summary import (
    describe_mesh,
    format_bytes,
    fsdp_unit_modules,
    layout_of,
    model_class_name,
    pattern_of,
)

__all__ = [
    "MAX_WORLD_SIZE",
    "CommEstimate",
    "batch_assumed",
    "DryRun",
    "comm_estimate",
    "dry_run",
    "fake_group",
    "plan",
    "validate",
]

MAX_WORLD_SIZE = 16_384


def _bytes(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype, device="meta").element_size()


def _unit_local_numel(model: nn.Module) -> dict[str, int]:
    """Local elements each FSDP unit manages (its modules' parameters minus those of nested units)."""
    modules = {name: m for name, m in model.named_modules() if isinstance(m, FSDPModule)}
    owned: Counter[str] = Counter()
    for pname, param in model.named_parameters():
        owner = max((u for u in modules if u == "" or pname.startswith(u + ".")), key=len, default=None)
        if owner is not None:
            owned[owner or "<root>"] += (param.to_local() if isinstance(param, DTensor) else param).numel()
    return {"+".join(names): sum(owned[n] for n in names) for names in fsdp_unit_modules(model).values()}


def _regathered_in_backward(model: nn.Module) -> set[str]:
    """Units whose parameters are all-gathered again in backward (resharded after forward)."""
    found = set()
    for names in fsdp_unit_modules(model).values():
        first = model if names[0] == "<root>" else model.get_submodule(names[0])
        group = first._get_fsdp_state()._fsdp_param_group  # torch keeps these settings private
        if group is not None and group.post_forward_mesh_info is not None and group.unshard_in_backward:
            found.add("+".join(names))
    return found


@dataclass
class CommEstimate:
    """Bytes one rank sends per optimizer step, by collective."""

    fsdp_all_gather: float = 0.0
    fsdp_reduce_scatter: float = 0.0
    hsdp_all_reduce: float = 0.0
    ddp_all_reduce: float = 0.0
    tp_activations: float = 0.0
    ep_all_to_all: float = 0.0
    cp_attention: float = 0.0

    @property
    def total(self) -> float:
        return sum(vars(self).values())

    def text(self, assumes: str = "") -> str:
        """The total and each collective; ``assumes`` names the batch the figure is for."""
        rows = [f"  {k}: {format_bytes(v)}" for k, v in vars(self).items() if v]
        where = f"; {assumes}" if assumes else ""
        return "\n".join(
            [f"communication per step (sent by one rank, estimate{where}): {format_bytes(self.total)}", *rows]
        )


def batch_assumed(recipe: Recipe, ctx: MeshContext, world_size: int) -> str:
    """The batch a per-step traffic figure is for: micro-batch x sequence, micro-batches, global batch."""
    data, accum = recipe.data, recipe.train.grad_accum
    dp = ctx.dp_size or world_size
    return (
        f"micro-batch {data.micro_batch_size} x seq {data.seq_len} tokens, {accum} micro-batch"
        f"{'es' if accum != 1 else ''} per step (train.grad_accum), global batch "
        f"{data.micro_batch_size * dp * accum} sequences over dp {dp}"
    )


def comm_estimate(
    model: nn.Module,
    ctx: MeshContext,
    recipe: Recipe,
    world_size: int,
    *,
    cp_model: nn.Module | None = None,
    local_layers: int | None = None,
) -> CommEstimate:
    """Estimate per-step traffic from the shard layout (ring collectives: (n-1)/n of the buffer).

    ``cp_model``: the model whose sizes and attention the per-layer terms read when ``model`` is not
    one (a pipeline rank's `StageUnion`), and ``local_layers`` the layers that rank holds.
    """
    est = CommEstimate()
    cfg = ctx.strategy_config
    accum = recipe.train.grad_accum
    full_trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    if ctx.device_mesh is None:
        est.ddp_all_reduce = 2 * (world_size - 1) / world_size * full_trainable * 4
        return est
    mp = getattr(cfg, "mp_policy", None)
    gather_bytes = _bytes(mp.param_dtype) if mp is not None and mp.param_dtype is not None else 4
    reduce_bytes = _bytes(mp.reduce_dtype) if mp is not None and mp.reduce_dtype is not None else 4
    fsdp = ctx.fsdp_mesh() if isinstance(cfg, FSDP2Config) else None
    if fsdp is not None and fsdp.size() > 1:
        shard = fsdp.size(fsdp.ndim - 1)
        replicas = fsdp.size(0) if fsdp.ndim == 2 else 1
        units = _unit_local_numel(model)
        shard_total = sum(units.values())
        regathered = sum(units[u] for u in _regathered_in_backward(model))
        # forward gathers every unit; backward again those resharded after forward.
        gathers = (shard_total + regathered) * accum
        est.fsdp_all_gather = (shard - 1) * gathers * gather_bytes
        est.fsdp_reduce_scatter = (shard - 1) * shard_total * reduce_bytes
        if replicas > 1:
            est.hsdp_all_reduce = 2 * (replicas - 1) / replicas * shard_total * reduce_bytes
    hidden, layers, top_k = model_dims(cp_model or model)
    layers = layers if local_layers is None else local_layers
    tokens = recipe.data.micro_batch_size * recipe.data.seq_len
    act_bytes = 2 if recipe.parallel.mixed_precision == "bf16" else 4
    activation = tokens * hidden * act_bytes
    passes = 3 if ctx.activation_checkpointing else 2  # forward, backward (+ recompute)
    if ctx.tp_size > 1:
        t = ctx.tp_size
        per_collective = (t - 1) / t * activation
        # Per layer and pass: 2 all-gathers + 2 reduce-scatters with SP, or 2 all-reduces (each costs
        # an all-gather + a reduce-scatter) without: the same 4 ring passes over the activation.
        est.tp_activations = layers * passes * 4 * per_collective * accum
    if ctx.cp_size > 1:
        est.cp_attention = cp_bytes(cp_model or model, ctx, recipe) * layers * accum
    if ctx.ep_size > 1:
        e = ctx.ep_size
        est.ep_all_to_all = (
            layers * passes * 2 * (e - 1) / e * tokens * max(top_k, 1) * hidden * act_bytes * accum
        )
    return est


def _memory_text(model: nn.Module) -> str:
    layout = layout_of(model)
    lines = ["memory per rank (rank 0, the largest shard; activations not included):"]
    total = 0.0
    for what, counts, factor in (
        ("parameters", layout.local_params, 1),
        ("gradients", layout.local_trainable, 1),
        ("optimizer (AdamW exp_avg + exp_avg_sq)", layout.local_trainable, 2),
    ):
        for dtype, n in counts.items():
            size = n * factor * _bytes(dtype)
            total += size
            lines.append(
                f"  {what}: {n * factor:,} x {str(dtype).removeprefix('torch.')} = {format_bytes(size)}"
            )
    lines.append(f"  total: {format_bytes(total)}")
    units = _unit_local_numel(model)
    if units:
        biggest = max(units, key=lambda u: units[u])
        lines.append(f"  largest FSDP unit: {pattern_of(biggest)} ({units[biggest]:,} local elements)")
    return "\n".join(lines)


def _layout_text(model: nn.Module, whole_params: int | None) -> str:
    """The layout of rank 0's part; under pipeline parallel its total is the whole model's."""
    layout = layout_of(model)
    if whole_params is not None:
        layout.stage_params, layout.total_params = layout.total_params, whole_params
    return layout.text()


def _no_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    raise AssertionError("plan never runs a step")


@dataclass
class DryRun:
    """What the ranks would build, built on a fake process group with meta tensors (rank 0's part)."""

    ctx: MeshContext
    model: nn.Module
    """The parallelized model (DDP: the plain model, which DDP only wraps)."""
    plans: list[ParallelPlan]
    """The plans the flow applied: one, or one per local pipeline stage (whole model's first)."""
    stages: str | None = None
    """Pipeline parallel: every stage's layers, parameters and memory."""
    whole_params: int | None = None
    """Pipeline parallel: parameters of the whole model (``model`` holds rank 0's stages only)."""
    whole: nn.Module | None = None
    """Pipeline parallel: the unsplit model, whose sizes and attention the per-layer lines read."""
    local_layers: int | None = None
    """Pipeline parallel: the layers of rank 0's stages."""


@contextlib.contextmanager
def fake_group(world_size: int) -> Iterator[None]:
    """Play rank 0 of ``world_size`` ranks on torch's fake process group (no ranks, no traffic)."""
    if not 1 <= world_size <= MAX_WORLD_SIZE:
        raise ValueError(f"--world-size must be in [1, {MAX_WORLD_SIZE}], got {world_size}")
    if dist.is_initialized():
        raise ValueError(
            "plan and validate need their own fake process group; run them outside a distributed job"
        )
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def dry_run(recipe: Recipe, config: StrategyConfig, world_size: int) -> DryRun:
    """Plan and parallelize the recipe's model as rank 0 would (inside :func:`fake_group`).

    Every refusal of a real run is raised here with the same message: the same functions decide.
    """
    ctx = build_mesh_context(recipe, config, world_size=world_size)
    if recipe.parallel.strategy == "ddp":  # DDP wraps real weights: plan only
        model = build_model(recipe.model, "meta")
        return DryRun(ctx, model, [plan_parallelism(model, ctx)])
    if recipe.parallel.pp_size > 1:
        model = build_model(recipe.model, "meta")
        whole = plan_parallelism(model, ctx)
        pipe = build_pipeline(recipe, ctx, torch.device("meta"), _no_loss, materialise=False)
        plans = [whole, *(get_parallel_plan(m) for m in pipe.modules)]
        whole_params = sum(p.numel() for p in model.parameters())
        stages = stages_text(recipe, pipe, ctx)
        local = sum(len(pipe.specs[i].layers) for i in pipe.stage_indices)
        return DryRun(ctx, pipe.state_module(), plans, stages, whole_params, whole=model, local_layers=local)
    model = build_parallel_model(recipe, ctx, torch.device("meta"), materialise=False)
    return DryRun(ctx, model, [get_parallel_plan(model)])


def _model_line(model: nn.Module, recipe: Recipe) -> str:
    """``model <class> (<source>, preset <preset>)``; a Hugging Face model has its class, not a preset."""
    source = recipe.model.source
    detail = source if source == "hf" else f"{source}, preset {recipe.model.preset}"
    return f"model {model_class_name(model)} ({detail})"


def _plan_texts(plans: list[ParallelPlan | None]) -> list[str]:
    """One plan, or the whole model's and then each of rank 0's pipeline stages'."""
    if len(plans) == 1:
        return [plans[0].text()] if plans[0] is not None else []
    titles = [
        "parallel plan (whole model)",
        *(f"parallel plan (local stage {i})" for i in range(len(plans) - 1)),
    ]
    return [p.text(t) for p, t in zip(plans, titles, strict=True) if p is not None]


def validate(recipe: Recipe, world_size: int) -> str:
    """Run every check of a real run on ``world_size`` ranks without starting any; return the ok line.

    Raises:
        ValueError / TypeError / UserError: the line the run would fail with.
    """
    config = check_recipe(recipe, world_size)
    with fake_group(world_size):
        dry_run(recipe, config, world_size)
    return f"recipe {recipe.name}: ok on {world_size} rank(s)"


def plan(recipe: Recipe, world_size: int) -> str:
    """Parallelize the recipe's model on a fake ``world_size``-rank group and report its layout.

    Raises:
        ValueError: ``world_size`` out of range, a process group already running, or a bad recipe.
    """
    config = check_recipe(recipe, world_size, devices=False)
    start = time.perf_counter()
    with fake_group(world_size):
        run = dry_run(recipe, config, world_size)
        model, ctx = run.model, run.ctx
        report = [
            f"plan: recipe {recipe.name} on {world_size} ranks (fake process group, meta tensors)",
            describe_mesh(ctx, world_size),
            _model_line(run.whole or model, recipe),
            *_plan_texts(run.plans),
            _layout_text(model, run.whole_params),
            *([run.stages] if run.stages else []),
            _memory_text(model),
            *([cp_text(run.whole or model, ctx, recipe)] if ctx.cp_size > 1 else []),
            comm_estimate(
                model, ctx, recipe, world_size, cp_model=run.whole, local_layers=run.local_layers
            ).text(batch_assumed(recipe, ctx, world_size)),
            f"planned in {time.perf_counter() - start:.1f} s",
        ]
    return "\n".join(report)
