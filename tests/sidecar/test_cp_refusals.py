"""parallelize_model refuses context parallel with what is not built (the combination table), before any strategy runs."""

from __future__ import annotations

import pytest
from torch.distributed.tensor import DTensor

from plait.mesh import FSDP2Config, MegatronFSDPConfig, MeshContext, ParallelismSizes
from plait.sidecar import parallelize_model
from plait.testing import cp_decoder


@pytest.mark.parametrize(
    ("config", "sizes", "match"),
    [
        (MegatronFSDPConfig(), {}, "Megatron-FSDP does not support cp_size=2: .*FSDP2 flow only"),
    ],
)
def test_unbuilt_combinations_are_refused(fake_pg, config, sizes, match) -> None:
    """parallelize_model refuses them before any strategy runs (the Megatron-FSDP path included)."""
    with fake_pg(4):
        ctx = MeshContext.build(config, ParallelismSizes(cp_size=2, **sizes))
        with pytest.raises(ValueError, match=match):
            parallelize_model(cp_decoder("llama"), ctx)


def test_all_to_all_with_heads_not_dividing_by_cp_is_refused(fake_pg) -> None:
    """parallelize_model: the cp step names the modules before any other step (nothing is sharded)."""
    with fake_pg(8):
        ctx = MeshContext.build(
            FSDP2Config(mp_policy=None, cp_attention="all_to_all"), ParallelismSizes(cp_size=4, tp_size=2)
        )
        model = cp_decoder("dense")  # 4 query heads: 2 per tp rank, not divisible by cp 4
        with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn \(4 query heads, tp_size=2\)"):
            parallelize_model(model, ctx)
        assert not any(isinstance(p, DTensor) for p in model.parameters())
