"""Prefetch wiring: each unit prefetches exactly the configured neighbours, or nothing when disabled."""

from __future__ import annotations

import pytest
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule

from plait.sharding import apply_fsdp_sharding, wire_fsdp_prefetch
from plait.testing.fake_pg import fake_process_group


class _Stack(nn.Module):
    def __init__(self, n: int = 5) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(n))


def _prefetched(unit: nn.Module) -> tuple[list[int], list[int]]:
    """Indices (into the unit list) of the units ``unit`` forward- and backward-prefetches."""
    state = unit._get_fsdp_state()  # type: ignore[operator]
    return state._states_to_forward_prefetch, state._states_to_backward_prefetch


def _wired(**kwargs: object) -> tuple[list[nn.Module], list[tuple[list[int], list[int]]]]:
    with fake_process_group(4):
        model = _Stack()
        units = apply_fsdp_sharding(model, init_device_mesh("cpu", (4,)), **kwargs)  # type: ignore[arg-type]
        states = [u._get_fsdp_state() for u in units]  # type: ignore[operator]
        wiring = [
            ([states.index(s) for s in fwd], [states.index(s) for s in bwd])
            for fwd, bwd in map(_prefetched, units)
        ]
    return units, wiring


@pytest.mark.parametrize(("forward", "backward"), [(1, 2), (2, 1), (3, 3), (0, 2), (1, 0)])
def test_each_unit_prefetches_the_configured_depths(forward: int, backward: int) -> None:
    units, wiring = _wired(forward_prefetch_depth=forward, backward_prefetch_depth=backward)
    assert len(units) == 5
    for i, (fwd, bwd) in enumerate(wiring):
        assert fwd == list(range(i + 1, min(i + 1 + forward, 5))), i
        assert bwd == list(range(i - 1, max(i - 1 - backward, -1), -1)), i  # nearest first


@pytest.mark.parametrize(
    "kwargs",
    [
        {"enable_prefetch": False},
        {"reshard_after_forward": False},
        {"forward_prefetch_depth": 0, "backward_prefetch_depth": 0},
    ],
)
def test_prefetch_can_be_disabled(kwargs: dict) -> None:
    units, wiring = _wired(**kwargs)
    assert len(units) == 5 and all(isinstance(u, FSDPModule) for u in units)
    assert wiring == [([], [])] * 5


@pytest.mark.parametrize("depth", [-1, 1.5, True])
def test_bad_depth_is_rejected_before_wrapping(depth: object) -> None:
    model = _Stack()
    with pytest.raises(ValueError, match="forward_prefetch_depth"):
        apply_fsdp_sharding(model, None, forward_prefetch_depth=depth)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="backward_prefetch_depth"):
        wire_fsdp_prefetch([], forward_depth=1, backward_depth=depth)  # type: ignore[arg-type]
    assert not any(isinstance(m, FSDPModule) for m in model.modules())
