"""Replicated styles on modules with children and buffers (a gated norm), on real gloo ranks."""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ParallelStyle, parallelize_module

from plait.testing import run_on_ranks
from plait.testing.parity import full_tensor
from plait.tp import ReplicatedWithGradAllReduce, ReplicateParallel, SequenceParallelNorm


class GatedNorm(nn.Module):
    """A norm with a nested norm, a nested gate and a buffer (AXK2's gated norm, XIELU's ``beta``)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(dim)
        self.gate = nn.Linear(dim, dim, bias=False)
        self.register_buffer("beta", torch.tensor(0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.norm(x)
        return y * torch.sigmoid(self.gate(y)) + self.beta * x


def _grads(ref: nn.Module, par: nn.Module) -> dict[str, Any]:
    par_params = dict(par.named_parameters())
    return {
        name: (
            (full_tensor(par_params[name].grad) - p.grad).abs().max().item() / p.grad.abs().max().item(),
            par_params[name].grad.placements,
        )
        for name, p in ref.named_parameters()
    }


def _run(style: ParallelStyle, shard_dim: int | None, sequence: bool) -> dict[str, Any]:
    """``shard_dim``: the dim this rank's input is a slice of (``None``: the whole input)."""
    mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
    rank, world = mesh.get_local_rank(), mesh.size()
    torch.manual_seed(0)
    ref = GatedNorm(8)
    with torch.no_grad():
        ref.norm.weight.uniform_()
    par = copy.deepcopy(ref)
    parallelize_module(par, mesh, style)
    x = torch.randn(2, 4, 4, 8)
    ref(x).pow(2).sum().backward()
    local = x if shard_dim is None else x.chunk(world, dim=shard_dim)[rank]
    if sequence:
        out = par(DTensor.from_local(local, mesh, [Shard(1)])).redistribute(placements=[Replicate()])
        out.to_local().pow(2).sum().backward()
    else:
        par(local).pow(2).sum().backward()
    return {
        "grads": _grads(ref, par),
        "buffer": type(par.beta).__name__,
        "state_dict": sorted(par.state_dict()),
    }


def _all_checks() -> dict[str, Any]:
    return {
        "replicate": _run(ReplicateParallel(), None, sequence=False),
        "heads": _run(ReplicatedWithGradAllReduce(), 2, sequence=False),
        "sequence": _run(SequenceParallelNorm(), 1, sequence=True),
    }


def test_replicated_styles_cover_children_and_buffers() -> None:
    for rank, result in enumerate(run_on_ranks(_all_checks, 2)):
        for case, r in result.items():
            assert sorted(r["grads"]) == ["gate.weight", "norm.weight"], (rank, case, r)
            for name, (diff, placements) in r["grads"].items():
                assert diff <= 1e-5, (rank, case, name, diff)
                assert placements == (Replicate(),), (rank, case, name, placements)
            assert r["buffer"] == "DTensor", (rank, case)  # swapped only while the module runs
            assert r["state_dict"] == ["beta", "gate.weight", "norm.weight"], (rank, case)
