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
