"""The planner's peak memory and collective bytes against a measured step (gloo, CPU) of the same recipe.

The full table (18 layouts) is ``tools/memory_model``; this runs two of its layouts: FSDP on 2
ranks with no checkpointing (activations dominate) and TP + SP on 2 ranks.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[2] / "tools" / "memory_model"))

from compare import estimate, measured
from measure import LAYOUTS

from plait.testing.memory_probe import run_layout


@pytest.mark.parametrize("name", ["fsdp2_w2_ac_none", "tp2_sp_w2"])
def test_estimate_is_within_ten_percent_of_the_measured_step(name: str, tmp_path: Path) -> None:
    spec = next(layout for layout in LAYOUTS if layout["name"] == name)
    ranks = run_layout(spec["recipe"], spec["overrides"], spec["world_size"], str(tmp_path))
    entry = {"layout": spec, "ranks": ranks}
    (est_peak, est_comm), (got_peak, got_comm) = estimate(entry), measured(entry)
    assert 0.9 <= est_peak / got_peak <= 1.1, (est_peak, got_peak)
    for kind, got in got_comm.items():
        if got > 1 << 20:  # scalars (token counts, loss-parallel statistics) are not modelled
            assert 0.9 <= est_comm.get(kind, 0.0) / got <= 1.1, (kind, est_comm, got_comm)
