"""Pipeline-parallel training (``parallel.pp_size > 1``): recipe checks, building the pipeline, the plan's stages.

The trainer keeps its loss arithmetic: ``loss_fn`` returns each microbatch's token-loss sum times
a per-step factor, chosen so that after the schedule's ``1 / microbatches`` scaling every rank
back-propagates exactly what the non-pipelined step does (see ``Trainer._pipeline_backward``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from plait.mesh import MeshContext
from plait.pipeline import Pipeline, PipelineConfig, find_decoder_parts, pipeline_model, plan_stages
from plait.train.config import Recipe
from plait.train.init import SafetensorsSource, materialize, materializing, progress
from plait.train.models import build_model
from plait.train.summary import format_bytes

__all__ = ["build_pipeline", "check_pipeline_recipe", "pipeline_config", "stages_text"]


def pipeline_config(recipe: Recipe) -> PipelineConfig | None:
    """The recipe's ``parallel.pipeline`` options as a `PipelineConfig`; None when ``pp_size`` is 1.

    Raises:
        ValueError: pipeline options given with ``pp_size: 1`` (they would be ignored), or bad options.
    """
    p = recipe.parallel
    if p.pp_size == 1:
        if p.pipeline:
            raise ValueError(
                f"parallel.pipeline {p.pipeline} is set but parallel.pp_size is 1; set pp_size > 1 or "
                "remove parallel.pipeline"
            )
        return None
    return PipelineConfig.from_dict(p.pipeline)


def check_pipeline_recipe(recipe: Recipe) -> None:
    """The recipe's pipeline settings and stage split, before any collective (every rank).

    Strategies and models pipeline stages do not build with are refused by the combination table
    (``plan_meshes`` and the plan), with the same line as a run.
    """
    config = pipeline_config(recipe)
    if config is None:
        return
    p = recipe.parallel
    config.check_for(p.pp_size)
    m = config.num_microbatches(p.pp_size)
    if recipe.data.micro_batch_size % m:
        raise ValueError(
            f"data.micro_batch_size {recipe.data.micro_batch_size} does not split into "
            f"parallel.pipeline.microbatches={m}; use a multiple of {m}"
        )
    model = build_model(recipe.model, "meta")
    plan_stages(model, find_decoder_parts(model), p.pp_size * config.local_stages, _counts(config))


def _counts(config: PipelineConfig) -> list[int] | None:
    return list(config.layers_per_stage) if config.layers_per_stage else None


def build_pipeline(
    recipe: Recipe,
    ctx: MeshContext,
    device: torch.device,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    *,
    materialise: bool = True,
) -> Pipeline:
    """Build the model (meta or CPU), split and parallelize it, and fill the local stages' weights."""
    cfg = recipe.model
    meta = cfg.meta_init or not materialise
    source = SafetensorsSource(cfg.pretrained_path) if cfg.pretrained_path else None
    seed = recipe.train.seed
    model = build_model(cfg, "meta" if meta else "cpu")
    what = " (from model.pretrained_path)" if source is not None else ""
    if not meta:
        with progress(materializing(model, "cpu", seed) + what):
            materialize(model, seed=seed, device="cpu", source=source)
            model.to(device)
    pipe = pipeline_model(model, ctx, loss_fn, pipeline_config(recipe))
    if meta and materialise:
        with progress(f"{materializing(pipe.state_module(), device, seed)}{what}, rank 0's stages"):
            for module in pipe.modules:  # full-model names: each stage gets the same values as at pp=1
                materialize(module, seed=seed, device=device, source=source)
    return pipe


def stages_text(recipe: Recipe, pipe: Pipeline, ctx: MeshContext) -> str:
    """Every stage: its pp rank, layers, parameters, and fp32 memory per rank (params, grads, AdamW)."""
    model = build_model(recipe.model, "meta")
    parts = find_decoder_parts(model)
    layers = model.get_submodule(parts.layers)
    shards = max(1, ctx.fsdp_mesh().size() * ctx.tp_size)
    lines = [
        f"pipeline: {len(pipe.specs)} stages, schedule {pipe.config.schedule}, {pipe.microbatches} microbatches "
        f"(memory per rank: fp32 params + grads + AdamW over {shards} dp_shard x tp ranks; activations not included)"
    ]
    last = len(pipe.specs) - 1
    for spec in pipe.specs:
        numel = sum(p.numel() for i in spec.layers for p in layers[i].parameters())
        extras = [parts.embedding] if spec.index == 0 else []
        extras += [x for x in (parts.norm, parts.head) if x] if spec.index == last else []
        numel += sum(p.numel() for x in extras for p in model.get_submodule(x).parameters())
        rank = _stage_rank(pipe, spec.index, ctx.pp_size)
        lines.append(
            f"  stage {spec.index} (pp rank {rank}): layers {spec.layers[0]}-{spec.layers[-1]}"
            f"{' + ' + ', '.join(extras) if extras else ''}: {numel:,} params, "
            f"~{format_bytes(numel * 16 / shards)} per rank"
        )
    return "\n".join(lines)


def _stage_rank(pipe: Pipeline, index: int, pp_size: int) -> int:
    if pipe.config.schedule == "zbv_zero_bubble":
        return index if index < pp_size else 2 * pp_size - 1 - index
    return index % pp_size
