"""Context parallel: activation memory per rank and bytes per step for each variant, and the parity matrix.

Run from the repository root (gloo ranks on CPU, through plait.testing's harness):

    uv run tools/bench/cp_bench.py [--seq 16384] [--cp 1,2,4] [--markdown] [--out-json PATH]
    uv run tools/bench/cp_bench.py --parity        # every acceptance configuration
                                                   # (plait.testing.run_cases: JSON lines, --out)

The first prints one JSON line per (cp, variant) run — activation bytes a rank saves for backward,
bytes it sends in forward + backward, docs/cp.md's formula beside them (`cp_memory.py` says how
each is measured) — then, with ``--markdown``, the table docs/cp.md shows.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from plait.testing import cp_parity, run_cases, run_on_ranks
from tools.bench.cp_memory import VARIANTS, measure


def _memory_and_bytes(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every (cp, variant) run, one JSON line each; cp=1 runs once (plain SDPA)."""
    rows: list[dict[str, Any]] = []
    baseline = None
    model = (args.hidden, args.layers, args.heads, args.kv_heads, args.vocab)
    for cp in args.cp:
        for variant in args.variants if cp > 1 else args.variants[:1]:
            result = run_on_ranks(measure, cp, args.seq, variant, *model, timeout=3600)
            row = result[0]
            row["activation_bytes_max_rank"] = max(r["activation_bytes"] for r in result)
            row["bytes_sent_max_rank"] = max(r["bytes_sent"] for r in result)
            baseline = baseline or row["activation_bytes"]
            row["activation_vs_cp1"] = round(row["activation_bytes_max_rank"] / baseline, 4)
            print(json.dumps(row), flush=True)
            rows.append(row)
    return rows


def _markdown(rows: list[dict[str, Any]]) -> str:
    """The table of docs/cp.md's Measured section (activations in MB = 1e6 bytes)."""
    lines = [
        "| cp | variant | tokens / rank | activations / rank | vs cp=1 | bytes sent / rank | formula | sent / formula |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ratio = f"{r['sent_vs_formula']:.4f}" if r["sent_vs_formula"] is not None else "-"
        lines.append(
            f"| {r['cp']} | {r['variant'].replace('none (SDPA)', 'SDPA')} | {r['tokens_per_rank']:,} "
            f"| {r['activation_bytes_max_rank'] / 1e6:.1f} MB | {r['activation_vs_cp1']:.3f} "
            f"| {r['bytes_sent_max_rank']:,} | {r['bytes_formula']:,} | {ratio} |"
        )
    return "\n".join(lines)


_KINDS = ("dense", "dense_mha", "llama", "qwen3")  # the reference decoder with GQA and MHA, and HF
PARITY: list[tuple[int, str, dict[str, int], dict[str, Any], Any]] = [
    (2, kind, {"cp_size": 2}, {}, False) for kind in _KINDS
] + [
    *((4, kind, {"cp_size": 4}, {}, False) for kind in _KINDS),
    (4, "dense", {"cp_size": 2}, {}, False),  # dp_shard 2 x cp 2
    (4, "qwen3", {"cp_size": 2, "tp_size": 2}, {}, False),
    (4, "dense", {"cp_size": 2, "tp_size": 2}, {"sequence_parallel": True}, "full"),
    (8, "llama", {"cp_size": 2, "tp_size": 2}, {}, False),  # dp_shard 2 x cp 2 x tp 2
    (8, "dense", {"cp_size": 2, "tp_size": 2}, {"sequence_parallel": True}, False),
    (
        8,
        "llama",
        {"cp_size": 2, "dp_replicate_size": 2},
        {},
        False,
    ),  # HSDP: dp_replicate 2 x dp_shard 2 x cp 2
]


PARITY_VARIANTS = ("all_gather", "ring", "all_to_all")
"""Every configuration of the parity matrix runs in each variant (tests/cp holds the CI subset)."""

COMPILE = [(2, "dense", {"cp_size": 2}, {"enable_compile": True}, False)]
"""Per-layer torch.compile (inductor on CPU: minutes per case), with ``--parity --compile``."""


def _parity(matrix: list[tuple[Any, ...]], only_world: int | None, out: Path) -> bool:
    """Each configuration of ``matrix`` in both variants through ``cp_parity``; whether all pass."""
    rows = []
    for world in sorted({c[0] for c in matrix if only_world in (None, c[0])}):
        cases = {
            f"{kind} {sizes} {options} {variant} ac={ac}": (
                kind,
                sizes,
                {**options, "cp_attention": variant},
                ac,
            )
            for w, kind, sizes, options, ac in matrix
            if w == world
            for variant in PARITY_VARIANTS
        }
        rows += run_cases(cases, cp_parity, world, out=out, timeout=1800)
    return all(row["ok"] for row in rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parity", action="store_true", help="run the parity matrix instead")
    parser.add_argument("--compile", action="store_true", help="with --parity: only the compile cases")
    parser.add_argument("--world", type=int, default=None, help="with --parity: only this world size")
    parser.add_argument(
        "--out", type=Path, default=Path("runs/cp_parity.json"), help="with --parity: JSON rows"
    )
    parser.add_argument("--seq", type=int, default=16384)
    parser.add_argument("--cp", type=_ints, default=[1, 2, 4])
    parser.add_argument("--variants", type=lambda s: s.split(","), default=list(VARIANTS))
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--markdown", action="store_true", help="print the table after the JSON lines")
    parser.add_argument("--out-json", type=Path, default=None, help="also write the rows (JSON lines) here")
    args = parser.parse_args()
    if args.parity:
        sys.exit(0 if _parity(COMPILE if args.compile else PARITY, args.world, args.out) else 1)
    rows = _memory_and_bytes(args)
    if args.out_json is not None:
        args.out_json.parent.mkdir(parents=True, exist_ok=True)
        args.out_json.write_text("".join(json.dumps(r) + "\n" for r in rows))
    if args.markdown:
        print(_markdown(rows))


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


if __name__ == "__main__":
    main()
