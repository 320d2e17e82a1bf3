"""Expert parallel on unmodified Hugging Face MoE families: the full parity matrix, as JSON lines.

Every family of ``plait.testing.HF_MOE_FAMILIES`` present in the locked transformers, at ep=2
(ep_shard=2), ep=4 and ep=2 x tp=2 (the model's own TP plan, its expert entries dropped) on 4 gloo
ranks: step-0 per-parameter gradients and parameters after 2 SGD steps (relative to the reference's
largest entry), router aux loss, state-dict keys, held expert bytes, and the reference's smallest
router margin (``hf_moe_parity``). CI runs a subset (tests/sidecar/test_moe_hf.py).
Usage: ``uv run python tools/moe_hf_sweep.py [--out FILE] [family ...]``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from plait.testing import HF_MOE_FAMILIES, HF_MOE_LAYOUTS, hf_moe_available, hf_moe_parity, run_cases


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("families", nargs="*", help="default: every family the locked transformers has")
    parser.add_argument("--out", type=Path, default=Path("runs/moe_hf_sweep.json"), help="JSON rows")
    opts = parser.parse_args()
    families = opts.families or [f for f in HF_MOE_FAMILIES if hf_moe_available(f)]
    cases = {f"{f} {layout}": (f, layout) for f in families for layout in HF_MOE_LAYOUTS}
    rows = run_cases(cases, hf_moe_parity, 4, out=opts.out, timeout=3000)
    sys.exit(0 if all(row["ok"] for row in rows) else 1)


if __name__ == "__main__":
    main()
