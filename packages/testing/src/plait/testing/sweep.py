"""The tools' matrix runner: each named case on gloo ranks, one JSON line per case, a JSON file of rows.

A case body is a module-level function (the one ``run_on_ranks`` takes) returning, on every rank,
a dict or a dataclass such as :class:`~plait.testing.tolerances.Parity`. Each rank's result becomes a
flat row (a dataclass with a ``check()`` method gains ``ok`` and, when it fails, ``why``), and the
ranks' rows merge into one: booleans must hold on every rank, numbers (and lists of numbers,
element by element) take the worst rank's value, anything else is rank 0's. A case that raises,
dies or hangs on a rank gives ``ok: false`` with the error, and the sweep goes on.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from plait.testing.harness import run_on_ranks

__all__ = ["case_row", "merge_rows", "run_cases"]


def case_row(result: Any) -> dict[str, Any]:
    """One rank's result as a row: a dict as is, a dataclass's fields plus ``ok`` / ``why`` from ``check()``."""
    if isinstance(result, Mapping):
        return dict(result)
    if not dataclasses.is_dataclass(result) or isinstance(result, type):
        raise TypeError(f"a case body returns a dict or a dataclass, got {type(result).__name__}")
    row = dataclasses.asdict(result)
    check = getattr(result, "check", None)
    if callable(check):
        try:
            check()
            row["ok"] = True
        except AssertionError as exc:
            row["ok"], row["why"] = False, str(exc)[:400]
    return row


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _worst(values: list[Any]) -> Any:
    """All of the booleans, the largest number (NaN wins), element-wise for lists; else the first."""
    if all(isinstance(v, bool) for v in values):
        return all(values)
    if all(_is_number(v) for v in values):
        nan = [v for v in values if isinstance(v, float) and math.isnan(v)]
        return nan[0] if nan else max(values)
    lists = all(isinstance(v, list) for v in values) and len({len(v) for v in values}) == 1
    if lists and all(_is_number(x) for v in values for x in v):
        return [_worst(list(column)) for column in zip(*values, strict=True)]
    return values[0]


def merge_rows(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The ranks' rows as one: every key of rank 0's row, merged over the ranks that have it."""
    return {key: _worst([row[key] for row in rows if key in row]) for key in rows[0]}


def run_cases(
    cases: Mapping[str, Sequence[Any]],
    body: Callable[..., Any],
    world_size: int,
    *,
    out: str | Path | None = None,
    timeout: float = 1800.0,
) -> list[dict[str, Any]]:
    """Run ``body(*args)`` on ``world_size`` gloo ranks for each ``name: args`` of ``cases``, in order.

    Args:
        cases: case name -> the positional arguments of ``body`` (picklable).
        body: a module-level function run on every rank; returns a dict or a dataclass.
        world_size: ranks per case, 1 to 16.
        out: a JSON file of rows, rewritten after each case; rows of cases this call does not run
            (an earlier call, another world size) are kept, a case run again replaces its row.
        timeout: seconds one case may take before its ranks count as hung.

    Returns:
        One row per case: ``case``, ``world``, the merged rank rows (``ok`` / ``error`` on failure) and
        ``seconds``. Each row is also printed as one JSON line.
    """
    rows: list[dict[str, Any]] = []
    kept = _other_rows(Path(out), cases, world_size) if out is not None else []
    for name, args in cases.items():
        start = time.perf_counter()
        try:
            merged = merge_rows([case_row(r) for r in run_on_ranks(body, world_size, *args, timeout=timeout)])
        except Exception as exc:  # a rank raised, died or hung: the harness discarded its workers
            merged = {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:600]}
        merged.pop("case", None)
        row = {"case": name, "world": world_size, **merged, "seconds": round(time.perf_counter() - start, 1)}
        print(json.dumps(row, default=str), flush=True)
        rows.append(row)
        if out is not None:
            Path(out).parent.mkdir(parents=True, exist_ok=True)
            Path(out).write_text(json.dumps(kept + rows, indent=1, default=str) + "\n")
    return rows


def _other_rows(out: Path, cases: Mapping[str, Sequence[Any]], world_size: int) -> list[dict[str, Any]]:
    """The rows of ``out`` (if it exists) that are not a case of ``cases`` at ``world_size``."""
    if not out.exists():
        return []
    rerun = {(name, world_size) for name in cases}
    return [r for r in json.loads(out.read_text()) if (r.get("case"), r.get("world")) not in rerun]
