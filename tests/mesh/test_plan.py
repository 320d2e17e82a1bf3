"""Mesh plans per strategy and their errors; none of these needs a process group (errors precede collectives)."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from plait.mesh import (
    DDPConfig,
    FSDP2Config,
    MegatronFSDPConfig,
    MeshContext,
    ParallelismSizes,
    plan_meshes,
)


@pytest.fixture(autouse=True)
def _no_process_group():
    assert not dist.is_initialized()


def test_fsdp2_plan_dims_in_order_with_flattened_views():
    plan = plan_meshes(
        FSDP2Config(), ParallelismSizes(dp_replicate_size=2, cp_size=2, tp_size=2), world_size=16
    )
    assert plan.dims == ("pp", "dp_replicate", "dp_shard", "cp", "tp")
    assert plan.shape == (1, 2, 2, 2, 2)
    assert dict(plan.flattened) == {
        "dp": ("dp_replicate", "dp_shard"),
        "dp_shard_cp": ("dp_shard", "cp"),
        "dp_cp": ("dp_replicate", "dp_shard", "cp"),
    }
    assert plan.ranks == tuple(range(16)) and not plan.has_moe_mesh


def test_fsdp2_rejects_pure_replication_and_suggests_ddp():
    with pytest.raises(ValueError, match=r"dp_replicate_size 4 equals dp_size 4.*DDPConfig"):
        plan_meshes(FSDP2Config(), ParallelismSizes(dp_replicate_size=4), world_size=4)
    assert plan_meshes(DDPConfig(), ParallelismSizes(), world_size=4).dims is None


def test_fsdp2_ep_must_divide_dp_cp_tp():
    with pytest.raises(
        ValueError, match=r"ep_size 4 does not divide the non-pipeline ranks dp\*cp\*tp = 1\*1\*2 = 2"
    ):
        plan_meshes(FSDP2Config(), ParallelismSizes(tp_size=2, pp_size=2, ep_size=4), world_size=4)


def test_sequence_parallel_without_tp_warns_ignored():
    with pytest.warns(UserWarning, match="sequence_parallel is ignored because tp_size is 1"):
        plan_meshes(FSDP2Config(sequence_parallel=True), ParallelismSizes(), world_size=2)


def test_gathering_sequence_mixers_without_cp_warns_ignored():
    with pytest.warns(UserWarning, match="cp_sequence_mixers is ignored because cp_size is 1"):
        plan_meshes(FSDP2Config(cp_sequence_mixers="gather"), ParallelismSizes(), world_size=2)


@pytest.mark.parametrize(
    ("sizes", "pattern"),
    [
        (ParallelismSizes(tp_size=2), "DDP does not support tp_size=2"),
        (ParallelismSizes(pp_size=2), "DDP does not support pp_size=2"),
        (ParallelismSizes(cp_size=2), "DDP does not support cp_size=2"),
        (ParallelismSizes(ep_size=2), "DDP does not support ep_size=2"),
        (ParallelismSizes(dp_replicate_size=2), "DDP does not support dp_replicate_size=2"),
    ],
)
def test_ddp_unsupported_sizes(sizes, pattern):
    with pytest.raises(ValueError, match=pattern):
        plan_meshes(DDPConfig(), sizes, world_size=4)


@pytest.mark.parametrize(
    ("sizes", "pattern"),
    [
        (ParallelismSizes(pp_size=2), "Megatron-FSDP does not support pp_size=2: its mesh is"),
        (ParallelismSizes(ep_size=2), "Megatron-FSDP does not support ep_size=2"),
        (ParallelismSizes(dp_replicate_size=2), "Megatron-FSDP does not support dp_replicate_size=2"),
    ],
)
def test_megatron_unsupported_sizes(sizes, pattern):
    with pytest.raises(ValueError, match=pattern):
        plan_meshes(MegatronFSDPConfig(), sizes, world_size=4)


def test_megatron_plan_flattens_dp_cp_only_with_cp():
    plan = plan_meshes(MegatronFSDPConfig(), ParallelismSizes(cp_size=2, tp_size=2), world_size=8)
    assert (plan.dims, plan.shape, plan.flattened) == (
        ("dp", "cp", "tp"),
        (2, 2, 2),
        (("dp_cp", ("dp", "cp")),),
    )
    assert plan_meshes(MegatronFSDPConfig(), None, world_size=8).flattened == ()


def test_unknown_strategy_config_is_type_error():
    with pytest.raises(TypeError, match=r"unsupported strategy config 'fsdp2'.*FSDP2Config"):
        plan_meshes("fsdp2", ParallelismSizes(), world_size=2)


@pytest.mark.parametrize(
    ("ranks", "kwargs", "exc", "pattern"),
    [
        ([0, 1, 1, 2], {}, ValueError, r"repeats rank\(s\) \[1\]"),
        ([0, 1, 2], {"sizes": ParallelismSizes(dp_size=2, tp_size=2)}, ValueError,
         r"ranks lists 3 ranks but the mesh size dp\*pp\*cp\*tp = 2\*1\*1\*2 = 4"),
        ([0, 1, 2, 3], {"world_size": 8}, ValueError, "ranks lists 4 ranks but world_size is 8"),
        ([0, 1, 2], {"sizes": ParallelismSizes(tp_size=2)}, ValueError, "world_size 3 is not divisible"),
        ([], {}, ValueError, "ranks is empty"),
        ([0, -1], {}, TypeError, r"non-negative ints, got \[-1\]"),
        ("0123", {}, TypeError, "ranks must be a list of global ranks"),
    ],
)  # fmt: skip
def test_explicit_ranks_validated(ranks, kwargs, exc, pattern):
    sizes = kwargs.pop("sizes", ParallelismSizes())
    with pytest.raises(exc, match=pattern):
        plan_meshes(FSDP2Config(), sizes, ranks=ranks, **kwargs)


def test_explicit_ranks_set_the_world_and_order():
    plan = plan_meshes(FSDP2Config(), ParallelismSizes(tp_size=2), ranks=[7, 5, 3, 1])
    assert plan.ranks == (7, 5, 3, 1) and plan.shape == (1, 1, 2, 1, 2)


def test_build_errors_raise_before_any_collective():
    with pytest.raises(ValueError, match=r"world_size 6 is not divisible by pp\*cp\*tp = 1\*1\*4"):
        MeshContext.build(FSDP2Config(), ParallelismSizes(tp_size=4), world_size=6)
    with pytest.raises(ValueError, match="unknown activation_checkpointing 'sometimes'"):
        MeshContext.build(FSDP2Config(), world_size=1, activation_checkpointing="sometimes")
    with pytest.raises(
        ValueError, match=r"torch.distributed is not initialised; call plait.mesh.init_distributed"
    ):
        MeshContext.build(FSDP2Config())


def test_ddp_context_has_no_mesh_and_default_sizes():
    ctx = MeshContext.build(DDPConfig(), world_size=4, activation_checkpointing=True)
    assert ctx.device_mesh is None and ctx.moe_mesh is None
    assert (ctx.dp_size, ctx.dp_replicate_size, ctx.dp_shard_size) == (None, None, 1)
    assert (ctx.pp_size, ctx.tp_size, ctx.cp_size, ctx.ep_size) == (1, 1, 1, 1)
    assert ctx.activation_checkpointing == "full"
    with pytest.raises(ValueError, match=r"no FSDP .* mesh in this MeshContext"):
        ctx.fsdp_mesh()
