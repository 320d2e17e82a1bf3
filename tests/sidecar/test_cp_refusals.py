"""parallelize_model refuses context parallel with what is not built (the combination table), before any strategy runs."""

from __future__ import annotations

import pytest

from plait.mesh import FSDP2Config, MegatronFSDPConfig, MeshContext, ParallelismSizes
from plait.sidecar import parallelize_model
from plait.testing import cp_decoder


@pytest.mark.parametrize(
    ("config", "sizes", "match"),
    [
        (MegatronFSDPConfig(), {}, "Megatron-FSDP does not support cp_size=2: .*FSDP2 flow only"),
        (FSDP2Config(mp_policy=None), {"ep_size": 2}, "cp_size=2 with ep_size=2 is not supported"),
    ],
)
def test_unbuilt_combinations_are_refused(fake_pg, config, sizes, match) -> None:
    """parallelize_model refuses them before any strategy runs (the MoE and Megatron-FSDP paths included)."""
    with fake_pg(4):
        ctx = MeshContext.build(config, ParallelismSizes(cp_size=2, **sizes))
        with pytest.raises(ValueError, match=match):
            parallelize_model(cp_decoder("llama"), ctx)
