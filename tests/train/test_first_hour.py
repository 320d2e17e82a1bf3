"""A new user's first commands: `list` returns at once, the default run's output stays short."""

from __future__ import annotations

import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

from plait.train.models import build_model
from plait.train.plan import plan
from plait.train.recipes import load_recipe
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


def test_plan_of_the_pipeline_recipe_gives_the_whole_models_total_and_each_stages():
    recipe = load_recipe("pipeline")
    whole = sum(p.numel() for p in build_model(recipe.model, "meta").parameters())
    out = plan(recipe, 4)
    assert f"parameters: {whole:,} total\n" in out
    stages = [int(n.replace(",", "")) for n in re.findall(r"^  stage \d .*: ([\d,]+) params", out, re.M)]
    assert len(stages) == 4 and sum(stages) == whole
    rank0 = re.search(r"^parameters of this pp rank's stages: ([\d,]+)$", out, re.M)
    assert rank0 is not None and int(rank0.group(1).replace(",", "")) == stages[0] + stages[2]
