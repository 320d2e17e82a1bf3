"""A 70B-shaped Llama decoder on the meta device, FSDP+TP on a 4,096-rank fake process group.

Runs in a fresh subprocess so the peak RSS belongs to this measurement alone.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

WORLD, TP = 4096, 8
MAX_SECONDS, MAX_RSS_GIB = 60.0, 4.0


def measure() -> dict[str, Any]:
    """Build meshes and the meta model, parallelize once, and report times, RSS and the result's shape."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    from plait.mesh import FSDP2Config, MeshContext, ParallelismSizes
    from plait.models import DecoderConfig, DenseDecoder, preset_arch
    from plait.sidecar import parallelize_model
    from plait.testing.fake_pg import fake_process_group

    start = time.perf_counter()
    with fake_process_group(WORLD):
        with torch.device("meta"):
            model = DenseDecoder(DecoderConfig(**preset_arch("dense", "llama3-70b")))
        ctx = MeshContext.build(FSDP2Config(sequence_parallel=True), ParallelismSizes(tp_size=TP))
        t0 = time.perf_counter()
        model = parallelize_model(model, ctx)
        parallelize_s = time.perf_counter() - t0
        q_proj = model.model.layers[0].self_attn.q_proj.weight
        result = {
            "parallelize_s": parallelize_s,
            "fsdp_units": sum(isinstance(m, FSDPModule) for m in model.modules()),
            "all_dtensor": all(isinstance(p, DTensor) for p in model.parameters()),
            "q_proj_mesh": list(q_proj.device_mesh.mesh_dim_names),
            "q_proj_local_shape": list(q_proj.to_local().shape),
            "local_heads": model.model.layers[0].self_attn.num_heads,
        }
    result["total_s"] = time.perf_counter() - start
    result["peak_rss_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    return result


@pytest.mark.slow  # a fresh interpreter and a 70B meta model: tools/slow_tests (1024 fake ranks: tests/sharding)
def test_70b_fsdp_tp_on_4096_fake_ranks_is_fast_and_small() -> None:
    root = Path(__file__).resolve().parents[2]
    code = f"import json; from {__name__} import measure; print(json.dumps(measure()))"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(
        [sys.executable, "-c", code],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    print(
        f"\n70B FSDP+TP on {WORLD} fake ranks (tp={TP}): parallelize {r['parallelize_s']:.1f} s, "
        f"total with meshes and meta model {r['total_s']:.1f} s, peak RSS {r['peak_rss_gib']:.2f} GiB, "
        f"{r['fsdp_units']} FSDP modules"
    )
    assert r["total_s"] < MAX_SECONDS, r
    assert r["peak_rss_gib"] < MAX_RSS_GIB, r
    assert r["all_dtensor"], r
    assert r["q_proj_mesh"] == ["dp_shard", "tp"], r
    # 8192 output rows split over tp=8 (1024) and then over dp_shard=512 (2 rows each).
    assert r["q_proj_local_shape"] == [8192 // TP // (WORLD // TP), 8192], r
    assert r["local_heads"] == 64 // TP, r
    assert r["fsdp_units"] >= 80 + 1, r
