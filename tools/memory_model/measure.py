"""Measure peak tensor memory and collective bytes of one training step for a list of layouts.

Each layout runs ``plait.testing.memory_probe.run_layout`` on its gloo ranks (CPU): the recipe's
trainer takes one warm-up step, then the next step is measured on every rank with torch's
``MemTracker`` / ``FSDPMemTracker`` (peak bytes by category) and a dispatch mode counting the input
bytes of every collective. The output is a JSON list of ``{"layout": ..., "ranks": [...]}`` (or
``"error"`` instead of ``"ranks"`` when a layout fails), with each layout's wall time.

    uv run python tools/memory_model/measure.py --out tools/memory_model/measured.json
    uv run python tools/memory_model/measure.py --out /tmp/m.json --only fsdp2_w2_ac_none --only tp2_w2
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

from plait.testing.memory_probe import run_layout

SEQ = 1024
"""Tokens per sequence of the base layouts: with micro-batch 2, activations dominate the tiny model."""

BASE = [
    "model.preset=tiny",
    f"data.seq_len={SEQ}",
    "data.micro_batch_size=2",
    "data.max_bytes=400000",
    "train.grad_accum=1",
    "train.steps=2",
    "train.val_batches=1",
    "parallel.tp_size=1",
    "parallel.sequence_parallel=false",
    "parallel.activation_checkpointing=false",
]
"""Overrides under every layout (a layout's own overrides come after and win)."""

SMALL = ["model.preset=small", "data.seq_len=512", "data.micro_batch_size=1"]
"""The ``small`` preset (25M parameters): parameters, gradients and AdamW state weigh next to activations."""


RECIPE_BASE = [
    f"data.seq_len={SEQ}",
    "data.micro_batch_size=2",
    "data.max_bytes=400000",
    "train.steps=2",
    "train.val_batches=1",
]
"""Shipped recipes keep their parallel settings; only the batch is enlarged (activations dominate)."""

SHRUNK_8B = ["model.preset=tiny", "model.arch.num_attention_heads=8", "model.arch.num_key_value_heads=8"]
"""llama3_8b's layout (tp 8 + SP, bf16, full AC) on the tiny shape with 8 heads: tp 8 divides them."""

SHRUNK_DEEPSEEK = [
    "model.hf_config.vocab_size=272",
    "model.hf_config.hidden_size=128",
    "model.hf_config.intermediate_size=256",
    "model.hf_config.moe_intermediate_size=64",
    "model.hf_config.num_hidden_layers=2",
    "model.hf_config.num_attention_heads=4",
    "model.hf_config.num_key_value_heads=4",
    "model.hf_config.kv_lora_rank=32",
    "model.hf_config.q_lora_rank=64",
    "model.hf_config.qk_rope_head_dim=16",
    "model.hf_config.qk_nope_head_dim=16",
    "model.hf_config.v_head_dim=32",
    "model.hf_config.n_routed_experts=8",
    "model.hf_config.num_experts_per_tok=2",
    "model.hf_config.first_k_dense_replace=1",
    "model.hf_config.n_group=1",
    "model.hf_config.topk_group=1",
    "model.hf_config.max_position_embeddings=2048",
    "parallel.pp_size=1",
    "parallel.tp_size=2",
    "parallel.cp_size=1",
    "parallel.ep_size=2",
    "data.seq_len=512",
    "parallel.activation_checkpointing=false",
]
"""deepseek_v3's techniques (tp + SP, ep, bf16) at 4 ranks on a 2-layer shape, without AC: with it,
transformers' DeepseekV3TopkRouter divides its saved top-k weights in place, which torch's selective
checkpoint refuses ("Tensor cached ... has been mutated"; not yet handled). Its 256-rank layout
(pp 16 x tp 8 x cp 2 x ep 64) is priced by ``plan --auto`` only."""


def _layout(name: str, world_size: int, *overrides: str, recipe: str = "dense_fsdp2") -> dict[str, Any]:
    return {"name": name, "recipe": recipe, "world_size": world_size, "overrides": [*BASE, *overrides]}


LAYOUTS: list[dict[str, Any]] = [
    _layout("fsdp2_w2_ac_none", 2),
    _layout("fsdp2_w2_ac_full", 2, "parallel.activation_checkpointing=full"),
    _layout("fsdp2_w2_ac_selective", 2, "parallel.activation_checkpointing=selective"),
    _layout("fsdp2_w2_seq512", 2, "data.seq_len=512"),
    _layout("fsdp2_w2_mb1", 2, "data.micro_batch_size=1"),
    _layout("fsdp2_w2_mb4", 2, "data.micro_batch_size=4"),
    _layout("fsdp2_w4", 4),
    _layout("tp2_w2", 2, "parallel.tp_size=2"),
    _layout("tp2_sp_w2", 2, "parallel.tp_size=2", "parallel.sequence_parallel=true"),
    _layout("fsdp2_tp2_w4", 4, "parallel.tp_size=2"),
    _layout("cp2_w2", 2, "parallel.cp_size=2"),
    _layout("cp2_fsdp2_w4", 4, "parallel.cp_size=2"),
    _layout("moe_ep2_w2", 2, "parallel.ep_size=2", recipe="moe_ep"),
    # pipeline micro-batches split into parallel.pipeline.microbatches (4): 4 rows of 512 = the base's tokens
    _layout(
        "pipeline_pp2_w2",
        2,
        "parallel.pp_size=2",
        "data.micro_batch_size=4",
        "data.seq_len=512",
        recipe="pipeline",
    ),
    _layout("small_fsdp2_w2", 2, *SMALL),
    _layout("small_fsdp2_w2_ac_full", 2, *SMALL, "parallel.activation_checkpointing=full"),
    _layout("small_fsdp2_w4", 4, *SMALL),
    _layout("small_fsdp2_tp2_w4", 4, *SMALL, "parallel.tp_size=2"),
    _layout("bf16_fsdp2_w2", 2, "parallel.mixed_precision=bf16"),
    _layout(
        "bf16_tp2_sp_w4_ac_selective",
        4,
        "parallel.mixed_precision=bf16",
        "parallel.tp_size=2",
        "parallel.sequence_parallel=true",
        "parallel.activation_checkpointing=selective",
    ),
    _layout("hsdp_w4", 4, "parallel.dp_replicate_size=2"),
    _layout("small_hpz2_w4", 4, *SMALL, "parallel.options.reshard_after_forward=2"),
    _layout("small_no_reshard_w2", 2, *SMALL, "parallel.options.reshard_after_forward=false"),
    _layout("cp2_ring_w2", 2, "parallel.cp_size=2", "parallel.options.cp_attention=ring"),
    _layout(
        "cp2_tp2_sp_w4", 4, "parallel.cp_size=2", "parallel.tp_size=2", "parallel.sequence_parallel=true"
    ),
    _layout(
        "fsdp2_tp2_cp2_w8",
        8,
        "parallel.cp_size=2",
        "parallel.tp_size=2",
        "parallel.activation_checkpointing=full",
    ),
    _layout("fsdp2_w8", 8),
    _layout("accum2_w2", 2, "train.grad_accum=2", "data.micro_batch_size=1"),
    _layout(
        "moe_ep2_tp2_sp_w4",
        4,
        "parallel.ep_size=2",
        "parallel.tp_size=2",
        "parallel.sequence_parallel=true",
        "parallel.activation_checkpointing=full",
        recipe="moe_ep",
    ),
    *(
        {"name": f"recipe_{name}", "recipe": name, "world_size": world, "overrides": [*RECIPE_BASE, *extra]}
        for name, world, extra in (
            ("dense_fsdp2", 2, []),
            ("fsdp_tp_sp", 4, []),
            ("hsdp", 4, []),
            ("moe_ep", 2, []),
            ("pipeline", 4, ["data.micro_batch_size=4", "data.seq_len=512"]),
            ("dense_4d", 8, []),
            ("hf_llama", 2, []),
            ("llama3_8b", 8, SHRUNK_8B),
            ("deepseek_v3", 4, SHRUNK_DEEPSEEK),
        )
    ),
]
"""The measured layouts: name, recipe, world size and the recipe overrides."""


def measure(layout: dict[str, Any], root: Path) -> dict[str, Any]:
    """Run one layout; its per-rank results, or the error that stopped it, and its wall time."""
    start = time.perf_counter()
    entry: dict[str, Any] = {"layout": layout}
    run_dir = str(root / layout["name"])
    try:
        entry["ranks"] = run_layout(layout["recipe"], layout["overrides"], layout["world_size"], run_dir)
    except Exception as err:  # a layout that fails is recorded, the others still run
        entry["error"] = str(err).splitlines()[0] if str(err) else type(err).__name__
        entry["error_detail"] = traceback.format_exc()[-4000:]
    entry["wall_s"] = round(time.perf_counter() - start, 2)
    return entry


def _summary(entry: dict[str, Any]) -> str:
    name = entry["layout"]["name"]
    if "error" in entry:
        return f"{name}: ERROR {entry['error']}"
    mib = [r["peak_bytes"] / 2**20 for r in entry["ranks"]]
    kinds = {k: v["bytes"] for k, v in entry["ranks"][0]["collectives"].items()}
    return f"{name}: peak MiB {[round(m, 1) for m in mib]} collectives(rank0) {kinds} ({entry['wall_s']} s)"


def main(argv: list[str] | None = None) -> int:
    """Measure the chosen layouts and write the JSON list to ``--out``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path, help="JSON file to write")
    parser.add_argument("--only", action="append", default=[], help="layout name (repeatable)")
    args = parser.parse_args(argv)
    known = {layout["name"] for layout in LAYOUTS}
    unknown = sorted(set(args.only) - known)
    if unknown:
        parser.error(f"unknown layout(s) {unknown}; known: {sorted(known)}")
    chosen = [layout for layout in LAYOUTS if not args.only or layout["name"] in args.only]
    results = []
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="plait-memory-") as root:
        for layout in chosen:
            results.append(measure(layout, Path(root)))
            print(_summary(results[-1]), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1) + "\n")
    print(f"{len(results)} layouts in {time.perf_counter() - start:.1f} s -> {args.out}", flush=True)
    return 0 if all("ranks" in entry for entry in results) else 1


if __name__ == "__main__":
    sys.exit(main())
