"""The tools' matrix runner: one merged row per case, failures recorded, the JSON file kept up to date."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch.distributed as dist

from plait.testing import case_row, merge_rows, run_cases


@dataclass
class _Result:
    diff: float
    diffs: list[float] = field(default_factory=list)

    def check(self) -> None:
        assert self.diff <= 1.0, f"diff {self.diff}"


def _body(kind: str, scale: float) -> dict | _Result:
    """Rank r reports ``scale * r``; ``raise`` fails on rank 1 only."""
    rank = dist.get_rank()
    if kind == "raise" and rank == 1:
        raise ValueError("refused on rank 1")
    if kind == "dataclass":
        return _Result(scale * rank, [float(rank), 1.0 - rank])
    return {"diff": scale * rank, "passed": rank == 0, "label": f"rank {rank}"}


def test_rows_merge_worst_over_ranks() -> None:
    rows = [{"a": 1.0, "ok": True, "x": "r0", "l": [1, 5]}, {"a": 3.0, "ok": False, "x": "r1", "l": [2, 4]}]
    assert merge_rows(rows) == {"a": 3.0, "ok": False, "x": "r0", "l": [2, 5]}
    assert math.isnan(merge_rows([{"a": 1.0}, {"a": math.nan}])["a"])
    row = case_row(_Result(2.0))
    assert (row["diff"], row["diffs"], row["ok"]) == (2.0, [], False) and row["why"].startswith("diff 2.0")


def test_each_case_on_the_ranks_one_row_and_the_file_keeps_other_cases(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "rows.json"
    out.write_text(json.dumps([{"case": "earlier", "world": 2}, {"case": "dict", "world": 2}]))
    cases = {"dict": ("dict", 0.5), "dataclass": ("dataclass", 2.0), "raise": ("raise", 1.0)}
    rows = run_cases(cases, _body, 2, out=out, timeout=120)
    assert [r["case"] for r in rows] == ["dict", "dataclass", "raise"]
    assert {k: rows[0][k] for k in ("world", "diff", "passed", "label")} == {
        "world": 2,
        "diff": 0.5,
        "passed": False,
        "label": "rank 0",
    }
    assert (rows[1]["diff"], rows[1]["diffs"], rows[1]["ok"]) == (2.0, [1.0, 1.0], False)
    assert rows[2]["ok"] is False and "refused on rank 1" in rows[2]["error"]
    printed = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [p["case"] for p in printed] == ["dict", "dataclass", "raise"]
    assert [r["case"] for r in json.loads(out.read_text())] == ["earlier", "dict", "dataclass", "raise"]
