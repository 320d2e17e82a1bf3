"""The combination matrix: every pair and triple of pp, dp_replicate, dp_shard, cp, tp (+SP) and ep at 2.

Each case trains one model on one layout through ``parallelize_model`` / ``pipeline_model`` beside the
unsharded reference (``plait.testing.combination_parity``: loss and every gradient at step 0,
parameters after 2 SGD steps, AdamW losses; fp32) on gloo ranks, and prints one JSON line. A layout
the combination table refuses (``plait.mesh.combinations``) is reported as ``refused`` with its line,
not run. Models: plait's dense decoder (layouts without ep), plait's MoE decoder (every layout,
activation checkpointing off, full and selective), transformers' Llama, Mistral (sliding window) and Qwen3-MoE
(the pairs; Qwen3-MoE with AC off and full). ``--sixteen`` adds pp2 x dp_shard2 x cp2 x tp2 with ep2 over dp_shard x cp on 16
ranks (the MoE decoder).

    uv run python tools/combination_matrix.py                      # all of it (about 40 min on 2 cores)
    uv run python tools/combination_matrix.py --models dense --max-axes 2
    uv run python tools/combination_matrix.py --report-only        # the table from the JSON
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

from plait.mesh import FSDP2Config, ParallelismSizes, combination_request, refusal_of
from plait.testing import (
    COMBINATION_AXES,
    COMBINATION_MODELS,
    combination_parity,
    combination_sizes,
    combination_world,
    run_cases,
)

RESULTS = Path(__file__).parent / "combination_matrix_results"
SIXTEEN = ("pp", "dp_shard", "cp", "tp", "ep")


def layouts(max_axes: int, max_world: int) -> list[tuple[str, ...]]:
    """Every set of 2 .. ``max_axes`` axes (tp and sp exclusive) that fits in ``max_world`` ranks."""
    out = []
    for n in range(2, max_axes + 1):
        for axes in itertools.combinations(COMBINATION_AXES, n):
            if {"tp", "sp"} <= set(axes) or combination_world(axes) > max_world:
                continue
            out.append(axes)
    return out


MOE_AC: tuple[str | bool, ...] = (False, "full", "selective")
"""The activation-checkpointing modes of plait's MoE decoder rows (Qwen3-MoE: off and full)."""


def cases(
    models: list[str], max_axes: int, max_world: int, sixteen: bool, moe_ac: tuple[str | bool, ...] = MOE_AC
) -> list[tuple[str, tuple, str | bool]]:
    """(model, layout, AC mode) of the matrix."""
    out: list[tuple[str, tuple, str | bool]] = []
    for axes in layouts(max_axes, max_world):
        pair = len(axes) == 2
        if "dense" in models and "ep" not in axes:
            out.append(("dense", axes, False))
        if "moe" in models:
            out += [("moe", axes, ac) for ac in moe_ac]
        for dense_hf in ("llama", "mistral"):
            if dense_hf in models and pair and "ep" not in axes:
                out.append((dense_hf, axes, False))
        if "qwen3_moe" in models and pair:
            out += [("qwen3_moe", axes, False), ("qwen3_moe", axes, "full")]
    if sixteen and "moe" in models:
        out += [("moe", SIXTEEN, ac) for ac in moe_ac]
    return out


def refusal(model: str, axes: tuple[str, ...], ac: str | bool) -> str | None:
    """The combination table's line for this case, or None where it is built."""
    sizes = ParallelismSizes(**combination_sizes(axes))
    config = FSDP2Config(mp_policy=None, sequence_parallel="sp" in axes)
    features = ("moe",) if "moe" in model else ()
    return refusal_of(combination_request(config, sizes, activation_checkpointing=ac, features=features))


def name_of(model: str, axes: tuple[str, ...], ac: str | bool) -> str:
    return f"{model} {' x '.join(axes)}{' ac=' + ac if ac else ''}"


def _status(row: dict) -> str:
    if row.get("refused"):
        return "refused"
    if not row.get("ok"):
        return "**FAIL**"
    return "pass" if row.get("margin_ok", True) else "pass (thin margin)"


def report(rows: list[dict]) -> str:
    """The markdown table of the rows (one line per case)."""
    lines = [
        "| case | ranks | result | loss | grad (rel) | params (SGD) | router margin |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        why = row.get("refused") or row.get("why") or row.get("error")
        result = _status(row) + (f": {str(why)[:120]}" if why and _status(row) != "pass" else "")
        nums = [row.get(k) for k in ("loss_diff", "grad_diff", "param_diff", "margin")]
        cells = ["" if v is None else f"{v:.1e}" for v in nums]
        lines.append(f"| {row['case']} | {row['world']} | {result} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


COLUMNS = (
    ("dense", ""),
    ("moe", ""),
    ("moe", " ac=full"),
    ("moe", " ac=selective"),
    ("llama", ""),
    ("mistral", ""),
    ("qwen3_moe", ""),
    ("qwen3_moe", " ac=full"),
)


def pivot(rows: list[dict]) -> str:
    """One line per layout, one column per model (and AC mode): pass / refused / FAIL, or blank (not run)."""
    by_case = {r["case"]: r for r in rows}
    layouts: dict[str, int] = {}
    for row in rows:
        rest = row["case"].partition(" ")[2]
        layouts.setdefault(rest.removesuffix(" ac=full").removesuffix(" ac=selective"), row["world"])
    head = "| layout | ranks | " + " | ".join(f"{m}{ac}" for m, ac in COLUMNS) + " |"
    lines = [head, "|---|---|" + "---|" * len(COLUMNS)]
    for layout, world in sorted(layouts.items(), key=lambda kv: (kv[1], kv[0].count(" x "), kv[0])):
        cells = [
            _status(by_case[f"{m} {layout}{ac}"]) if f"{m} {layout}{ac}" in by_case else ""
            for m, ac in COLUMNS
        ]
        lines.append(f"| {layout} | {world} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="*", default=list(COMBINATION_MODELS))
    parser.add_argument("--max-axes", type=int, default=3)
    parser.add_argument(
        "--moe-ac", nargs="*", default=["off", "full", "selective"], help="the MoE rows' AC modes"
    )
    parser.add_argument("--max-world", type=int, default=8)
    parser.add_argument("--sixteen", action="store_true", help="add the 5-D MoE layout on 16 ranks")
    parser.add_argument("--out", type=Path, default=RESULTS / "matrix.json")
    parser.add_argument("--report-only", action="store_true")
    opts = parser.parse_args()
    if not opts.report_only:
        moe_ac = tuple(False if a == "off" else a for a in opts.moe_ac)
        todo = cases(opts.models, opts.max_axes, opts.max_world, opts.sixteen, moe_ac)
        refused = [
            {"case": name_of(*c), "world": combination_world(c[1]), "refused": why, "ok": True}
            for c in todo
            if (why := refusal(*c)) is not None
        ]
        for row in refused:
            print(json.dumps(row), flush=True)
        run = [c for c in todo if refusal(*c) is None]
        for world in sorted({combination_world(c[1]) for c in run}):
            batch = {name_of(*c): c for c in run if combination_world(c[1]) == world}
            run_cases(batch, combination_parity, world, out=opts.out, timeout=900)
        kept = json.loads(opts.out.read_text()) if opts.out.exists() else []
        names = {r["case"] for r in refused}
        opts.out.write_text(
            json.dumps([r for r in kept if r["case"] not in names] + refused, indent=1) + "\n"
        )
    rows = sorted(json.loads(opts.out.read_text()), key=lambda r: (r["world"], r["case"]))
    (opts.out.parent / "matrix.md").write_text(pivot(rows) + "\n\n" + report(rows) + "\n")
    print(pivot(rows))
    sys.exit(0 if all(r.get("ok") for r in rows) else 1)


if __name__ == "__main__":
    main()
