"""The full pipeline-parallel acceptance matrix (too slow for CI on 2 cores); prints one JSON line per case.

Each case runs plait.testing's parity driver on the case's ranks (``pipeline_parity``): the loss and
every parameter gradient after step 0, every parameter after 2 SGD steps and the AdamW losses,
against the unsharded reference, within the driver's fp32 tolerances (``ok``). The rows also go to
``--out`` (JSON).

    uv run python tools/pipeline_matrix.py            # all world sizes
    uv run python tools/pipeline_matrix.py --world 2  # one world size
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from plait.mesh import ParallelismSizes as Sizes
from plait.pipeline import PipelineConfig as Config
from plait.testing import pipeline_parity, run_cases

MATRIX: dict[int, list[tuple]] = {
    2: [
        (f"{kind} pp2 {schedule}", kind, 4, Sizes(pp_size=2), Config(schedule=schedule))
        for kind in ("dense", "llama", "moe")
        for schedule in (
            "gpipe",
            "1f1b",
            "interleaved_1f1b",
            "looped_bfs",
            "interleaved_zero_bubble",
            "zbv_zero_bubble",
        )
    ],
    4: [
        *(
            (f"{kind} pp4 {schedule}", kind, 8, Sizes(pp_size=4), Config(schedule=schedule, microbatches=4))
            for kind in ("dense", "llama")
            for schedule in ("1f1b", "interleaved_1f1b")
        ),
        ("dense pp2 x dp_shard2 1f1b", "dense", 4, Sizes(pp_size=2), Config(schedule="1f1b")),
        (
            "llama pp2 x dp_shard2 interleaved_1f1b",
            "llama",
            4,
            Sizes(pp_size=2),
            Config(schedule="interleaved_1f1b"),
        ),
        ("dense pp2 x tp2 1f1b", "dense", 4, Sizes(pp_size=2, tp_size=2), Config(schedule="1f1b")),
        (
            "llama pp2 x tp2 interleaved_1f1b",
            "llama",
            4,
            Sizes(pp_size=2, tp_size=2),
            Config(schedule="interleaved_1f1b"),
        ),
        ("moe pp2 x dp_shard2 1f1b", "moe", 4, Sizes(pp_size=2), Config(schedule="1f1b")),
    ],
    8: [
        (
            "dense pp2 x hsdp(2x2) 1f1b",
            "dense",
            4,
            Sizes(pp_size=2, dp_replicate_size=2),
            Config(schedule="1f1b"),
        ),
        (
            "dense pp2 x dp_shard2 x tp2 1f1b",
            "dense",
            4,
            Sizes(pp_size=2, tp_size=2),
            Config(schedule="1f1b"),
        ),
        (
            "llama pp2 x dp_shard2 x tp2 interleaved_1f1b",
            "llama",
            4,
            Sizes(pp_size=2, tp_size=2),
            Config(schedule="interleaved_1f1b"),
        ),
    ],
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, choices=sorted(MATRIX), nargs="*", default=sorted(MATRIX))
    parser.add_argument("--out", type=Path, default=Path("runs/pipeline_matrix.json"), help="JSON rows")
    opts = parser.parse_args()
    rows = []
    for world in opts.world:
        cases = {case[0]: case for case in MATRIX[world]}
        rows += run_cases(cases, pipeline_parity, world, out=opts.out, timeout=3600)
    sys.exit(0 if all(row["ok"] for row in rows) else 1)


if __name__ == "__main__":
    main()
