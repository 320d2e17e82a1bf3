"""Unit selection and per-unit reshard policy, checked on the fake process group (no communication)."""

from __future__ import annotations

from typing import Any

import pytest
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard

from plait.sharding import (
    apply_fsdp_sharding,
    fully_shard_root,
    select_fsdp_units,
    unit_reshard_after_forward,
)
from plait.testing.fake_pg import fake_process_group
from plait.testing.models import NestedContainerModel


class _Nested(nn.Module):
    """ModuleDict of ModuleLists, a ModuleList inside a ModuleList, plain leaves in between."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.towers = nn.ModuleDict(
            {"a": nn.ModuleList(nn.Linear(8, 8) for _ in range(2)), "b": nn.ModuleList([nn.Linear(8, 8)])}
        )
        self.stack = nn.Sequential(nn.LayerNorm(8))
        self.stack.blocks = nn.ModuleList(
            [nn.Linear(8, 8), nn.ModuleList([nn.Linear(8, 8), nn.Linear(8, 8)]), nn.ReLU()]
        )
        self.head = nn.Linear(8, 16)


_EXPECTED = [
    "towers.a.0",
    "towers.a.1",
    "towers.b.0",
    "stack.blocks.0",
    "stack.blocks.1.0",
    "stack.blocks.1.1",
]


class _Recorder:
    """A ``shard_fn`` that records its calls and delegates to ``fully_shard``."""

    def __init__(self, names: dict[int, str]) -> None:
        self.names = names
        self.calls: list[tuple[str, dict[str, Any]]] = []

    def __call__(self, module: nn.Module, **kwargs: Any) -> nn.Module:
        self.calls.append((self.names[id(module)], kwargs))
        return fully_shard(module, **kwargs)


def test_every_container_element_is_a_unit_and_containers_are_walked_into() -> None:
    model = _Nested()
    assert [c.fqn for c in select_fsdp_units(model)] == _EXPECTED  # ReLU has no parameters
    assert [c.last for c in select_fsdp_units(model)] == [False, True, True, False, False, True]


def test_shared_nested_container_model_units() -> None:
    model = NestedContainerModel()
    with fake_process_group(2):
        units = apply_fsdp_sharding(model, init_device_mesh("cpu", (2,)))
    names = {id(m): fqn for fqn, m in model.named_modules()}
    assert [names[id(u)] for u in units] == [
        "towers.text.0",
        "towers.text.1",
        "towers.image.0",
        "towers.image.1",
        "stages.0",
        "stages.1",  # an element is a unit as a whole: its own `blocks` list is not walked
        "grid.0.0",
        "grid.0.1",
        "grid.1.0",
    ]
    reshard = [u._get_fsdp_state()._fsdp_param_group.post_forward_mesh_info is not None for u in units]
    assert reshard == [True, False, True, False, True, False, True, False, False]
    assert not any(isinstance(m, FSDPModule) for m in (model.embed, model.mixer, model.head, model.towers))


def _shard(model: nn.Module, world: int = 4, **kwargs: Any) -> _Recorder:
    recorder = _Recorder({id(m): fqn for fqn, m in model.named_modules()})
    with fake_process_group(world):
        mesh = init_device_mesh("cpu", (world,))
        units = apply_fsdp_sharding(model, mesh, shard_fn=recorder, **kwargs)
        fully_shard_root(model, mesh, mp_policy=None, offload_policy=None, shard_fn=recorder)
    assert units == [model.get_submodule(fqn) for fqn in _EXPECTED]
    return recorder


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({}, [True, False, False, True, True, False]),  # last element of each container stays gathered
        ({"reshard_after_forward": False}, [False] * 6),
    ],
)
def test_reshard_policy_per_unit_and_the_root_last(kwargs: dict, expected: list[bool]) -> None:
    model = _Nested()
    recorder = _shard(model, **kwargs)
    names = [name for name, _ in recorder.calls]
    assert names == [*_EXPECTED, ""]  # the root is wrapped last
    assert [kw["reshard_after_forward"] for _, kw in recorder.calls] == [*expected, False]
    assert all(isinstance(model.get_submodule(n), FSDPModule) for n in names)
    assert not isinstance(model.towers, FSDPModule) and not isinstance(model.stack.blocks[1], FSDPModule)
    assert not isinstance(model.embed, FSDPModule) and not isinstance(model.head, FSDPModule)


def test_exclude_and_ignored_params() -> None:
    model = _Nested()
    ignored = set(model.towers["b"][0].parameters())
    with fake_process_group(2):
        units = apply_fsdp_sharding(
            model, init_device_mesh("cpu", (2,)), exclude=[model.stack], ignored_params=ignored
        )
    assert units == [model.towers["a"][0], model.towers["a"][1]]  # towers.b.0 has nothing left to shard
    assert not any(isinstance(m, FSDPModule) for m in model.stack.modules())


@pytest.mark.parametrize(
    ("role", "options", "expected"),
    [
        ("layer", {"last": False}, True),
        ("layer", {"last": True}, False),  # needed first in backward: freeing it only costs a gather
        ("layer", {"pipeline_stage": True}, False),  # every microbatch would gather it again
        ("layer", {"pipeline_stage": True, "explicit": True}, True),  # an explicit value wins
        ("layer", {"explicit": 2}, 2),
        ("experts", {"last": True}, True),
        ("experts", {"explicit": True, "replays_ops": True}, False),  # selective recompute replays by index
        ("input_embedding", {}, True),
        ("input_embedding", {"explicit": False}, False),
        ("input_embedding", {"pipeline_stage": True}, False),
        ("output_embedding", {"explicit": True}, False),
        ("root", {"explicit": True}, False),
        ("head", {}, False),
        ("child", {}, False),
    ],
)
def test_one_reshard_policy_for_every_unit(role: str, options: dict, expected: bool | int) -> None:
    assert unit_reshard_after_forward(role, **options) == expected
