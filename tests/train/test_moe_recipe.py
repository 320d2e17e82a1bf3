"""The recipe's `parallel.moe` section maps strictly onto MoEConfig and is refused where it would be ignored."""

from __future__ import annotations

import pytest

from plait.mesh import MoEConfig
from plait.train.config import ParallelConfig


def test_moe_section_maps_onto_moe_config() -> None:
    parallel = ParallelConfig(ep_size=2, moe={"reshard_after_forward": False, "lm_head_precision": "float32"})
    moe = MoEConfig.from_dict(parallel.moe)
    assert moe.reshard_after_forward is False and str(moe.lm_head_precision) == "torch.float32"


def test_unknown_moe_key_is_refused() -> None:
    with pytest.raises(ValueError, match="reshard_after_fwd"):
        ParallelConfig(ep_size=2, moe={"reshard_after_fwd": False})


def test_moe_section_without_expert_parallel_is_refused() -> None:
    with pytest.raises(ValueError, match=r"parallel.moe .* only read with parallel.ep_size > 1"):
        ParallelConfig(ep_size=1, moe={"reshard_after_forward": False})
