"""``tools/gpu_check/run --dry-run``: the one-GPU check's whole path on CPU, with the GPU run's schema."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
VARIANTS = ["eager", "compile", "compile+float8_tensorwise", "compile+float8_rowwise"]
MEASURED = ["step_time_s", "tokens_per_s_per_gpu", "tflops_per_gpu", "state_bytes", "plan_estimate_bytes"]


def _positive(value: Any) -> bool:
    return isinstance(value, int | float) and math.isfinite(value) and value > 0


def _dry_run(*extra: str) -> dict[str, Any]:
    proc = subprocess.run(
        [str(REPO / "tools/gpu_check/run"), "--dry-run", *extra],
        cwd=REPO,
        env={**os.environ, "GPU_CHECK_PYTHON": sys.executable},  # the wrapper, on this test's Python
        capture_output=True,
        text=True,
        timeout=480,  # ~40 s alone; it compiles its layers (inductor) and shares 2 cores with the other lanes
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    for name in VARIANTS:  # one torchtitan-style line per variant
        assert any(line.startswith(f"gpu_check {name} ") for line in lines), proc.stdout
    return json.loads(lines[-1])


@pytest.mark.parametrize(
    "extra",
    # the compile variant builds its layers with inductor (most of the dry run's time): tools/slow_tests
    [("--no-compile",), pytest.param((), marks=pytest.mark.slow)],
    ids=["no-compile", "whole"],
)
def test_the_dry_run_reports_every_variant_measured_or_skipped_with_a_reason(extra: tuple[str, ...]):
    doc = _dry_run(*extra)
    assert doc["dry_run"] is True and doc["device"]["type"] == "cpu"
    assert [v["variant"] for v in doc["variants"]] == VARIANTS
    for variant in doc["variants"]:
        if "skipped" in variant:
            assert variant["skipped"].strip(), variant
            continue
        for key in MEASURED:
            assert _positive(variant[key]), (variant["variant"], key, variant[key])
        assert all(_positive(t) for t in variant["step_times_s"])
        assert math.isfinite(variant["loss_last"])
        assert variant["mfu"] is None  # no peak FLOP/s for a CPU
        # plan counts what the rank holds (parameters, gradients, AdamW state): measured the same.
        assert abs(variant["state_over_plan"] - 1) < 0.01, variant
    assert {v["variant"] for v in doc["variants"] if "skipped" in v} >= set(VARIANTS[2:])  # float8: not built
    assert ("skipped" in doc["variants"][1]) == bool(extra), doc["variants"][
        1
    ]  # measured unless --no-compile
    checks = {c["check"]: c for c in doc["checks"]}
    assert checks["process_group"]["backend"] == "gloo" and checks["process_group"]["all_reduce_ok"]
    assert checks["async_tp"]["skipped"]
    flops = doc["model"]["flops_per_token"]
    arch, seq = doc["model"]["arch"], doc["model"]["seq_len"]
    assert (
        flops
        == 6 * doc["model"]["non_embedding_params"]
        + 12 * arch["num_hidden_layers"] * arch["hidden_size"] * seq
    )
    assert set(doc["goals"]) >= {"mfu_compiled_bf16", "peak_memory_vs_plan"}
