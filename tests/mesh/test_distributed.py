"""init_distributed without a launcher, and its launcher-environment errors."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from plait.mesh import FSDP2Config, MeshContext, ParallelismSizes, init_distributed


@pytest.fixture
def no_launcher(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    yield monkeypatch
    if dist.is_initialized():
        dist.destroy_process_group()


def test_without_launcher_starts_single_rank_gloo_and_is_idempotent(no_launcher):
    info = init_distributed()
    assert (info.rank, info.world_size, info.local_rank, info.device) == (0, 1, 0, torch.device("cpu"))
    assert dist.get_backend() == "gloo"
    group = dist.group.WORLD
    assert init_distributed() == info and dist.group.WORLD is group
    ctx = MeshContext.build(FSDP2Config(), ParallelismSizes())
    assert (ctx.dp_size, ctx.fsdp_mesh().size(), ctx.device_mesh.device_type) == (1, 1, "cpu")


@pytest.mark.parametrize(("present", "missing"), [("RANK", "WORLD_SIZE"), ("WORLD_SIZE", "RANK")])
def test_half_a_launcher_environment_is_an_error(no_launcher, present, missing):
    no_launcher.setenv(present, "0")
    with pytest.raises(ValueError, match=f"{present} is set but {missing} is not"):
        init_distributed()
    assert not dist.is_initialized()


def test_non_integer_launcher_variable_is_an_error(no_launcher):
    no_launcher.setenv("RANK", "zero")
    no_launcher.setenv("WORLD_SIZE", "1")
    with pytest.raises(ValueError, match="RANK='zero' is not an integer"):
        init_distributed()
