"""Meshes built on real gloo ranks: each axis and flattened view holds the right ranks and communicates."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from plait.mesh import (
    DDPConfig,
    FSDP2Config,
    MegatronFSDPConfig,
    MeshContext,
    ParallelismSizes,
    default_device_type,
    init_distributed,
)
from plait.testing import run_on_ranks


def _groups(mesh: DeviceMesh) -> list[list[int]]:
    """Ranks of this rank's process group on every dim of ``mesh`` (what collectives really use)."""
    return [dist.get_process_group_ranks(mesh.get_group(d)) for d in range(mesh.ndim)]


def _summed_rank(mesh: DeviceMesh) -> int:
    """All-reduce the global rank over a 1-D mesh's group: proves the group communicates."""
    t = torch.tensor([dist.get_rank()])
    dist.all_reduce(t, group=mesh.get_group())
    return int(t.item())


def _describe(ctx: MeshContext) -> dict:
    fsdp = ctx.fsdp_mesh()
    out = {
        "sizes": (
            ctx.pp_size,
            ctx.dp_size,
            ctx.dp_replicate_size,
            ctx.dp_shard_size,
            ctx.cp_size,
            ctx.tp_size,
        ),
        "fsdp_dims": fsdp.mesh_dim_names,
        "fsdp_mesh": fsdp.mesh.tolist(),
        "fsdp_groups": _groups(fsdp),
        "dp": _groups(ctx.dp_mesh())[0],
        "dp_cp": _groups(ctx.dp_cp_mesh())[0],
        "dp_cp_sum": _summed_rank(ctx.dp_cp_mesh()),
        "device_type": ctx.device_mesh.device_type,
    }
    if ctx.tp_size > 1:
        out["tp"] = _groups(ctx.tp_mesh())[0]
        out["tp_sum"] = _summed_rank(ctx.tp_mesh())
    if fsdp.ndim == 1:
        out["fsdp_sum"] = _summed_rank(fsdp)
    return out


def _fsdp2_context(sizes_kwargs: dict) -> dict:
    return _describe(MeshContext.build(FSDP2Config(), ParallelismSizes(**sizes_kwargs)))


def test_fsdp_tp_2x2_on_4_ranks():
    results = run_on_ranks(_fsdp2_context, 4, {"tp_size": 2})
    tp = [[0, 1], [0, 1], [2, 3], [2, 3]]
    shard = [[0, 2], [1, 3], [0, 2], [1, 3]]
    for rank, r in enumerate(results):
        assert r["sizes"] == (1, 2, 1, 2, 1, 2)
        assert r["fsdp_dims"] == ("dp_shard",) and r["device_type"] == "cpu"
        assert r["tp"] == tp[rank] and r["tp_sum"] == sum(tp[rank])
        assert r["fsdp_groups"] == [shard[rank]] and r["fsdp_sum"] == sum(shard[rank])
        assert r["dp"] == shard[rank] and r["dp_cp"] == shard[rank]


def test_hsdp_2x2_fsdp_mesh_replicates_on_dim0_shards_on_dim1():
    results = run_on_ranks(_fsdp2_context, 4, {"dp_replicate_size": 2})
    replicate = [[0, 2], [1, 3], [0, 2], [1, 3]]
    shard = [[0, 1], [0, 1], [2, 3], [2, 3]]
    for rank, r in enumerate(results):
        assert r["sizes"] == (1, 4, 2, 2, 1, 1)
        assert r["fsdp_dims"] == ("dp_replicate", "dp_shard")
        assert r["fsdp_mesh"] == [[0, 1], [2, 3]]
        assert r["fsdp_groups"] == [replicate[rank], shard[rank]]
        assert r["dp"] == [0, 1, 2, 3] and r["dp_cp_sum"] == 6


def test_cp_world_8_flattened_views_hold_the_right_ranks():
    # (pp, dp_replicate, dp_shard, cp, tp) = (1, 2, 2, 2, 1): rank = 4*replicate + 2*shard + cp.
    results = run_on_ranks(_fsdp2_context, 8, {"dp_replicate_size": 2, "cp_size": 2})
    for rank, r in enumerate(results):
        assert r["sizes"] == (1, 4, 2, 2, 2, 1)
        assert r["fsdp_dims"] == ("dp_replicate", "dp_shard_cp")
        assert r["fsdp_mesh"] == [[0, 1, 2, 3], [4, 5, 6, 7]]
        assert r["fsdp_groups"] == [[rank % 4, rank % 4 + 4], [0, 1, 2, 3] if rank < 4 else [4, 5, 6, 7]]
        assert r["dp"] == ([0, 2, 4, 6] if rank % 2 == 0 else [1, 3, 5, 7])
        assert r["dp_cp"] == list(range(8)) and r["dp_cp_sum"] == 28


def test_cp_with_tp_fsdp_mesh_is_flat_dp_shard_cp_never_a_2d_slice():
    # (pp, dp_replicate, dp_shard, cp, tp) = (1, 1, 2, 2, 2): rank = 4*shard + 2*cp + tp.
    results = run_on_ranks(_fsdp2_context, 8, {"cp_size": 2, "tp_size": 2})
    for rank, r in enumerate(results):
        group = [0, 2, 4, 6] if rank % 2 == 0 else [1, 3, 5, 7]
        assert r["fsdp_dims"] == ("dp_shard_cp",)
        assert r["fsdp_groups"] == [group] and r["fsdp_sum"] == sum(group)
        assert r["dp"] == [rank % 4 % 2 + 2 * (rank % 4 // 2), rank % 4 % 2 + 2 * (rank % 4 // 2) + 4]
        assert r["tp"] == [rank - rank % 2, rank - rank % 2 + 1]


def _moe_context(sizes_kwargs: dict) -> dict:
    ctx = MeshContext.build(FSDP2Config(), ParallelismSizes(**sizes_kwargs))
    return {
        "ep_size": ctx.ep_size,
        "moe_dims": ctx.moe_mesh.mesh_dim_names,
        "moe_mesh": ctx.moe_mesh.mesh.tolist(),
        "ep": _groups(ctx.ep_mesh())[0],
        "ep_sum": _summed_rank(ctx.ep_mesh()),
        "ep_shard": _groups(ctx.ep_shard_mesh())[0],
        "moe_config": ctx.moe_config,
    }


def test_moe_mesh_ep_2_and_4_ep_innermost():
    for ep, expected_ep, expected_shard in [
        (2, [[0, 1], [0, 1], [2, 3], [2, 3]], [[0, 2], [1, 3], [0, 2], [1, 3]]),
        (4, [[0, 1, 2, 3]] * 4, [[0], [1], [2], [3]]),
    ]:
        results = run_on_ranks(_moe_context, 4, {"tp_size": 2, "ep_size": ep})
        for rank, r in enumerate(results):
            assert r["ep_size"] == ep and r["moe_dims"] == ("ep_shard", "ep")
            assert r["ep"] == expected_ep[rank] and r["ep_sum"] == sum(expected_ep[rank])
            assert r["ep_shard"] == expected_shard[rank]
            assert r["moe_config"].ignore_router_for_ac is True


def test_moe_mesh_one_per_pipeline_stage():
    results = run_on_ranks(_moe_context, 8, {"pp_size": 2, "ep_size": 2})
    for rank, r in enumerate(results):
        stage = rank // 4
        assert r["moe_mesh"] == [[4 * stage, 4 * stage + 1], [4 * stage + 2, 4 * stage + 3]]
        assert r["ep"] == [rank - rank % 2, rank - rank % 2 + 1]
        assert r["ep_shard"] == [4 * stage + rank % 2, 4 * stage + rank % 2 + 2]


def _megatron_and_ddp() -> dict:
    ctx = MeshContext.build(MegatronFSDPConfig(), ParallelismSizes(cp_size=2))
    ddp = MeshContext.build(DDPConfig())
    return {
        "dims": ctx.device_mesh.mesh_dim_names,
        "sizes": (ctx.dp_size, ctx.dp_shard_size, ctx.cp_size),
        "dp": _groups(ctx.dp_mesh())[0],
        "dp_cp": _groups(ctx.dp_cp_mesh())[0],
        "dp_cp_name": ctx.dp_cp_mesh().mesh_dim_names,
        "ddp": (ddp.device_mesh, ddp.dp_size),
        "ddp_dp": (_groups(ddp.dp_mesh())[0], _groups(ddp.dp_cp_mesh())[0], ddp.dp_mesh().get_local_rank()),
        "device_type": default_device_type(),
    }


def test_megatron_mesh_dp_cp_tp_and_ddp_without_mesh():
    for rank, r in enumerate(run_on_ranks(_megatron_and_ddp, 4)):
        assert r["dims"] == ("dp", "cp", "tp") and r["sizes"] == (2, 2, 2)
        assert r["dp"] == [rank % 2, rank % 2 + 2]
        assert r["dp_cp"] == [0, 1, 2, 3] and r["dp_cp_name"] == ("dp_cp",)
        assert r["ddp"] == (None, None) and r["device_type"] == "cpu"
        assert r["ddp_dp"] == ([0, 1, 2, 3], [0, 1, 2, 3], rank)  # a loop's data ranks under DDP: every rank


def _custom_rank_order(ranks: list[int]) -> dict:
    ctx = MeshContext.build(FSDP2Config(), ParallelismSizes(tp_size=2), ranks=ranks)
    try:
        MeshContext.build(FSDP2Config(), ParallelismSizes(tp_size=2), ranks=ranks[:2])
    except ValueError as exc:
        subset_error = str(exc)
    return {
        "mesh": ctx.device_mesh.mesh.flatten().tolist(),
        "tp_mesh": ctx.tp_mesh().mesh.tolist(),
        "tp": _groups(ctx.tp_mesh())[0],
        "fsdp": _groups(ctx.fsdp_mesh())[0],
        "subset_error": subset_error,
    }


def test_explicit_ranks_set_the_mesh_order_and_must_cover_the_group():
    results = run_on_ranks(_custom_rank_order, 4, [3, 2, 1, 0])
    tp_mesh = [[1, 0], [1, 0], [3, 2], [3, 2]]
    for rank, r in enumerate(results):
        assert r["mesh"] == [3, 2, 1, 0]
        assert r["tp_mesh"] == tp_mesh[rank] and r["tp"] == sorted(tp_mesh[rank])
        assert r["fsdp"] == ([0, 2] if rank % 2 == 0 else [1, 3])
        assert "the mesh spans 2 of the 4 ranks of the process group" in r["subset_error"]


def _from_user_mesh() -> dict:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_replicate", "dp_shard"))
    ctx = MeshContext.from_meshes(mesh, activation_checkpointing="selective")
    info = init_distributed()
    return {
        "fsdp_dims": ctx.fsdp_mesh().mesh_dim_names,
        "dp": _groups(ctx.dp_mesh())[0],
        "dp_sum": _summed_rank(ctx.dp_mesh()),
        "sizes": (ctx.dp_size, ctx.dp_replicate_size, ctx.dp_shard_size, ctx.tp_size, ctx.ep_size),
        "ac": ctx.activation_checkpointing,
        "info": (info.rank, info.world_size, info.device.type),
    }


def test_from_meshes_flattens_missing_views_and_init_distributed_keeps_group():
    for rank, r in enumerate(run_on_ranks(_from_user_mesh, 4)):
        assert r["fsdp_dims"] == ("dp_replicate", "dp_shard")
        assert r["dp"] == [0, 1, 2, 3] and r["dp_sum"] == 6
        assert r["sizes"] == (4, 2, 2, 1, 1) and r["ac"] == "selective"
        assert r["info"] == (rank, 4, "cpu")
