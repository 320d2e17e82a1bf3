"""Estimated (plait.planner) vs measured (tools/memory_model/measure.py) peak memory and collective bytes.

``uv run python tools/memory_model/compare.py [--measured FILE] [--markdown]``: one row per layout,
the worst rank's measured peak against the planner's estimate of the same recipe, and the bytes
per collective kind, estimated against counted; ratios outside [0.9, 1.1] are flagged.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from plait.planner import estimate_memory, estimate_traffic, traffic_by_kind
from plait.train.plan_auto import layout_of_recipe, shape_of
from plait.train.recipes import load_recipe

HERE = Path(__file__).parent
BAND = (0.9, 1.1)


def estimate(entry: dict[str, Any]) -> tuple[float, dict[str, float]]:
    """The planner's peak bytes and buffer bytes per collective kind for one measured layout."""
    spec = entry["layout"]
    recipe = load_recipe(spec["recipe"], spec["overrides"])
    shape, layout = shape_of(recipe), layout_of_recipe(recipe, spec["world_size"], cpu=True)
    return estimate_memory(shape, layout).peak, traffic_by_kind(estimate_traffic(shape, layout))


def measured(entry: dict[str, Any]) -> tuple[float, dict[str, float]]:
    """The worst rank's peak and that rank's collective bytes by kind (recv counted with send)."""
    rank = max(entry["ranks"], key=lambda r: r["peak_bytes"])
    kinds = {k: v["bytes"] for k, v in rank["collectives"].items() if k not in ("recv", "broadcast")}
    return float(rank["peak_bytes"]), kinds


def rows(data: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One comparison per measured layout."""
    out = []
    for entry in data:
        if "ranks" not in entry:
            continue
        est_peak, est_comm = estimate(entry)
        got_peak, got_comm = measured(entry)
        comm = {}
        for kind in sorted(set(est_comm) | set(got_comm)):
            got, est = got_comm.get(kind, 0.0), est_comm.get(kind, 0.0)
            if max(got, est) > 1024:  # scalars (loss and token counts) are not the model's
                comm[kind] = (est, got)
        out.append(
            {
                "name": entry["layout"]["name"],
                "world": entry["layout"]["world_size"],
                "peak": (est_peak, got_peak),
                "comm": comm,
            }
        )
    return out


def _ratio(pair: tuple[float, float]) -> str:
    est, got = pair
    r = est / got if got else float("inf")
    flag = "" if BAND[0] <= r <= BAND[1] else " !"
    return f"{r:.2f}{flag}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--measured", default=str(HERE / "measured.json"))
    args = parser.parse_args()
    table = rows(json.loads(Path(args.measured).read_text()))
    print("| layout | ranks | peak MiB est / measured | ratio | collectives: est / counted MiB (ratio) |")
    print("|---|---|---|---|---|")
    for row in table:
        est, got = row["peak"]
        comm = "; ".join(
            f"{k} {e / 2**20:.2f} / {g / 2**20:.2f} ({_ratio((e, g))})" for k, (e, g) in row["comm"].items()
        )
        print(
            f"| {row['name']} | {row['world']} | {est / 2**20:.1f} / {got / 2**20:.1f} | {_ratio(row['peak'])} | {comm} |"
        )
    inside = sum(BAND[0] <= e / g <= BAND[1] for r in table for e, g in [r["peak"], *r["comm"].values()] if g)
    total = sum(1 for r in table for _ in [r["peak"], *r["comm"].values()])
    print(f"\n{inside} of {total} ratios inside [{BAND[0]}, {BAND[1]}]")


if __name__ == "__main__":
    main()
