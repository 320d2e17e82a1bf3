"""Meshes at scale on torch's fake process group (one process plays rank 0 of a huge world)."""

from __future__ import annotations

import time

import pytest
import torch._dynamo  # noqa: F401  (slicing a DeviceMesh imports it once; keep that out of the timings)
from torch.distributed.device_mesh import init_device_mesh

from plait.mesh import FSDP2Config, MeshContext, ParallelismSizes


def _largest_4d(world: int, sizes: ParallelismSizes, fake_pg) -> tuple[MeshContext, float]:
    with fake_pg(world):
        start = time.perf_counter()
        ctx = MeshContext.build(FSDP2Config(), sizes)
        elapsed = time.perf_counter() - start
        # Read everything while the group is alive.
        fsdp = ctx.fsdp_mesh()
        facts = {
            "root": (ctx.device_mesh.mesh_dim_names, tuple(ctx.device_mesh.shape)),
            "fsdp": (fsdp.mesh_dim_names, tuple(fsdp.shape)),
            "dp": ctx.dp_mesh().size(),
            "dp_cp": ctx.dp_cp_mesh().size(),
            "tp": ctx.tp_mesh().size(),
            "moe": (ctx.moe_mesh.mesh_dim_names, tuple(ctx.moe_mesh.shape)),
            "ep0": ctx.ep_mesh().mesh.tolist()[:4],
            "sizes": (
                ctx.dp_size,
                ctx.dp_replicate_size,
                ctx.dp_shard_size,
                ctx.cp_size,
                ctx.tp_size,
                ctx.ep_size,
            ),
        }
    return facts, elapsed


def test_1024_ranks_largest_4d_mesh(fake_pg):
    facts, elapsed = _largest_4d(
        1024, ParallelismSizes(dp_replicate_size=4, cp_size=4, tp_size=8, ep_size=32), fake_pg
    )
    assert facts["root"] == (("pp", "dp_replicate", "dp_shard", "cp", "tp"), (1, 4, 8, 4, 8))
    assert facts["fsdp"] == (("dp_replicate", "dp_shard_cp"), (4, 32))
    assert (facts["dp"], facts["dp_cp"], facts["tp"]) == (32, 128, 8)
    assert facts["moe"] == (("ep_shard", "ep"), (32, 32)) and facts["ep0"] == [0, 1, 2, 3]
    assert facts["sizes"] == (32, 4, 8, 4, 8, 32)
    assert elapsed < 10, elapsed


def test_16384_ranks_largest_4d_mesh_builds_in_under_10s(fake_pg):
    facts, elapsed = _largest_4d(
        16384, ParallelismSizes(dp_replicate_size=8, cp_size=4, tp_size=8, ep_size=64), fake_pg
    )
    assert facts["root"] == (("pp", "dp_replicate", "dp_shard", "cp", "tp"), (1, 8, 64, 4, 8))
    assert facts["fsdp"] == (("dp_replicate", "dp_shard_cp"), (8, 256))
    assert (facts["dp"], facts["dp_cp"], facts["tp"]) == (512, 2048, 8)
    assert facts["moe"] == (("ep_shard", "ep"), (256, 64))
    assert facts["sizes"] == (512, 8, 64, 4, 8, 64)
    assert elapsed < 10, f"building the 16,384-rank meshes took {elapsed:.1f}s"


def test_from_meshes_rejects_unknown_dim_names(fake_pg):
    with fake_pg(4):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("data", "tp"))
        with pytest.raises(
            ValueError, match=r"device_mesh has unknown dim name\(s\) \['data'\]; allowed names: \["
        ):
            MeshContext.from_meshes(mesh)
        moe = init_device_mesh("cpu", (4,), mesh_dim_names=("experts",))
        with pytest.raises(ValueError, match=r"moe_mesh has unknown dim name\(s\) \['experts'\]"):
            MeshContext.from_meshes(None, moe)
        shard_only = init_device_mesh("cpu", (4,), mesh_dim_names=("ep_shard",))
        with pytest.raises(ValueError, match=r"moe_mesh dims \['ep_shard'\] have no 'ep' axis"):
            MeshContext.from_meshes(None, shard_only)


def test_from_meshes_simple_mesh_sizes_and_accessors(fake_pg):
    with fake_pg(8):
        mesh = init_device_mesh("cpu", (4, 2), mesh_dim_names=("dp_shard", "tp"))
        moe = init_device_mesh("cpu", (2, 4), mesh_dim_names=("ep_shard", "ep"))
        ctx = MeshContext.from_meshes(mesh, moe, activation_checkpointing=True)
        assert (ctx.dp_size, ctx.dp_replicate_size, ctx.dp_shard_size, ctx.tp_size, ctx.ep_size) == (
            4,
            1,
            4,
            2,
            4,
        )
        assert ctx.fsdp_mesh().mesh_dim_names == ("dp_shard",) and ctx.dp_mesh().size() == 4
        assert ctx.ep_shard_mesh().size() == 2 and ctx.moe_config is not None
        assert ctx.activation_checkpointing == "full" and isinstance(ctx.strategy_config, FSDP2Config)
        with pytest.raises(TypeError, match="reapply_trainability must be callable or None, got 3"):
            MeshContext.from_meshes(mesh, reapply_trainability=3)
        with pytest.raises(TypeError, match="device_mesh must be a DeviceMesh or None, got tuple"):
            MeshContext(device_mesh=(4, 2))
