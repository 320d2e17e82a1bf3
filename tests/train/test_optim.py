"""Schedule shape, and a global gradient norm over DTensors of different meshes equal to the unsharded one."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from plait.testing import run_on_ranks
from plait.train.optim import clip_grad_norm, global_grad_norm, lr_factor


def test_warmup_then_cosine_to_the_floor():
    kw = {"warmup_steps": 4, "total_steps": 20, "min_lr_ratio": 0.1}
    assert [lr_factor(s, **kw) for s in range(4)] == pytest.approx([0.25, 0.5, 0.75, 1.0])
    assert lr_factor(4, **kw) == pytest.approx(1.0)
    assert lr_factor(12, **kw) == pytest.approx(0.1 + 0.9 * 0.5)
    assert lr_factor(20, **kw) == pytest.approx(0.1)
    assert lr_factor(0, warmup_steps=0, total_steps=10, min_lr_ratio=0.0) == pytest.approx(1.0)


def _sharded_norms() -> tuple[float, float, float, float]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.placement_types import _StridedShard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "tp"))
    gen = torch.Generator().manual_seed(1)
    fulls = [
        torch.randn(10, 6, generator=gen),
        torch.randn(7, generator=gen),
        torch.randn(6, 5, generator=gen),
        torch.randn(3, 3, generator=gen),
        torch.randn(9, 4, generator=gen),
    ]
    layouts = [
        (mesh, [_StridedShard(0, split_factor=2), Shard(0)]),  # FSDP over a colwise TP shard
        (mesh["dp_shard"], [Shard(0)]),  # a norm: FSDP only, on the 1-D mesh (uneven)
        (mesh, [Shard(0), Shard(1)]),  # FSDP over a rowwise TP shard
        (mesh, [Shard(0), Replicate()]),  # replicated over TP
        (None, None),  # a plain tensor
    ]
    params = []
    for full, (m, placements) in zip(fulls, layouts, strict=True):
        p = nn.Parameter(torch.zeros_like(full))
        p.grad = full.clone() if m is None else distribute_tensor(full, m, placements, src_data_rank=None)
        params.append(p)
    reference = math.sqrt(sum(float(f.pow(2).sum()) for f in fulls))
    got = float(global_grad_norm(params))
    before = float(clip_grad_norm(params, max_norm=1.0))
    after = float(global_grad_norm(params))
    return reference, got, before, after


def test_global_grad_norm_over_mixed_meshes_equals_the_unsharded_norm():
    for reference, got, before, after in run_on_ranks(_sharded_norms, 4):
        assert got == pytest.approx(reference, rel=1e-6)
        assert before == pytest.approx(reference, rel=1e-6)
        assert after == pytest.approx(1.0, rel=1e-5)
