"""One family in its own process: each mesh configuration on 4 gloo ranks, results as JSON lines."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple


class Case(NamedTuple):
    """One mesh configuration of the sweep on 4 ranks (``dp_shard`` takes the ranks tp and cp leave)."""

    name: str
    tp: int
    sp: bool
    cp: int
    title: str  # the report's column


CASES: tuple[Case, ...] = (
    Case("tp2", 2, False, 1, "tp2"),
    Case("tp2+SP", 2, True, 1, "tp2+SP"),
    Case("tp4", 4, False, 1, "tp4"),
    Case("cp2", 1, False, 2, "cp2"),
    Case("cp2_tp2", 2, False, 2, "cp2\u00d7tp2"),
)
TP_CASES = tuple(c for c in CASES if c.cp == 1)
CP_CASES = tuple(c for c in CASES if c.cp > 1)


def select_cases(names: str) -> tuple[Case, ...]:
    """The cases named in a comma-separated list (all of :data:`CASES` when empty), in table order."""
    wanted = [n for n in names.split(",") if n]
    unknown = sorted(set(wanted) - {c.name for c in CASES})
    if unknown:
        raise SystemExit(f"unknown cases {unknown}; the cases are {[c.name for c in CASES]}")
    return tuple(c for c in CASES if not wanted or c.name in wanted)


def _merge(per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """Rank 0's record, worst status over ranks (a mismatch on any rank is a mismatch)."""
    order = ["crash", "mismatch", "refused", "config", "pass"]
    worst = min(per_rank, key=lambda r: order.index(r["status"]))
    return {**per_rank[0], "status": worst["status"], "message": worst.get("message", "")}


def run_family(
    model_type: str, timeout: float, dtype: str = "float32", cases: Sequence[Case] = CASES
) -> Iterator[dict[str, Any]]:
    """Each mesh configuration of one family on 4 gloo ranks, one record per configuration."""
    import transformers  # noqa: F401  (preloaded into the rank workers)

    from hf_sweep.rank import run_case
    from plait.testing import run_on_ranks

    for case in cases:
        try:
            args = (model_type, case.tp, case.sp, dtype, case.cp)
            record = _merge(run_on_ranks(run_case, 4, *args, timeout=timeout))
        except Exception as exc:  # a hang (timeout) or a dead rank: the workers are discarded
            record = {"status": "crash", "message": f"{type(exc).__name__}: {str(exc)[:400]}"}
        yield {"family": model_type, "case": case.name, **record}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("model_type")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per mesh configuration")
    parser.add_argument("--cases", default="", help="comma-separated case names (default: all)")
    args = parser.parse_args(argv)
    for record in run_family(args.model_type, args.timeout, cases=select_cases(args.cases)):
        print(json.dumps(record), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
