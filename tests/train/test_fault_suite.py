"""docs/faults.md's table stays true: every row names a test that exists and an outcome we accept."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OUTCOMES = {"clear error", "correct acceptance"}
_ROW = re.compile(r"^\| (?P<case>[^|]+) \| (?P<how>[^|]+) \| (?P<outcome>[^|]+) \| `(?P<node>[^`]+)` \|$")


def _rows() -> list[dict[str, str]]:
    lines = (ROOT / "docs" / "faults.md").read_text().splitlines()
    table = [line for line in lines if line.startswith("| ") and not line.startswith("| case ")]
    rows = [_ROW.match(line) for line in table]
    assert all(rows), [line for line, row in zip(table, rows, strict=True) if row is None]
    return [row.groupdict() for row in rows if row is not None]


def _test_names(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    return {
        node.name for node in tree.body if isinstance(node, ast.FunctionDef) and node.name.startswith("test_")
    }


def test_every_fault_names_an_existing_test_and_an_accepted_outcome() -> None:
    rows = _rows()
    assert len(rows) >= 30, len(rows)
    for row in rows:
        assert row["outcome"].strip() in OUTCOMES, row
        file, _, name = row["node"].partition("::")
        assert (ROOT / file).is_file(), row
        assert name in _test_names(ROOT / file), row


def test_the_issue_s_fault_classes_are_all_covered() -> None:
    cases = " ".join(row["case"] + " " + row["how"] for row in _rows())
    for fault in (
        "recipe",
        "truncated",
        "missing",
        "crafted",
        "kill -9 in the middle of a save",
        "SIGTERM",
        "disk full",
        "two jobs on one run directory",
        "ranks that disagree",
    ):
        assert fault in cases, fault
