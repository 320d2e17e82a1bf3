"""The support matrix: one row per family (a column per case, then why a case does not pass), and the counts.

A mismatch whose rounding floor (``--floor``, `hf_sweep.floor`) shows float32 rounding is marked
``pass (floor)`` and counts as passing; the floor figures stay in ``floor/floor.jsonl``.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from hf_sweep.family import CASES, CP_CASES, TP_CASES

FLOOR_FACTOR = 2.0
"""A mismatch is float32 rounding when the parallel copy is at most this many times as far from the
float64 copy as the float32 reference is (two float32 runs each ``e`` from the truth differ by up to
``2e``), in gradients and in parameters; a layout error is orders of magnitude farther."""

_MARK = {
    "pass": "pass",
    "floor": "pass (floor)",
    "mismatch": "**MISMATCH**",
    "refused": "refused",
    "crash": "**CRASH**",
    "config": "config",
}
_STATUSES = ("pass", "floor", "refused", "mismatch", "crash", "config")
_PASSING = ("pass", "floor")


def within_floor(floor: dict[str, Any]) -> str | None:
    """Why a `hf_sweep.floor` record shows float32 rounding (``par-f64 <= FLOOR_FACTOR x ref-f64``), or None."""
    parts = []
    for kind in ("grad", "param"):
        ref, par = floor[kind]["ref-f64"][0], floor[kind]["par-f64"][0]
        if not par <= FLOOR_FACTOR * max(ref, 1e-5):
            return None
        parts.append(f"{kind} par-f64 {par:.1e} vs ref-f64 {ref:.1e}")
    return "within float32's rounding floor: " + ", ".join(parts)


def apply_floors(results: list[dict[str, Any]], floors: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each mismatch whose floor record (same family and case; the latest) is rounding becomes ``floor``."""
    latest = {(f["family"], f["case"]): f for f in floors}
    out = []
    for r in results:
        floor = latest.get((r["family"], r["case"]))
        why = within_floor(floor) if floor is not None and r["status"] == "mismatch" else None
        out.append({**r, "status": "floor", "message": why} if why else r)
    return out


def _families(results: list[dict[str, Any]]) -> dict[str, dict[str, dict[str, Any]]]:
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for r in results:
        out.setdefault(r["family"], {})[r["case"]] = r
    return out


def family_status(cases: dict[str, dict[str, Any]]) -> str:
    """Under TP: pass (every tp case passes, or tp4 alone is refused for its heads), refused, failing or config."""
    statuses = [cases.get(c.name, {}).get("status", "crash") for c in TP_CASES]
    if any(s in ("mismatch", "crash") for s in statuses):
        return "failing"
    if statuses[0] in _PASSING and statuses[1] in _PASSING and statuses[2] in (*_PASSING, "refused"):
        return "pass"
    if "config" in statuses:
        return "config"
    return "refused"


def _reason(cases: dict[str, dict[str, Any]]) -> str:
    """Each run case that does not pass, with (the start of) its message; a message repeated is named once."""
    parts: list[str] = []
    said: dict[str, str] = {}
    for case in CASES:
        r = cases.get(case.name, {})
        if r.get("status", "pass") in _PASSING or not r.get("message"):
            continue
        text = r["message"].replace("|", "/").replace("\n", " ")[:200]
        parts.append(f"{case.title}: as {said[text]}" if text in said else f"{case.title}: {text}")
        said.setdefault(text, case.title)
    return "; ".join(parts)


def markdown_table(results: list[dict[str, Any]]) -> str:
    """``family | tp2 | tp2+SP | tp4 | cp2 | cp2 x tp2 | refused / failing because`` for every family."""
    titles = " | ".join(c.title for c in CASES)
    rows = [f"| family | {titles} | refused / failing because |", "|---|" + "---|" * (len(CASES) + 1)]
    for family, cases in sorted(_families(results).items()):
        marks = [_MARK.get(cases.get(c.name, {}).get("status", ""), "-") for c in CASES]
        rows.append(f"| {family} | {' | '.join(marks)} | {_reason(cases)} |")
    return "\n".join(rows)


def _case_counts(families: dict[str, dict[str, dict[str, Any]]]) -> list[str]:
    """``cp2: P pass, R refused, M mismatch, C crash, G config (of N)`` for each case anyone ran."""
    lines = []
    for case in CASES:
        statuses = [cases[case.name]["status"] for cases in families.values() if case.name in cases]
        if statuses:
            counts = Counter(statuses)
            body = ", ".join(f"{counts[s]} {s}" for s in _STATUSES)
            lines.append(f"- `{case.name}`: {body} (of {len(statuses)})")
    return lines


def summary(results: list[dict[str, Any]]) -> str:
    """The families under TP (pass when tp2 and tp2+SP pass), the cp cases' family counts, and per-case counts."""
    families = _families(results)
    tp_run = [c for c in families.values() if any(k.name in c for k in TP_CASES)]
    counts = Counter(family_status(cases) for cases in tp_run)
    total = sum(counts.values())
    lines = [
        f"{total} families: {counts['pass']} pass, {counts['refused']} refused up front, "
        f"{counts['failing']} failing (mismatch or crash), {counts['config']} tiny config does not build"
    ]
    cp_run = [c for c in families.values() if all(k.name in c for k in CP_CASES)]
    if cp_run:
        both = sum(all(c[k.name]["status"] in _PASSING for k in CP_CASES) for c in cp_run)
        lines[0] += f"; under cp: {both} of {len(cp_run)} pass both cp2 and cp2_tp2 (floor included)"
    return "\n".join([*lines, "", *_case_counts(families)])
