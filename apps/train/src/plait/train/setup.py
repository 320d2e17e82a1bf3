"""From a recipe to a parallelized, materialised model: strategy config, sizes, mesh, model.

Everything that can be checked without a process group is checked in :func:`check_recipe`, so a
bad recipe fails on every rank (and in the local launcher) before any collective.
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

from plait.mesh import (
    MeshContext,
    MoEConfig,
    ParallelismSizes,
    StrategyConfig,
    check_combination,
    combination_request,
    plan_meshes,
    strategy_config_from_dict,
)
from plait.sidecar import check_chunked_loss_model, model_features, parallelize_model
from plait.train.checks import check_data, check_devices, check_vocabulary
from plait.train.config import Recipe
from plait.train.errors import phase
from plait.train.init import clean_fqn, materialize, materializing, progress
from plait.train.models import build_model
from plait.train.pipelining import check_pipeline_recipe
from plait.train.pretrained import check_pretrained, load_pretrained, loading_text

__all__ = [
    "build_mesh_context",
    "build_parallel_model",
    "check_recipe",
    "freeze_vision_tower",
    "parallelism_sizes",
    "strategy_config",
]


def strategy_config(recipe: Recipe) -> StrategyConfig:
    """The plait.mesh strategy config of the recipe (``parallel.options`` read strictly by plait.mesh)."""
    p = recipe.parallel
    options = dict(p.options)
    if p.strategy != "ddp":
        options.setdefault("sequence_parallel", p.sequence_parallel and p.tp_size > 1)
    if p.strategy == "fsdp2":
        if p.mixed_precision == "fp32":
            options.setdefault("mp_policy", None)
        options.setdefault("enable_compile", p.compile)
        if p.float8 not in (None, False):
            options["float8"] = p.float8
    elif p.float8 not in (None, False):
        raise ValueError(
            f"parallel.float8 needs parallel.strategy 'fsdp2' (got {p.strategy!r}): float8 is a step of the "
            "FSDP2 flow; set parallel.float8: null or use fsdp2"
        )
    elif p.mixed_precision != "fp32":
        raise ValueError(
            f"parallel.mixed_precision {p.mixed_precision!r} needs parallel.strategy 'fsdp2' "
            f"(got {p.strategy!r}); use mixed_precision: fp32"
        )
    return strategy_config_from_dict(p.strategy, options)


def parallelism_sizes(recipe: Recipe) -> ParallelismSizes:
    """The recipe's sizes (``dp_size`` None = inferred from the world size)."""
    p = recipe.parallel
    return ParallelismSizes(
        dp_size=p.dp_size,
        dp_replicate_size=p.dp_replicate_size,
        tp_size=p.tp_size,
        ep_size=p.ep_size,
        cp_size=p.cp_size,
        pp_size=p.pp_size,
    )


def check_recipe(recipe: Recipe, world_size: int, *, devices: bool = True) -> StrategyConfig:
    """Validate everything that needs no process group; return the strategy config.

    ``devices=False`` skips the checks of this machine's GPUs (``plan`` lays out another cluster).

    Raises:
        ValueError / TypeError: an impossible mesh for ``world_size``, a combination the combination
            table refuses (the same line the ranks' plan would give), a strategy option plait.mesh
            rejects, expert parallel on a dense model, a data glob that matches nothing, a model whose
            vocabulary cannot hold the tokens, a CUDA-only setting on a machine without GPUs.
    """
    if devices:
        check_devices(recipe)
    config = strategy_config(recipe)
    meta_model = build_model(recipe.model, "meta")
    if recipe.model.pretrained_path:
        with phase(f"model.pretrained_path {recipe.model.pretrained_path!r}"):
            check_pretrained(meta_model, recipe.model.pretrained_path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan_meshes(config, parallelism_sizes(recipe), world_size=world_size)
    check_combination(
        combination_request(
            config,
            parallelism_sizes(recipe).resolve(
                world_size, allow_pure_replication=recipe.parallel.strategy != "fsdp2"
            ),
            activation_checkpointing=recipe.parallel.activation_checkpointing,
            features=model_features(meta_model),
            compile=recipe.parallel.compile,
        )
    )
    if recipe.parallel.ep_size > 1 and recipe.model.source not in ("moe", "hf"):
        raise ValueError(
            f"parallel.ep_size {recipe.parallel.ep_size} needs an MoE model (model.source: moe or an hf MoE "
            "class), "
            f"got model.source {recipe.model.source!r}"
        )
    _check_sequence_shards(recipe, config)
    _check_loss(recipe, meta_model)
    _check_document_masking(recipe, meta_model)
    check_pipeline_recipe(recipe)
    check_vocabulary(recipe, check_data(recipe))
    return config


def _check_loss(recipe: Recipe, meta_model: nn.Module) -> None:
    """Refuse ``train.loss: chunked`` where it is not built: pipeline stages, Megatron-FSDP, the model."""
    if recipe.train.loss != "chunked":
        return
    p = recipe.parallel
    if p.pp_size > 1:
        raise ValueError(
            f"train.loss 'chunked' with parallel.pp_size {p.pp_size} is not supported (the pipeline's last "
            "stage takes the loss of whole logits); use train.loss: full"
        )
    if p.strategy not in ("fsdp2", "ddp"):
        raise ValueError(
            f"train.loss 'chunked' with parallel.strategy {p.strategy!r} is not supported (tested under "
            "fsdp2 and ddp); use train.loss: full"
        )
    check_chunked_loss_model(meta_model)


def _check_document_masking(recipe: Recipe, meta_model: nn.Module) -> None:
    """Refuse ``data.document_masking`` where the positions would not keep attention in a document."""
    if not recipe.data.document_masking:
        return
    if "multimodal" in model_features(meta_model):
        raise ValueError(
            "data.document_masking is not supported for a multimodal model (its position ids are not one "
            "text sequence's); set data.document_masking: false"
        )
    if recipe.parallel.pp_size > 1:
        raise ValueError(
            f"data.document_masking with parallel.pp_size {recipe.parallel.pp_size} is not supported (the "
            "pipeline stages take the token ids only); use pp_size: 1"
        )
    if recipe.model.source != "hf":
        raise ValueError(
            f"data.document_masking needs a transformers model (model.source: hf), got model.source "
            f"{recipe.model.source!r}: plait's reference decoders would attend across documents"
        )


def _check_sequence_shards(recipe: Recipe, config: StrategyConfig) -> None:
    """Refuse a ``data.seq_len`` that context or sequence parallel cannot split evenly."""
    p, seq_len = recipe.parallel, recipe.data.seq_len
    if p.cp_size > 1 and seq_len % (2 * p.cp_size):
        raise ValueError(
            f"parallel.cp_size {p.cp_size} needs data.seq_len to be a multiple of 2 * cp_size = "
            f"{2 * p.cp_size}, got {seq_len}"
        )
    local = seq_len // p.cp_size
    if getattr(config, "sequence_parallel", False) and p.tp_size > 1 and local % p.tp_size:
        per_cp = f" ({local} per context-parallel rank)" if p.cp_size > 1 else ""
        raise ValueError(
            f"parallel.sequence_parallel shards the sequence over tp_size {p.tp_size}, which does not "
            f"divide data.seq_len {seq_len}{per_cp}; set data.seq_len to a multiple of "
            f"{p.tp_size * p.cp_size} or parallel.sequence_parallel: false"
        )


def freeze_vision_tower(model: nn.Module) -> None:
    """Re-freeze the VLM's ``visual`` tower after wrapping (``reapply_trainability`` hook)."""
    for name, module in model.named_modules():
        if clean_fqn(name) == "visual":
            module.requires_grad_(False)


def build_mesh_context(
    recipe: Recipe, config: StrategyConfig, *, world_size: int | None = None
) -> MeshContext:
    """Build the meshes (a collective: every rank calls this)."""
    p = recipe.parallel
    freeze = recipe.model.source == "vlm" and recipe.model.freeze_vision
    return MeshContext.build(
        config,
        parallelism_sizes(recipe),
        world_size=world_size,
        moe_config=MoEConfig.from_dict(p.moe) if p.ep_size > 1 else None,
        activation_checkpointing=p.activation_checkpointing,
        reapply_trainability=freeze_vision_tower if freeze else None,
    )


def build_parallel_model(
    recipe: Recipe, ctx: MeshContext, device: torch.device, *, materialise: bool = True
) -> nn.Module:
    """Build the model (meta or CPU), parallelize it (its plan compiles the layers when asked), fill the weights.

    With ``model.meta_init`` (and not DDP, which broadcasts real weights when it wraps) the model
    is built on the meta device and only the local shards are allocated after parallelization.
    ``materialise=False`` keeps a meta model meta (the ``plan`` dry run). Rank 0 prints one line
    for materialising and one for loading pretrained weights, each with its size and time.
    """
    cfg = recipe.model
    meta = (cfg.meta_init or not materialise) and recipe.parallel.strategy != "ddp"
    seed = recipe.train.seed
    model = build_model(cfg, "meta" if meta else "cpu")
    if not meta:
        with progress(materializing(model, "cpu", seed)):
            materialize(model, seed=seed, device="cpu")
            model.to(device)
    model = parallelize_model(model, ctx)
    if meta and materialise:
        with progress(materializing(model, device, seed)):
            materialize(model, seed=seed, device=device)
    if cfg.pretrained_path and materialise:
        with (
            phase(f"model.pretrained_path {cfg.pretrained_path!r}"),
            progress(loading_text(cfg.pretrained_path)),
        ):
            load_pretrained(model, cfg.pretrained_path)  # each rank reads only its slices
    return model
