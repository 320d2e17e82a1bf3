"""``plait-train plan``'s per-rank memory estimate for the layout gpu_check trains."""

from __future__ import annotations

import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
import yaml

__all__ = ["plan_memory", "plan_recipe"]

_MEMORY_HEADER = "memory per rank"
_ROW = re.compile(r"^\s+(?P<what>[^:]+): (?P<count>[\d,]+) x (?P<dtype>\w+) = ")


def plan_recipe(arch: dict[str, Any], seq_len: int, micro_batch: int, *, compile: bool) -> dict[str, Any]:
    """The trainer recipe (as YAML data) of gpu_check's layout: dense model, FSDP2 on one rank, bf16, no AC."""
    return {
        "name": "gpu_check",
        "model": {"source": "dense", "preset": "tiny", "arch": dict(arch)},
        "parallel": {
            "strategy": "fsdp2",
            "tp_size": 1,
            "sequence_parallel": False,
            "activation_checkpointing": False,
            "mixed_precision": "bf16",
            "compile": compile,
        },
        "data": {"seq_len": seq_len, "micro_batch_size": micro_batch},
    }


def _dtype_bytes(name: str) -> int:
    return getattr(torch, name).itemsize


def _plan_text(recipe: dict[str, Any]) -> str:
    """``plait-train plan --world-size 1`` of ``recipe`` (the trainer's command, in a process of its own)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "gpu_check.yaml"
        path.write_text(yaml.safe_dump(recipe))
        command = [sys.executable, "-m", "plait.train", "plan", "--recipe", str(path), "--world-size", "1"]
        proc = subprocess.run(command, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise ValueError(f"plait-train plan failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return proc.stdout


def plan_memory(recipe: dict[str, Any]) -> dict[str, Any]:
    """Run ``plan`` on one (fake) rank and read its memory rows back as exact byte counts.

    ``plan`` prints each row as ``<what>: <elements> x <dtype> = <rounded size>``; the element
    counts are exact, so the bytes are too.

    Raises:
        ValueError: ``plan`` failed, or its report has no memory rows (its format changed).
    """
    text = _plan_text(recipe)
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith(_MEMORY_HEADER)), None)
    if start is None:
        raise ValueError(f"plan printed no {_MEMORY_HEADER!r} section:\n{text}")
    rows: dict[str, int] = {}
    for line in lines[start + 1 :]:
        match = _ROW.match(line)
        if match is None:
            break
        key = f"{match['what']} ({match['dtype']})"
        rows[key] = int(match["count"].replace(",", "")) * _dtype_bytes(match["dtype"])
    if not rows:
        raise ValueError(f"plan's memory section has no rows:\n{text}")
    fsdp_units = next((line for line in lines if line.startswith("FSDP units:")), "")
    return {
        "estimate_bytes": sum(rows.values()),
        "rows_bytes": rows,
        "fsdp_units_line": fsdp_units,
        "note": "plan counts parameters, gradients and AdamW state; activations are not included",
    }
