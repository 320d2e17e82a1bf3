"""The full pipeline-parallel acceptance matrix (too slow for CI on 2 cores); prints one JSON line per case.

Each case: loss and every parameter gradient after step 0, and every parameter after 2 SGD steps,
against the unsharded reference (relative to the reference's largest |value|; must be <= 1e-5).

    uv run python tools/pipeline_matrix.py            # all world sizes
    uv run python tools/pipeline_matrix.py --world 8  # one world size
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from plait.mesh import ParallelismSizes as Sizes
from plait.pipeline import PipelineConfig as Config
from plait.testing import run_on_ranks
from tests.pipeline._parity import run_case

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


def _body(cases: list[tuple]) -> list[dict]:
    return [dataclasses.asdict(run_case(*case)) for case in cases]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, choices=sorted(MATRIX), nargs="*", default=sorted(MATRIX))
    opts = parser.parse_args()
    failed = 0
    for world in opts.world:
        start = time.perf_counter()
        per_rank = run_on_ranks(_body, world, MATRIX[world], timeout=3600)
        for i, case in enumerate(MATRIX[world]):
            rows = [rank[i] for rank in per_rank]
            worst = {k: max(r[k] for r in rows) for k in ("loss_diff", "grad_diff", "param_diff")}
            adamw = max(d for r in rows for d in r["adamw_loss_diffs"])
            ok = all(v <= 1e-5 for v in worst.values()) and adamw <= 1e-4
            ok &= all(r["grads_compared"] > 0 for r in rows)
            failed += not ok
            print(
                json.dumps({"world": world, "case": case[0], "ok": ok, **worst, "adamw": adamw}), flush=True
            )
        print(json.dumps({"world": world, "seconds": round(time.perf_counter() - start, 1)}), flush=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
