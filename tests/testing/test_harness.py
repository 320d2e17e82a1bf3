"""run_on_ranks: real gloo ranks, reused workers, failures and hangs reported per rank."""

import os
import time

import pytest
import torch
import torch.distributed as dist

from plait.testing import RankFailure, run_on_ranks
from plait.testing.rank_worker import MAX_SUBGROUPS


def _rank_info(offset: int) -> tuple[int, int, str, float]:
    return dist.get_rank() + offset, dist.get_world_size(), dist.get_backend(), torch.rand(()).item()


def _all_reduce_rank() -> float:
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    return t.item()


def _pid() -> int:
    return os.getpid()


def _raise_on_rank_1() -> int:
    if dist.get_rank() == 1:
        raise ValueError("rank one is unhappy")
    return dist.get_rank()


def _rank_1_sleeps(seconds: float) -> int:
    if dist.get_rank() == 1:
        time.sleep(seconds)
    return dist.get_rank()


def _rank_1_raises_while_rank_0_all_reduces() -> None:
    if dist.get_rank() == 1:
        raise RuntimeError("rank 1 never joins")
    dist.all_reduce(torch.ones(1))


def _new_groups(count: int) -> tuple[int, int]:
    for _ in range(count):
        dist.all_reduce(torch.ones(1), group=dist.new_group([0, 1]))
    return os.getpid(), len(os.listdir("/proc/self/task"))


def _destroy_default_group() -> bool:
    dist.destroy_process_group()
    return dist.is_initialized()


def _nested_call() -> list:
    return run_on_ranks(_pid, 1)


def _sharding_cache_use(diverge: bool) -> tuple[int, int]:
    """The fast-path sharding cache's lookups before the call and its hits in it; rank 1 may run one more op."""
    from torch.distributed.tensor import Replicate, distribute_tensor, init_device_mesh
    from torch.distributed.tensor.debug import _get_fast_path_sharding_prop_cache_stats as stats

    hits, misses = stats()
    mesh = init_device_mesh("cpu", (2,))
    x = distribute_tensor(torch.ones(4, 4), mesh, [Replicate()])
    (x * 2 + 1).sum()
    if diverge and dist.get_rank() == 1:
        x.exp()
    return hits + misses, stats()[0] - hits


def test_the_sharding_cache_is_kept_while_the_ranks_agree_and_emptied_after_they_diverged():
    run_on_ranks(_sharding_cache_use, 2, False)
    (size0, hits0), (size1, hits1) = run_on_ranks(_sharding_cache_use, 2, True)
    assert size0 == size1 > 0 and hits0 == hits1 > 0  # the same ops with an equal mesh: cache hits
    assert run_on_ranks(_sharding_cache_use, 2, False) == [(0, 0), (0, 0)]  # rank 1 ran one more op


def test_returns_each_ranks_value_in_rank_order_with_the_same_seed():
    results = run_on_ranks(_rank_info, 2, 10)
    assert [r[:3] for r in results] == [(10, 2, "gloo"), (11, 2, "gloo")]
    torch.manual_seed(0)
    assert results[0][3] == results[1][3] == torch.rand(()).item()


@pytest.mark.parametrize("world_size", [2, 4, 8])
def test_all_reduce_sums_over_all_ranks(world_size):
    expected = world_size * (world_size + 1) / 2
    assert run_on_ranks(_all_reduce_rank, world_size) == [expected] * world_size


def test_workers_are_reused_between_calls():
    first = run_on_ranks(_pid, 2)
    second = run_on_ranks(_pid, 2)
    assert first == second
    assert len(set(first)) == 2 and os.getpid() not in first


def test_a_raising_rank_gives_rank_failure_with_its_traceback():
    before = run_on_ranks(_pid, 2)
    with pytest.raises(RankFailure) as info:
        run_on_ranks(_raise_on_rank_1, 2, timeout=60)
    assert isinstance(info.value, AssertionError)
    assert list(info.value.reports) == [1]
    assert "ValueError: rank one is unhappy" in info.value.reports[1]
    assert "_raise_on_rank_1" in str(info.value)
    after = run_on_ranks(_pid, 2)
    assert set(after).isdisjoint(before), "a failed call must discard its pool"


def test_a_rank_stuck_in_a_collective_after_another_raised_is_reported_not_waited_for():
    start = time.monotonic()
    with pytest.raises(RankFailure) as info:
        run_on_ranks(_rank_1_raises_while_rank_0_all_reduces, 2, timeout=60)
    assert time.monotonic() - start < 30
    assert "RuntimeError: rank 1 never joins" in info.value.reports[1]
    assert "kept waiting after another rank failed" in info.value.reports[0]
    assert "all_reduce" in info.value.reports[0]


def test_groups_are_kept_until_the_pool_holds_too_many_then_fresh_workers_start():
    limit = MAX_SUBGROUPS
    first = run_on_ranks(_new_groups, 2, 1)
    second = run_on_ranks(_new_groups, 2, 1)
    assert [pid for pid, _ in first] == [pid for pid, _ in second], "a small call keeps its workers"
    assert second[0][1] > first[0][1], "groups are not torn down inside a live worker"
    over = run_on_ranks(_new_groups, 2, limit)  # now past the limit: this pool is retired
    after = run_on_ranks(_new_groups, 2, 1)
    assert {pid for pid, _ in after}.isdisjoint(pid for pid, _ in over)
    assert after[0][1] < over[0][1], "the fresh workers hold only the new call's threads"


def test_a_hang_gives_rank_failure_with_stacks_and_the_next_call_works():
    before = run_on_ranks(_pid, 2)
    start = time.monotonic()
    with pytest.raises(RankFailure) as info:
        run_on_ranks(_rank_1_sleeps, 2, 60.0, timeout=3)
    assert time.monotonic() - start < 20
    assert list(info.value.reports) == [1]
    assert "did not finish within 3 s" in info.value.reports[1]
    assert "_rank_1_sleeps" in info.value.reports[1]
    after = run_on_ranks(_all_reduce_rank, 2)
    assert after == [3.0, 3.0]
    assert set(run_on_ranks(_pid, 2)).isdisjoint(before)


def test_a_destroyed_default_group_is_recreated_for_the_next_call():
    assert run_on_ranks(_destroy_default_group, 2) == [False, False]
    assert run_on_ranks(_all_reduce_rank, 2) == [3.0, 3.0]


def test_rejects_bad_arguments_before_starting_anything():
    with pytest.raises(ValueError, match="world_size"):
        run_on_ranks(_pid, 0)
    with pytest.raises(TypeError, match="module-level"):
        run_on_ranks(lambda: 0, 1)


def test_cannot_be_called_from_inside_a_rank():
    with pytest.raises(RankFailure, match="cannot be called from inside a rank"):
        run_on_ranks(_nested_call, 1)
