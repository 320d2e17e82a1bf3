"""The custom styles on real gloo ranks, module by module, against the unsharded module."""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import parallelize_module

from plait.testing import run_on_ranks
from plait.testing.parity import full_tensor
from plait.tp import (
    ReplicatedWithGradAllReduce,
    ReplicateParallel,
    RotaryEmbeddingParallel,
    SequenceParallelAllGather,
    SequenceParallelNorm,
    VocabParallelEmbedding,
)


class PositionsFromHidden(nn.Module):
    """A rotary module that derives the positions from the hidden state's sequence length."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("inv_freq", torch.tensor([1.0, 0.1]), persistent=False)

    def forward(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = torch.arange(hidden.shape[1], dtype=torch.float32)[:, None] * self.inv_freq
        return freqs.cos(), freqs.sin()


def _diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (full_tensor(a) - full_tensor(b)).abs().max().item()


def _embedding_checks(mesh: Any) -> dict[str, Any]:
    """vocab 5 over 4 ranks: rows 2, 2, 1, 0 (one rank holds an empty slice); a padding row."""
    out: dict[str, Any] = {}
    for sp in (False, True):
        ref = nn.Embedding(5, 3, padding_idx=4)
        par = copy.deepcopy(ref)
        style = (
            VocabParallelEmbedding(output_layouts=Shard(1), use_local_output=False)
            if sp
            else VocabParallelEmbedding()
        )
        parallelize_module(par, mesh, style)
        ids = torch.tensor([[0, 1, 2, 3], [4, 3, 2, 1]])
        ref_out, par_out = ref(ids), par(ids)
        (ref_out * torch.arange(24.0).view(2, 4, 3)).sum().backward()
        weights = torch.arange(24.0).view(2, 4, 3)
        if sp:
            weights = DTensor.from_local(weights, mesh, [Replicate()]).redistribute(placements=[Shard(1)])
        (par_out * weights).sum().backward()
        out[f"sp={sp}"] = {
            "out": _diff(ref_out, par_out),
            "grad": _diff(ref.weight.grad, par.weight.grad),
            "grad_placements": par.weight.grad.placements,
            "local_rows": par.weight.to_local().shape[0],
            "out_type": type(par_out).__name__,
            "out_is_view": not isinstance(par_out, DTensor) and par_out._base is not None,
        }
    return out


def _norm_checks(mesh: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    x = torch.randn(2, 8, 6)
    for name, style in (("sp", SequenceParallelNorm()), ("gather", SequenceParallelAllGather())):
        ref = nn.LayerNorm(6)
        with torch.no_grad():
            ref.weight.uniform_()
        par = copy.deepcopy(ref)
        parallelize_module(par, mesh, style)
        local = x.chunk(mesh.size(), dim=1)[mesh.get_local_rank()]
        ref_out, par_out = ref(x), par(local)
        ref_out.pow(2).sum().backward()
        full = par_out.redistribute(placements=[Replicate()]).to_local() if name == "sp" else par_out
        full.pow(2).sum().backward()
        out[name] = {
            "out": _diff(ref_out, full),
            "out_type": type(par_out).__name__,
            "out_shape": tuple(par_out.shape),
            "grad": _diff(ref.weight.grad, par.weight.grad),
            "grad_placements": par.weight.grad.placements,
        }
    return out


def _qk_norm_checks(mesh: Any) -> dict[str, Any]:
    """A per-head norm on this rank's heads: replicated weight, gradient summed over the group."""
    heads, head_dim, rank, world = 8, 4, mesh.get_local_rank(), mesh.size()
    x = torch.randn(2, 3, heads, head_dim)
    ref = nn.RMSNorm(head_dim)
    with torch.no_grad():
        ref.weight.uniform_()
    par = copy.deepcopy(ref)
    parallelize_module(par, mesh, ReplicatedWithGradAllReduce())
    ref_out = ref(x)
    ref_out.pow(3).sum().backward()
    local = x.chunk(world, dim=2)[rank]
    par_out = par(local)
    par_out.pow(3).sum().backward()
    return {
        "out": (ref_out.chunk(world, dim=2)[rank] - par_out).abs().max().item(),
        "out_type": type(par_out).__name__,
        "grad": _diff(ref.weight.grad, par.weight.grad),
        "grad_placements": par.weight.grad.placements,
    }


class _RecordingRMSNorm(nn.RMSNorm):
    """Notes the type of its weight each time it runs."""

    def __init__(self, dim: int) -> None:
        super().__init__(dim)
        self.seen: list[str] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(type(self.weight).__name__)
        return super().forward(x)


def _replicate_checks(mesh: Any) -> dict[str, Any]:
    """A plain input runs the module on local tensors; a DTensor input runs through DTensor."""
    x = torch.randn(2, 3, 6)  # the same on every rank, as a replicated activation is
    ref = _RecordingRMSNorm(6)
    with torch.no_grad():
        ref.weight.uniform_()
    out: dict[str, Any] = {}
    for name, kept_dtensor in (("plain", False), ("dtensor", True)):
        par = copy.deepcopy(ref)
        par.seen = []
        parallelize_module(par, mesh, ReplicateParallel(use_local_output=not kept_dtensor))
        ref.weight.grad = None
        ref_out = ref(x)
        ref_out.pow(3).sum().backward()
        par_in = DTensor.from_local(x, mesh, [Replicate()]) if kept_dtensor else x
        par_out = par(par_in)
        (par_out.full_tensor() if kept_dtensor else par_out).pow(3).sum().backward()
        out[name] = {
            "out": _diff(ref_out, par_out),
            "grad": _diff(ref.weight.grad, par.weight.grad),
            "grad_placements": par.weight.grad.placements,
            "out_type": type(par_out).__name__,
            "weight_in_forward": par.seen,
            "weight_after": type(par.weight).__name__,
            "state_dict": {k: type(v).__name__ for k, v in par.state_dict().items()},
        }
    return out


def _rotary_checks(mesh: Any) -> dict[str, Any]:
    ref, par = PositionsFromHidden(), PositionsFromHidden()
    parallelize_module(par, mesh, RotaryEmbeddingParallel())
    hidden = torch.randn(2, 8, 6)
    sharded = DTensor.from_local(hidden.chunk(mesh.size(), dim=1)[mesh.get_local_rank()], mesh, [Shard(1)])
    ref_cos, ref_sin = ref(hidden)
    cos, sin = par(sharded)
    return {
        "types": (type(cos).__name__, type(sin).__name__),
        "shape": tuple(cos.shape),
        "diff": max((ref_cos - cos).abs().max().item(), (ref_sin - sin).abs().max().item()),
    }


def _all_style_checks() -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
    return {
        "embedding": _embedding_checks(mesh),
        "norm": _norm_checks(mesh),
        "qk_norm": _qk_norm_checks(mesh),
        "replicate": _replicate_checks(mesh),
        "rotary": _rotary_checks(mesh),
    }


def test_custom_styles_match_the_unsharded_modules() -> None:
    results = run_on_ranks(_all_style_checks, 4)
    for rank, r in enumerate(results):
        for sp, e in r["embedding"].items():
            assert e["out"] <= 1e-6 and e["grad"] <= 1e-6, (rank, sp, e)
            assert e["grad_placements"] == (Shard(0),), (rank, sp, e)  # the table's gradient stays sharded
            assert e["local_rows"] == [2, 2, 1, 0][rank]
            assert e["out_type"] == ("DTensor" if sp == "sp=True" else "Tensor")
            assert not e["out_is_view"]  # FSDP2 warns when a unit (the table's) returns a view
        for name, n in r["norm"].items():
            assert n["out"] <= 1e-6 and n["grad"] <= 1e-5, (rank, name, n)
            assert n["grad_placements"] == (Replicate(),), (rank, name, n)  # summed inside the style
        assert r["norm"]["sp"]["out_type"] == "DTensor"  # Shard(1) output, global shape
        assert (r["norm"]["gather"]["out_type"], r["norm"]["gather"]["out_shape"]) == ("Tensor", (2, 8, 6))
        q = r["qk_norm"]
        assert q["out"] <= 1e-6 and q["grad"] <= 1e-5 and q["out_type"] == "Tensor", (rank, q)
        assert q["grad_placements"] == (Replicate(),)
        for name, n in r["replicate"].items():
            assert n["out"] <= 1e-6 and n["grad"] <= 1e-5, (rank, name, n)
            assert n["grad_placements"] == (Replicate(),) and n["weight_after"] == "DTensor"
            assert n["state_dict"] == {"weight": "DTensor"}
        # Plain activations: the norm runs on its local weight, no DTensor dispatch; the output is plain.
        assert r["replicate"]["plain"]["weight_in_forward"] == ["Tensor"]
        assert r["replicate"]["plain"]["out_type"] == "Tensor"
        assert r["replicate"]["dtensor"]["weight_in_forward"] == ["DTensor"]
        assert r["replicate"]["dtensor"]["out_type"] == "DTensor"
        rot = r["rotary"]
        assert rot["types"] == ("Tensor", "Tensor") and rot["shape"] == (8, 2) and rot["diff"] == 0.0, rot


def _odd_sequence_error() -> str:
    mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
    par = parallelize_module(
        nn.Embedding(5, 3), mesh, VocabParallelEmbedding(output_layouts=Shard(1), use_local_output=False)
    )
    try:
        par(torch.tensor([[0, 1, 2], [4, 3, 2]]))
    except ValueError as err:
        return str(err)
    return "accepted"


def test_sequence_parallel_refuses_a_sequence_the_tp_size_does_not_divide() -> None:
    """Seq 3 over tp 2 used to reach gloo's reduce-scatter with uneven sizes (SIGABRT); now every rank refuses."""
    for message in run_on_ranks(_odd_sequence_error, 2):
        assert "shards the 3 tokens of dim 1 given to" in message and "over tp_size=2" in message, message
        assert "turn sequence_parallel off" in message
