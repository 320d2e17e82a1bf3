"""tools/combination_matrix.py: its layouts, and the Hugging Face rows it runs, in CI on two pairs.

The full matrix (every pair and triple of pp, dp_replicate, dp_shard, cp, tp (+SP) and ep at 2 on
4 models, and the 5-D layout on 16 ranks) is a tool command; its table is in docs/support.md.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

from plait.testing import combination_parity, combination_world, run_on_ranks

TOOL = Path(__file__).resolve().parents[2] / "tools" / "combination_matrix.py"


def _tool() -> ModuleType:
    spec = importlib.util.spec_from_file_location("combination_matrix", TOOL)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_the_matrix_holds_every_pair_and_no_layout_is_refused() -> None:
    tool = _tool()
    pairs = tool.layouts(2, 8)
    assert len(pairs) == 20  # 7 axes choose 2, less tp with sp (sp is tp with sequence parallel)
    assert len(tool.layouts(3, 8)) == 45  # and the 25 triples that fit in 8 ranks
    cases = tool.cases(["dense", "moe", "llama", "qwen3_moe"], 3, 8, True)
    assert ("moe", tool.SIXTEEN, "full") in cases and combination_world(tool.SIXTEEN) == 16
    assert [c for c in cases if tool.refusal(*c) is not None] == []


@pytest.mark.parametrize(
    ("model", "axes", "ac"),
    [("qwen3_moe", ("pp", "ep"), "full"), ("llama", ("pp", "sp"), False)],
    ids=["qwen3_moe pp x ep ac=full", "llama pp x sp"],
)
def test_hugging_face_rows_match_the_unsharded_model(
    model: str, axes: tuple[str, ...], ac: str | bool
) -> None:
    for row in run_on_ranks(combination_parity, combination_world(axes), model, axes, ac, timeout=600):
        assert row["ok"], row.get("why")
        assert "tp" in row["mesh_dims"] or "ep" in row["mesh_dims"], row["mesh_dims"]
        assert (row["checkpointed"] > 0) == bool(ac), row
