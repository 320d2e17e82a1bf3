"""parallelize_model refuses context parallel with what is not built, before any strategy runs."""

from __future__ import annotations

import pytest

from plait.mesh import FSDP2Config, MegatronFSDPConfig, MeshContext, ParallelismSizes
from plait.sidecar import parallelize_model
from tests.cp._cp_parity import build_model


@pytest.mark.parametrize(
    ("config", "sizes", "match"),
    [
        (MegatronFSDPConfig(), {}, "built for FSDP2 only, got MegatronFSDPConfig"),
        (FSDP2Config(mp_policy=None), {"ep_size": 2}, "with ep_size=2 is not built"),
    ],
)
def test_unbuilt_combinations_are_refused(fake_pg, config, sizes, match) -> None:
    """parallelize_model refuses them before any strategy runs (the MoE and Megatron-FSDP paths included)."""
    with fake_pg(4):
        ctx = MeshContext.build(config, ParallelismSizes(cp_size=2, **sizes))
        with pytest.raises(ValueError, match=match):
            parallelize_model(build_model("llama"), ctx)
