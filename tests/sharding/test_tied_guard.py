"""Tied modules inside a layer container: refused before anything is wrapped, the model left untouched."""

from __future__ import annotations

import pytest
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from plait.sharding import apply_fsdp_sharding, guard_tied_embeddings, tied_parameter_groups
from plait.testing.fake_pg import fake_process_group


class _Embed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)


class _Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 10, bias=False)


class _TiedInContainer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([_Embed(), nn.Linear(4, 4), _Head()])
        self.blocks[2].proj.weight = self.blocks[0].embed.weight


class _TiedAtTop(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.embed.weight


def _untouched(model: _TiedInContainer) -> bool:
    return (
        not any(isinstance(m, FSDPModule) for m in model.modules())
        and not any(isinstance(p, DTensor) for p in model.parameters())
        and model.blocks[2].proj.weight is model.blocks[0].embed.weight
    )


def test_tied_parameters_are_found_by_identity() -> None:
    assert tied_parameter_groups(_TiedInContainer()) == [["blocks.0.embed.weight", "blocks.2.proj.weight"]]
    assert tied_parameter_groups(_TiedAtTop()) == [["embed.weight", "head.weight"]]


def test_tied_modules_in_a_container_are_refused_before_wrapping() -> None:
    model = _TiedInContainer()
    with pytest.raises(ValueError, match=r"'blocks\.0\.embed\.weight'.*'blocks\.2\.proj\.weight'"):
        guard_tied_embeddings(model)
    pattern = r"blocks\.0\.embed\.weight.*blocks\.2\.proj\.weight"
    with fake_process_group(2), pytest.raises(ValueError, match=pattern):
        apply_fsdp_sharding(model, init_device_mesh("cpu", (2,)))
    assert _untouched(model)


def test_tied_modules_outside_containers_pass_the_guard() -> None:
    model = _TiedAtTop()
    guard_tied_embeddings(model)
    with fake_process_group(2):
        units = apply_fsdp_sharding(model, init_device_mesh("cpu", (2,)))
    assert units == list(model.layers)
    assert model.head.weight is model.embed.weight
