"""Building the model says what it waits on: one line for materialising, one for pretrained weights, rank 0 only."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from plait.testing import run_on_ranks
from plait.train.init import progress

SMALL = ["model.arch.hidden_size=64", "model.arch.intermediate_size=96", "model.arch.num_hidden_layers=2"]
DONE = r" \.\.\. done in \d+\.\d s"


def _build(overrides: list[str]) -> str:
    """The trainer's model setup on this rank; what it printed."""
    import torch.distributed as dist

    from plait.train.recipes import load_recipe
    from plait.train.setup import build_mesh_context, build_parallel_model, check_recipe

    recipe = load_recipe("dense_fsdp2", [*SMALL, *overrides])
    ctx = build_mesh_context(recipe, check_recipe(recipe, dist.get_world_size()))
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        build_parallel_model(recipe, ctx, torch.device("cpu"))
    return out.getvalue()


def _numel(overrides: list[str]) -> int:
    from plait.train.models import build_model
    from plait.train.recipes import load_recipe

    return sum(
        p.numel()
        for p in build_model(load_recipe("dense_fsdp2", [*SMALL, *overrides]).model, "meta").parameters()
    )


def test_materialising_prints_one_line_with_the_size_and_time_on_rank_0_only():
    rank0, rank1 = run_on_ranks(_build, 2, ["train.seed=3"])
    numel = _numel([])
    assert re.fullmatch(
        rf"materialising the model: {numel:,} parameters \({numel * 4 / 2**20:,.1f} MiB\) on cpu, seed 3{DONE}\n",
        rank0,
    ), rank0
    assert rank1 == ""


def test_loading_pretrained_weights_prints_one_line_with_the_files_and_time(tmp_path: Path):
    from plait.train.models import build_model
    from plait.train.recipes import load_recipe

    model = build_model(load_recipe("dense_fsdp2", SMALL).model, "cpu")
    save_file(
        {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()},
        str(tmp_path / "m.safetensors"),
    )
    size = (tmp_path / "m.safetensors").stat().st_size / 2**20
    rank0, rank1 = run_on_ranks(_build, 2, [f"model.pretrained_path={tmp_path}"])
    lines = rank0.splitlines()
    assert len(lines) == 2 and lines[0].startswith("materialising the model: "), rank0
    assert re.fullmatch(
        rf"loading pretrained weights from {re.escape(str(tmp_path))}: 1 file, {size:,.1f} MiB{DONE}",
        lines[1],
    ), lines
    assert rank1 == ""


def test_a_step_that_fails_ends_its_line_before_the_error(capsys: pytest.CaptureFixture[str]):
    with pytest.raises(ValueError, match="boom"), progress("loading x"):
        raise ValueError("boom")
    assert capsys.readouterr().out == "loading x ... failed\n"
