"""Expert parallel on unmodified Hugging Face MoE families: the full parity matrix, as JSON lines.

Every family of ``tests/sidecar/_hf_moe.py`` present in the locked transformers, at ep=2 (ep_shard=2),
ep=4 and ep=2 x tp=2 (the model's own TP plan, its expert entries dropped) on 4 gloo ranks: step-0
per-parameter gradients and parameters after 2 SGD steps (relative to the reference's largest entry),
router aux loss, state-dict keys, held expert bytes, and the reference's smallest router margin. CI runs a subset (tests/sidecar/test_moe_hf.py).
Usage: ``uv run python tools/moe_hf_sweep.py [family ...]``.
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from plait.testing import run_on_ranks
from tests.sidecar._hf_moe import FAMILIES, LAYOUTS, available, hf_parity


def _rank_body(cases: list[tuple[str, str]]) -> list[dict]:
    out = []
    for family, layout in cases:
        try:
            r = hf_parity(family, layout)
            row = asdict(r) | {"margin": r.margins.smallest}
            row.pop("margins")
            try:
                r.check()
                row["ok"] = True
            except AssertionError as exc:
                row["ok"], row["why"] = False, str(exc)[:300]
        except Exception as exc:
            row = {"case": f"{family} {layout}", "ok": False, "error": f"{type(exc).__name__}: {exc}"[:400]}
        out.append(row)
    return out


def main() -> None:
    families = sys.argv[1:] or [f for f in FAMILIES if available(f)]
    cases = [(f, layout) for f in families for layout in LAYOUTS]
    for row in run_on_ranks(_rank_body, 4, cases, timeout=3000)[0]:
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
