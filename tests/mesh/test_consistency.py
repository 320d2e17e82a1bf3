"""Ranks that disagree before the first collective fail in seconds, with one message on every rank."""

from __future__ import annotations

import time

import torch
from torch import nn

from plait.mesh import (
    FSDP2Config,
    MeshContext,
    ParallelismSizes,
    check_ranks_agree,
    describe_config,
    describe_module,
)
from plait.testing import run_on_ranks


class _Tiny(nn.Module):
    def __init__(self, layers: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def _error_of(fn, *args, **kwargs) -> tuple[str | None, float]:
    start = time.perf_counter()
    try:
        fn(*args, **kwargs)
    except ValueError as err:
        return str(err), time.perf_counter() - start
    return None, time.perf_counter() - start


def _disagreeing_ranks() -> dict[str, tuple[str | None, float]]:
    import torch.distributed as dist

    rank = dist.get_rank()
    out = {}
    # 1. tp_size differs on rank 1: would build different meshes (different subgroups) and hang.
    sizes = ParallelismSizes(tp_size=2 if rank == 1 else 1)
    out["tp_size"] = _error_of(MeshContext.build, FSDP2Config(sequence_parallel=False), sizes)
    # 2. a strategy option differs.
    config = FSDP2Config(reshard_after_forward=rank == 0)
    out["config"] = _error_of(MeshContext.build, config, ParallelismSizes())
    # 3. rank 1 arrives only after rank 0's (short) wait: rank 0 names it; rank 1 then passes alone.
    if rank == 1:
        time.sleep(1.5)
    out["absent"] = _error_of(check_ranks_agree, "late", {"x": "1"}, timeout=1.0 if rank == 0 else 10.0)
    return out


def test_disagreeing_ranks_fail_fast_with_one_message_on_every_rank() -> None:
    results = run_on_ranks(_disagreeing_ranks, 2, timeout=120)
    for rank, out in enumerate(results):
        for case in ("tp_size", "config"):
            message, seconds = out[case]
            assert message is not None, f"rank {rank}: {case} was accepted"
            assert seconds < 5, f"rank {rank}: {case} took {seconds:.1f} s"
            assert "\n" not in message and "rank 1 has" in message and "1 of 2 ranks differ" in message
            assert message == results[0][case][0], "every rank raises the same message"
        assert "sizes.tp_size 2 where rank 0 has 1" in out["tp_size"][0]
        assert "strategy_config.reshard_after_forward False where rank 0 has True" in out["config"][0]
    message, seconds = results[0]["absent"]
    assert message is not None and "rank(s) [1] of 2 did not reach late within 1 s" in message
    assert seconds < 5
    assert results[1]["absent"][0] is None


def test_descriptions_are_stable_and_name_fields() -> None:
    a, b = describe_config(FSDP2Config(), "c"), describe_config(FSDP2Config(), "c")
    assert a == b and "c.tp_plan" in a and "0x" not in "".join(a.values())
    assert describe_config(ParallelismSizes(tp_size=2), "s")["s.tp_size"] == "2"
    assert describe_module(_Tiny(1))["parameter layers.0.bias"] == "(8,) torch.float32 cpu"
    frozen = _Tiny(1).requires_grad_(False)
    assert describe_module(frozen)["parameter layers.0.bias"].endswith(" frozen")


def test_single_process_skips_the_exchange() -> None:
    check_ranks_agree("solo", {"x": "1"}, timeout=0.01)  # no process group: nothing to compare
