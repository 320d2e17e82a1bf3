"""plait.mesh's clipping and initialisation on real gloo ranks.

``global_grad_norm`` / ``clip_grad_norm_`` over gradients on several meshes at once (FSDP over TP,
FSDP only, HSDP, experts on their own EP mesh, plain tensors) equal the unsharded norm;
``materialize`` gives every parameter the same full value whatever the mesh (or none).
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from plait.mesh import clip_grad_norm_, global_grad_norm, init_value, materialize, param_seed
from plait.testing import run_on_ranks


def _sharded_norms() -> tuple[float, float, float, float, float]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Partial, Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.placement_types import _StridedShard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "tp"))
    hsdp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_replicate", "dp_shard"))
    moe = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard_mod_ep", "ep"))  # a second, separate mesh
    gen = torch.Generator().manual_seed(1)
    shapes = [(10, 6), (7,), (6, 5), (3, 3), (9, 4), (8, 4), (4, 6, 3), (6, 2)]
    fulls = [torch.randn(*s, generator=gen) for s in shapes]
    layouts = [
        (mesh, [_StridedShard(0, split_factor=2), Shard(0)]),  # FSDP over a colwise TP shard
        (mesh["dp_shard"], [Shard(0)]),  # a norm: FSDP only, on the 1-D mesh (uneven)
        (mesh, [Shard(0), Shard(1)]),  # FSDP over a rowwise TP shard
        (mesh, [Shard(0), Replicate()]),  # replicated over TP
        (None, None),  # a plain tensor
        (hsdp, [Replicate(), Shard(0)]),  # HSDP: replicated across groups, sharded within
        (moe, [Shard(1), Shard(0)]),  # experts: Shard(0) over ep, FSDP on dim 1 over the rest
        (mesh, [Shard(0), Partial()]),  # a pending TP reduction: summed before its norm
    ]
    params = []
    for full, (m, placements) in zip(fulls, layouts, strict=True):
        p = nn.Parameter(torch.zeros_like(full))
        if m is None:
            p.grad = full.clone()
        elif any(pl.is_partial() for pl in placements):
            shard = distribute_tensor(full, m, [placements[0], Replicate()], src_data_rank=None)
            p.grad = type(shard).from_local(
                shard.to_local() / 2, m, placements
            )  # two halves that sum to full
        else:
            p.grad = distribute_tensor(full, m, placements, src_data_rank=None)
        params.append(p)
    reference = math.sqrt(sum(float(f.pow(2).sum()) for f in fulls))
    got = float(global_grad_norm(params))
    before = float(clip_grad_norm_(params, max_norm=1.0))
    after = float(global_grad_norm(params))
    untouched = float(clip_grad_norm_(params, max_norm=10.0))  # under the bound: no scaling
    return reference, got, before, after, untouched


def test_global_grad_norm_over_fsdp_tp_hsdp_and_ep_meshes_equals_the_unsharded_norm():
    for reference, got, before, after, untouched in run_on_ranks(_sharded_norms, 4):
        assert got == pytest.approx(reference, rel=1e-6)
        assert before == pytest.approx(reference, rel=1e-6)
        assert after == pytest.approx(1.0, rel=1e-5) and untouched == pytest.approx(1.0, rel=1e-5)


def test_clip_refuses_a_non_positive_bound():
    with pytest.raises(ValueError, match="max_norm must be > 0"):
        clip_grad_norm_([], max_norm=0.0)


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(6, 10)
        self.o_proj = nn.Linear(10, 6, bias=False)
        self.norm = nn.LayerNorm(6)


def _materialised(tp: bool) -> dict[str, torch.Tensor]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    with torch.device("meta"):
        model = nn.Sequential(_Block(), _Block())
    if tp:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "tp"))
        for block in model:
            parallelize_module(block, mesh["tp"], {"up": ColwiseParallel(), "o_proj": RowwiseParallel()})
            fully_shard(block, mesh=mesh["dp_shard"])
    else:
        fully_shard(model, mesh=init_device_mesh("cpu", (4,)))
    materialize(model, seed=7)
    return {n: p.full_tensor().clone() for n, p in model.named_parameters()}


def test_materialize_gives_the_same_full_weights_on_any_mesh_as_unsharded():
    with torch.device("meta"):
        plain = nn.Sequential(_Block(), _Block())
    materialize(plain, seed=7)
    reference = {n: p.detach().clone() for n, p in plain.named_parameters()}
    assert torch.equal(reference["0.up.weight"], init_value("0.up.weight", torch.Size([10, 6]), seed=7))
    assert (reference["0.norm.weight"] == 1).all() and (reference["1.up.bias"] == 0).all()
    assert not torch.equal(reference["0.up.weight"], reference["1.up.weight"])
    assert param_seed(7, "0.up.weight") != param_seed(8, "0.up.weight")
    for tp in (False, True):
        for result in run_on_ranks(_materialised, 4, tp):
            assert result.keys() == reference.keys()
            for name, tensor in reference.items():
                assert torch.equal(result[name], tensor), (tp, name)


class _Router(nn.Module):
    """A router with its own weight and a buffer its constructor computes (DeepseekV3TopkRouter's shape)."""

    def __init__(self, config: dict) -> None:
        super().__init__()
        self.config = config
        self.weight = nn.Parameter(torch.empty(config["experts"], 4))
        self.register_buffer("bias", torch.full((config["experts"],), 3.0))


def test_materialize_recomputes_the_buffers_of_a_module_with_its_own_weights() -> None:
    with torch.device("meta"):
        model = nn.Sequential(_Router({"experts": 8}))
    materialize(model, seed=7)
    assert torch.equal(model[0].bias, torch.full((8,), 3.0))
    assert not model[0].weight.is_meta
