"""Axis names and ParallelismSizes: inference of dp and every size error."""

from __future__ import annotations

import pytest

from plait.mesh import MeshAxisName, ParallelismSizes, validate_axis_names


def test_axis_names_equal_plain_strings():
    assert [str(m) for m in MeshAxisName] == [
        "pp", "dp", "dp_replicate", "dp_shard", "dp_shard_cp", "dp_cp", "cp", "tp", "ep", "ep_shard",
    ]  # fmt: skip
    assert MeshAxisName.DP_SHARD == "dp_shard"
    assert {"tp": 1}[MeshAxisName.TP] == 1


def test_unknown_axis_name_lists_unknown_and_allowed():
    with pytest.raises(ValueError, match=r"unknown dim name\(s\) \['data'\].*allowed names.*dp_shard"):
        validate_axis_names(("data", "tp"))


def test_missing_and_repeated_axis_names_rejected():
    with pytest.raises(ValueError, match="no mesh_dim_names"):
        validate_axis_names(None)
    with pytest.raises(ValueError, match=r"repeats a dim name in \['tp', 'tp'\]"):
        validate_axis_names(("tp", "tp"))


@pytest.mark.parametrize("dp", [None, -1])
def test_dp_inferred_from_remaining_ranks(dp):
    sizes = ParallelismSizes(dp_size=dp, tp_size=2, cp_size=2, pp_size=2).resolve(32)
    assert (sizes.dp_size, sizes.dp_shard_size, sizes.non_pp_size) == (4, 4, 16)


def test_dp_shard_is_dp_over_replicas():
    sizes = ParallelismSizes(dp_replicate_size=2, tp_size=2).resolve(16)
    assert (sizes.dp_size, sizes.dp_replicate_size, sizes.dp_shard_size) == (8, 2, 4)


def test_indivisible_world_spells_out_product():
    with pytest.raises(ValueError, match=r"world_size 6 is not divisible by pp\*cp\*tp = 1\*1\*4"):
        ParallelismSizes(tp_size=4).resolve(6)


def test_explicit_dp_must_multiply_to_world():
    with pytest.raises(ValueError, match=r"dp\*pp\*cp\*tp = 2\*1\*1\*2 = 4 does not equal world_size 8"):
        ParallelismSizes(dp_size=2, tp_size=2).resolve(8)
    assert ParallelismSizes(dp_size=4, tp_size=2).resolve(8).dp_size == 4


def test_dp_not_divisible_by_replicas():
    with pytest.raises(ValueError, match="dp_size 6 is not divisible by dp_replicate_size 4"):
        ParallelismSizes(dp_replicate_size=4).resolve(6)


def test_pure_replication_rejected_only_when_asked():
    with pytest.raises(ValueError, match=r"dp_replicate_size 4 equals dp_size 4.*use DDPConfig"):
        ParallelismSizes(dp_replicate_size=4).resolve(4, allow_pure_replication=False)
    assert ParallelismSizes(dp_replicate_size=4).resolve(4).dp_shard_size == 1
    assert ParallelismSizes(dp_replicate_size=1).resolve(1, allow_pure_replication=False).dp_size == 1


def test_ep_must_divide_non_pipeline_ranks():
    with pytest.raises(ValueError, match=r"ep_size 3 does not divide .*dp\*cp\*tp = 2\*1\*2 = 4"):
        ParallelismSizes(tp_size=2, pp_size=2, ep_size=3).resolve(8)
    assert ParallelismSizes(tp_size=2, pp_size=2, ep_size=4).resolve(8).ep_size == 4


@pytest.mark.parametrize(
    ("kwargs", "exc", "pattern"),
    [
        ({"tp_size": 0}, ValueError, "tp_size must be a positive int, got 0"),
        ({"pp_size": -2}, ValueError, "pp_size must be a positive int, got -2"),
        ({"dp_size": 0}, ValueError, "dp_size must be a positive int, got 0"),
        ({"cp_size": 2.0}, TypeError, r"cp_size must be a positive int, got 2.0 \(float\)"),
        ({"ep_size": True}, TypeError, r"ep_size must be a positive int, got True \(bool\)"),
        ({"dp_replicate_size": "2"}, TypeError, "dp_replicate_size must be a positive int, got '2'"),
    ],
)
def test_sizes_must_be_positive_ints(kwargs, exc, pattern):
    with pytest.raises(exc, match=pattern):
        ParallelismSizes(**kwargs)


def test_unresolved_sizes_refuse_derived_values():
    with pytest.raises(ValueError, match="dp_size is not resolved"):
        _ = ParallelismSizes().dp_shard_size
    with pytest.raises(TypeError, match="world_size must be a positive int"):
        ParallelismSizes().resolve("8")
