"""One family in its own process: each mesh configuration on 4 gloo ranks, results as JSON lines."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator
from typing import Any

CASES = (("tp2", 2, False), ("tp2+SP", 2, True), ("tp4", 4, False))


def _merge(per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """Rank 0's record, worst status over ranks (a mismatch on any rank is a mismatch)."""
    order = ["crash", "mismatch", "refused", "config", "pass"]
    worst = min(per_rank, key=lambda r: order.index(r["status"]))
    return {**per_rank[0], "status": worst["status"], "message": worst.get("message", "")}


def run_family(model_type: str, timeout: float, dtype: str = "float32") -> Iterator[dict[str, Any]]:
    """Each mesh configuration of one family on 4 gloo ranks, one record per configuration."""
    import transformers  # noqa: F401  (preloaded into the rank workers)

    from hf_sweep.rank import run_case
    from plait.testing import run_on_ranks

    for name, tp, sp in CASES:
        try:
            record = _merge(run_on_ranks(run_case, 4, model_type, tp, sp, dtype, timeout=timeout))
        except Exception as exc:  # a hang (timeout) or a dead rank: the workers are discarded
            record = {"status": "crash", "message": f"{type(exc).__name__}: {str(exc)[:400]}"}
        yield {"family": model_type, "case": name, **record}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("model_type")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per mesh configuration")
    args = parser.parse_args(argv)
    for record in run_family(args.model_type, args.timeout):
        print(json.dumps(record), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
