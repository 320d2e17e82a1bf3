"""Test inputs: the container-layout model."""

import torch

from plait.testing import NestedContainerModel


def test_nested_container_model_layout_and_every_parameter_used():
    model = NestedContainerModel(hidden_size=16)
    modules = dict(model.named_modules())
    assert isinstance(modules["towers"], torch.nn.ModuleDict)
    assert isinstance(modules["towers.text"], torch.nn.ModuleList)
    assert isinstance(modules["stages.1.blocks"], torch.nn.ModuleList)
    assert isinstance(modules["grid.0"], torch.nn.ModuleList) and "grid.0.1" in modules
    assert isinstance(modules["mixer"], torch.nn.Linear)
    model(torch.randn(2, 4, 16)).sum().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())
