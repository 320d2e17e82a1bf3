"""``plait-train plan --auto``: search the layouts of a recipe's model on a cluster (plait.planner).

The model's sizes come from the recipe (a reference preset or a Hugging Face class and config) or
from a ``config.json``; the cluster from a GPU preset and overrides. ``--write`` turns the best
layout into a recipe the trainer runs as it is.
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import Any

import yaml

from plait.models.presets import preset_arch
from plait.pipeline import PipelineConfig
from plait.planner import GIB, Candidate, Cluster, Layout, ModelShape, SearchResult, search, traffic_by_kind
from plait.train.config import Recipe, recipe_from_dict, to_dict
from plait.train.summary import format_bytes

__all__ = [
    "auto_plan",
    "layout_recipe",
    "parse_pin",
    "shape_from_file",
    "shape_of",
    "write_recipe",
    "layout_of_recipe",
]


def shape_of(recipe: Recipe) -> ModelShape:
    """The recipe model's sizes (reference preset + arch, or the HF class's config with its defaults)."""
    model = recipe.model
    if model.source != "hf":
        return ModelShape.from_config(preset_arch(model.source, model.preset, model.arch))
    import transformers

    from plait.train.tp_blocks import hf_block_layout

    model_class = getattr(transformers, str(model.hf_class))
    config = model_class.config_class(**model.hf_config)
    return dataclasses.replace(ModelShape.from_config(config), **hf_block_layout(model_class, config))


def shape_from_file(path: str) -> ModelShape:
    """Sizes from a Hugging Face ``config.json``."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"--hf-config {path!r}: {err}") from None
    try:
        shape = ModelShape.from_config(data)
    except (TypeError, KeyError) as err:
        raise ValueError(
            f"--hf-config {path!r} lacks a decoder size ({err}); give a decoder's config.json"
        ) from None
    return dataclasses.replace(shape, **_file_block_layout(data))


def _file_block_layout(data: dict[str, Any]) -> dict[str, bool]:
    """The TP block layout of the file's ``model_type`` where transformers builds it as a causal LM; else Llama-style."""
    import transformers

    from plait.train.tp_blocks import hf_block_layout

    fields = {k: v for k, v in data.items() if k != "model_type"}
    try:
        config = transformers.AutoConfig.for_model(str(data.get("model_type")), **fields)
        model_class = transformers.MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    except (ValueError, KeyError):
        return {}
    return hf_block_layout(model_class, config)


def layout_of_recipe(recipe: Recipe, world_size: int, *, cpu: bool = False) -> Layout:
    """The :class:`Layout` a recipe runs on ``world_size`` ranks (what the planner prices for it).

    ``cpu``: the ranks are CPUs, whose attention kernel keeps K/V repeated to every query head.
    """
    par, options = recipe.parallel, recipe.parallel.options
    pipe = PipelineConfig.from_dict(par.pipeline)
    dp = world_size // (par.pp_size * par.cp_size * par.tp_size)
    ac = par.activation_checkpointing
    return Layout(
        seq_len=recipe.data.seq_len,
        micro_batch=recipe.data.micro_batch_size,
        grad_accum=recipe.train.grad_accum,
        pp=par.pp_size,
        pp_schedule=pipe.schedule if par.pp_size > 1 else "1f1b",
        pp_microbatches=pipe.num_microbatches(par.pp_size) if par.pp_size > 1 else 1,
        stages_per_rank=pipe.local_stages if par.pp_size > 1 else 1,
        dp_replicate=par.dp_replicate_size,
        dp_shard=dp // par.dp_replicate_size,
        cp=par.cp_size,
        cp_variant=options.get("cp_attention", "all_gather"),
        tp=par.tp_size,
        sp=par.sequence_parallel and par.tp_size > 1,
        ep=par.ep_size,
        ac={True: "full", False: "none"}.get(ac, ac),
        reshard=options.get("reshard_after_forward", True),
        offload=options.get("offload_policy") not in (None, False),
        bf16=par.mixed_precision == "bf16",
        forward_prefetch=options.get("fsdp2_forward_prefetch_depth", 1),
        backward_prefetch=options.get("fsdp2_backward_prefetch_depth", 1),
        gqa_expanded=cpu,
    )


def parse_pin(text: str) -> dict[str, int]:
    """``pp=4,ep=8`` -> ``{"pp": 4, "ep": 8}``."""
    pin = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, sep, value = part.partition("=")
        if not sep or not value.isdigit():
            raise ValueError(f"--consider {text!r}: write sizes as axis=N, e.g. pp=4,ep=8")
        pin[key] = int(value)
    return pin


def _candidate_lines(c: Candidate, cluster: Cluster) -> list[str]:
    m = c.memory.breakdown()
    parts = ", ".join(f"{k} {m[k] / GIB:.1f}" for k in m if k != "peak" and m[k])
    head = f"  {c.layout.describe()}: peak {m['peak'] / GIB:.1f} GiB"
    if not c.fits:
        return [
            f"{head} -- out of memory by {c.over / GIB:.1f} GiB (usable {cluster.usable_bytes / GIB:.1f})"
        ]
    t = c.time
    assert t is not None
    sent = sum(x.sent() for x in c.collectives)
    return [
        f"{head}; step {t.step:.2f} s, {t.tokens_per_second_per_gpu:,.0f} tokens/s/GPU, MFU {t.mfu:.1%}",
        f"    memory GiB: {parts}",
        f"    sent per step {format_bytes(sent)} ("
        + ", ".join(f"{k} {format_bytes(v)}" for k, v in traffic_by_kind(c.collectives).items())
        + f"); exposed comm {t.exposed_comm:.2f} s, bubble {t.bubble:.2f} s",
    ]


def _rejections(result: SearchResult) -> list[str]:
    lines = [f"rejected {sum(result.rejected.values()):,} of {result.evaluated:,} layouts:"]
    for reason, n in result.rejected.most_common():
        extra = ""
        if reason in result.over_by:
            low, high = result.over_by[reason]
            extra = f" (over by {low / GIB:.1f} to {high / GIB:.1f} GiB)"
        lines.append(f"  {reason}: {n:,}{extra}")
    return lines


def _larger_cluster(shape: ModelShape, cluster: Cluster, global_tokens: int, seq_len: int) -> list[str]:
    """Where nothing fits: the smallest multiple of the node count (up to 16x) on which a layout does."""
    for factor in (2, 4, 8, 16):
        bigger = dataclasses.replace(cluster, nodes=cluster.nodes * factor)
        found = search(shape, bigger, global_tokens=global_tokens, seq_len=seq_len, top=1).candidates
        if found and found[0].fits:
            head = f"fits on {bigger.nodes} nodes ({bigger.world_size} GPUs) at this batch:"
            return [head, *_candidate_lines(found[0], bigger)]
    return [f"no layout fits on up to {cluster.nodes * 16} nodes at this batch"]


def _without_offload(
    shape: ModelShape,
    cluster: Cluster,
    result: SearchResult,
    global_tokens: int,
    seq_len: int,
    pin: dict[str, int],
) -> list[str]:
    """Where the best layout offloads to the CPU: the closest one without, and by how much it is over."""
    if not (result.candidates and result.candidates[0].layout.offload):
        return []
    alone = search(
        shape, cluster, global_tokens=global_tokens, seq_len=seq_len, pin=pin, top=1, offload=False
    )
    if not alone.candidates:
        return []
    return ["  without CPU offload, the closest:", *_candidate_lines(alone.candidates[0], cluster)]


def auto_plan(
    shape: ModelShape,
    cluster: Cluster,
    *,
    global_tokens: int,
    seq_len: int,
    considers: list[dict[str, int]] | None = None,
    top: int = 5,
) -> tuple[str, SearchResult]:
    """The report of ``plan --auto`` and the search behind it (best layout first)."""
    start = time.perf_counter()
    result = search(shape, cluster, global_tokens=global_tokens, seq_len=seq_len, top=top)
    lines = [
        f"plan --auto: {shape.total_params() / 1e9:.2f} B parameters ({shape.active_params() / 1e9:.2f} B active) "
        f"on {cluster.nodes} x {cluster.gpus_per_node} {cluster.gpu} ({cluster.memory_gib:g} GiB, "
        f"{cluster.usable_bytes / GIB:.1f} usable), {global_tokens:,} tokens per step at seq {seq_len}",
        "best layouts (estimated; docs/planner.md states the model and its measured error):"
        if result.candidates and result.candidates[0].fits
        else "no layout fits; the closest:",
    ]
    for c in result.candidates:
        lines += _candidate_lines(c, cluster)
    lines += _without_offload(shape, cluster, result, global_tokens, seq_len, {})
    lines += _rejections(result)
    if not (result.candidates and result.candidates[0].fits):
        lines += _larger_cluster(shape, cluster, global_tokens, seq_len)
    for pin in considers or []:
        pinned = search(shape, cluster, global_tokens=global_tokens, seq_len=seq_len, pin=pin, top=1)
        label = ",".join(f"{k}={v}" for k, v in pin.items())
        if not pinned.candidates:
            reasons = "; ".join(f"{r} ({n})" for r, n in pinned.rejected.most_common(2)) or (
                f"no layout has these sizes on {cluster.world_size} GPUs (pp x dp_replicate x dp_shard x cp x tp "
                "must equal the GPU count)"
            )
            lines.append(f"considered {label}: not legal: {reasons}")
            continue
        lines.append(f"considered {label}: {'best' if pinned.candidates[0].fits else 'closest'}:")
        lines += _candidate_lines(pinned.candidates[0], cluster)
        lines += _without_offload(shape, cluster, pinned, global_tokens, seq_len, pin)
    lines.append(f"searched in {time.perf_counter() - start:.1f} s")
    return "\n".join(lines), result


def _parallel_section(layout: Layout) -> dict[str, Any]:
    parallel: dict[str, Any] = {
        "strategy": "fsdp2",
        "dp_replicate_size": layout.dp_replicate,
        "tp_size": layout.tp,
        "cp_size": layout.cp,
        "pp_size": layout.pp,
        "ep_size": layout.ep,
        "sequence_parallel": layout.sp,
        "activation_checkpointing": {"none": False, "full": "full", "selective": "selective"}[layout.ac],
        "mixed_precision": "bf16" if layout.bf16 else "fp32",
    }
    options: dict[str, Any] = {}
    if layout.reshard is not True:
        options["reshard_after_forward"] = layout.reshard
    if layout.cp > 1:
        options["cp_attention"] = layout.cp_variant
    if layout.offload:
        options["offload_policy"] = "cpu"
    if options:
        parallel["options"] = options
    if layout.pp > 1:
        parallel["pipeline"] = {
            "schedule": layout.pp_schedule,
            "microbatches": layout.pp_microbatches,
            **({"stages_per_rank": layout.stages_per_rank} if layout.stages_per_rank > 1 else {}),
        }
    return parallel


def layout_recipe(base: Recipe, layout: Layout, cluster: Cluster) -> dict[str, Any]:
    """``base`` with ``layout``'s parallel section, batch and launch: plain data for YAML (checked)."""
    data = to_dict(base)
    parallel = {k: v for k, v in data["parallel"].items() if k not in ("dp_size", "pipeline")}
    if layout.ep == 1:
        parallel.pop("moe", None)  # MoEConfig is only read under expert parallel
    section = _parallel_section(layout)
    section["options"] = {**parallel.get("options", {}), **section.get("options", {})}
    data["parallel"] = {**parallel, **section}
    data["data"] = {**data["data"], "seq_len": layout.seq_len, "micro_batch_size": layout.micro_batch}
    data["train"] = {**data["train"], "grad_accum": layout.grad_accum}
    data["launch"] = {**data["launch"], "nproc_per_node": cluster.gpus_per_node}
    recipe_from_dict(data)  # the trainer's own strict mapping: what is written loads
    return data


def write_recipe(path: str, base: Recipe, layout: Layout, cluster: Cluster) -> str:
    """Write the layout's recipe to ``path``; return the line saying so."""
    data = layout_recipe(base, layout, cluster)
    header = (
        f"# plan --auto: {layout.describe()} on {cluster.nodes} x {cluster.gpus_per_node} {cluster.gpu}\n"
    )
    Path(path).write_text(header + yaml.safe_dump(data, sort_keys=False))
    return f"wrote {path}: {layout.describe()} (run it with torchrun on {cluster.world_size} ranks)"
