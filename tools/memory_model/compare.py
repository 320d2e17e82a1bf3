"""Estimated (plait.planner) vs measured (tools/memory_model/measure.py) peak memory and collective bytes.

``uv run python tools/memory_model/compare.py [--measured FILE]``: one row per layout,
the worst rank's measured peak against the planner's estimate of the same recipe, and the bytes
per collective kind, estimated against counted; ratios outside [0.9, 1.1] are flagged.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from plait.planner import estimate_memory_by_rank, estimate_traffic, traffic_by_kind
from plait.train import layout_of_recipe, load_recipe, shape_of

HERE = Path(__file__).parent
BAND = (0.9, 1.1)


def estimate(entry: dict[str, Any]) -> tuple[list[float], dict[str, float]]:
    """The planner's peak bytes of every rank, and rank 0's buffer bytes per collective kind."""
    spec = entry["layout"]
    world = spec["world_size"]
    recipe = load_recipe(spec["recipe"], spec["overrides"])
    shape, layout = shape_of(recipe), layout_of_recipe(recipe, world, cpu=True)
    by_pp = estimate_memory_by_rank(shape, layout)
    peaks = [by_pp[rank // (world // layout.pp)].peak for rank in range(world)]  # pp is the outer axis
    return peaks, traffic_by_kind(estimate_traffic(shape, layout, pp_rank=0))


def measured(entry: dict[str, Any]) -> tuple[list[float], dict[str, float]]:
    """Every rank's measured peak, and rank 0's collective bytes by kind (recv counted with send)."""
    peaks = [float(r["peak_bytes"]) for r in sorted(entry["ranks"], key=lambda r: r["rank"])]
    rank0 = min(entry["ranks"], key=lambda r: r["rank"])
    kinds = {k: v["bytes"] for k, v in rank0["collectives"].items() if k not in ("recv", "broadcast")}
    return peaks, kinds


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
            if max(got, est) > 64 * 1024:  # scalars (token counts, loss-parallel statistics) are not modelled
                comm[kind] = (est, got)
        ratios = [e / g for e, g in zip(est_peak, got_peak, strict=True)]
        worst = max(range(len(ratios)), key=lambda i: abs(ratios[i] - 1))
        out.append(
            {
                "name": entry["layout"]["name"],
                "world": entry["layout"]["world_size"],
                "peak": (est_peak[worst], got_peak[worst]),
                "ratios": (min(ratios), max(ratios)),
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
    print(
        "| layout | ranks | peak MiB est / measured (rank furthest off) | ratio over ranks | collectives of rank 0: est / counted MiB (ratio) |"
    )
    print("|---|---|---|---|---|")
    for row in table:
        est, got = row["peak"]
        low, high = row["ratios"]
        comm = "; ".join(
            f"{k} {e / 2**20:.2f} / {g / 2**20:.2f} ({_ratio((e, g))})" for k, (e, g) in row["comm"].items()
        )
        print(
            f"| {row['name']} | {row['world']} | {est / 2**20:.1f} / {got / 2**20:.1f} | {_ratio((low, 1.0))} to {_ratio((high, 1.0))} | {comm} |"
        )
    pairs = [(r["ratios"][0], 1.0) for r in table] + [(r["ratios"][1], 1.0) for r in table]
    pairs += [pair for r in table for pair in r["comm"].values()]
    inside = sum(1 for e, g in pairs if g and BAND[0] <= e / g <= BAND[1])
    total = len(pairs)
    print(f"\n{inside} of {total} ratios inside [{BAND[0]}, {BAND[1]}]")


if __name__ == "__main__":
    main()
