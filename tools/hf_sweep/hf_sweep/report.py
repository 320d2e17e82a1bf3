"""The support matrix: one row per family (tp2 | tp2+SP | tp4 | refused because ...), and the counts."""

from __future__ import annotations

from collections import Counter
from typing import Any

from hf_sweep.family import CASES

_MARK = {
    "pass": "pass",
    "mismatch": "**MISMATCH**",
    "refused": "refused",
    "crash": "**CRASH**",
    "config": "config",
}


def _families(results: list[dict[str, Any]]) -> dict[str, dict[str, dict[str, Any]]]:
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for r in results:
        out.setdefault(r["family"], {})[r["case"]] = r
    return out


def family_status(cases: dict[str, dict[str, Any]]) -> str:
    """pass (every case passes, or tp4 alone is refused for its heads), refused, failing or config."""
    statuses = [cases.get(name, {}).get("status", "crash") for name, _, _ in CASES]
    if any(s in ("mismatch", "crash") for s in statuses):
        return "failing"
    if statuses[:2] == ["pass", "pass"] and statuses[2] in ("pass", "refused"):
        return "pass"
    if "config" in statuses:
        return "config"
    return "refused"


def _reason(cases: dict[str, dict[str, Any]]) -> str:
    for name, _, _ in CASES:
        r = cases.get(name, {})
        if r.get("status") != "pass" and r.get("message"):
            text = r["message"].replace("|", "/").replace("\n", " ")
            return f"{name}: {text[:220]}"
    return ""


def markdown_table(results: list[dict[str, Any]]) -> str:
    """``family | tp2 | tp2+SP | tp4 | refused because ...`` for every family in ``results``."""
    rows = ["| family | tp2 | tp2+SP | tp4 | refused / failing because |", "|---|---|---|---|---|"]
    for family, cases in sorted(_families(results).items()):
        marks = [_MARK.get(cases.get(name, {}).get("status", ""), "-") for name, _, _ in CASES]
        rows.append(f"| {family} | {' | '.join(marks)} | {_reason(cases)} |")
    return "\n".join(rows)


def summary(results: list[dict[str, Any]]) -> str:
    """``N families: P pass, R refused, F failing, C config`` (a family passes when tp2 and tp2+SP pass)."""
    counts = Counter(family_status(cases) for cases in _families(results).values())
    total = sum(counts.values())
    return (
        f"{total} families: {counts['pass']} pass, {counts['refused']} refused up front, "
        f"{counts['failing']} failing (mismatch or crash), {counts['config']} tiny config does not build"
    )
