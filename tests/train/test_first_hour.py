"""A new user's first commands: `list` returns at once, the default run's output stays short."""

from __future__ import annotations

import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

from plait.train.summary import ModelLayout

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("entry", [["apps/train"], ["-m", "plait.train"]])
def test_list_prints_the_shipped_recipes_without_importing_torch(entry: list[str]):
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", *entry, "list"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    names = [line.split()[0] for line in proc.stdout.splitlines()]
    assert names == sorted(
        p.stem for p in (REPO / "apps/train/src/plait/train/shipped_recipes").glob("*.yaml")
    )
    imported = {line.rsplit("|", 1)[-1].strip() for line in proc.stderr.splitlines() if "|" in line}
    assert "torch" not in imported and "plait.mesh" not in imported


def test_the_training_summary_gives_the_layout_in_three_lines_whatever_the_model():
    layout = ModelLayout(
        fsdp_units=["<root>", *(f"model.layers.{i}" for i in range(32))],
        tp_placements={f"model.layers.*.p{i}.weight": "dp_shard:S(0), tp:S(0)" for i in range(9)},
        total_params=1000,
        local_params=Counter({torch.float32: 250}),
    )
    assert layout.brief().splitlines() == [
        "parameters: 1,000 total, 250 per rank (float32 250)",
        "FSDP units: 33 (<root>, model.layers.* x32)",
        "TP-sharded parameters: 9 patterns (plait-train plan lists them)",
    ]
