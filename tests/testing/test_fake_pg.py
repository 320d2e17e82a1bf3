"""fake_process_group: one process plays one rank of a huge world; meshes build quickly inside."""

import importlib
import time

import pytest
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from plait.testing import fake_process_group, run_on_ranks


def _fake_inside_a_rank() -> None:
    with fake_process_group(4):
        pass


def test_builds_a_4d_mesh_of_16384_ranks_quickly(fake_pg):
    importlib.import_module("torch._dynamo")  # mesh slicing imports it once per process; not what we time
    start = time.monotonic()
    with fake_pg(16384, rank=5000):
        mesh = init_device_mesh("cpu", (8, 16, 8, 16), mesh_dim_names=("pp", "dp", "cp", "tp"))
        assert dist.get_world_size() == 16384 and dist.get_rank() == 5000
        assert mesh.size() == 16384
        assert mesh["tp"].size() == 16 and mesh["dp"].size() == 16
        assert list(mesh.get_coordinate()) == [2, 7, 0, 8]
    assert time.monotonic() - start < 10
    assert not dist.is_initialized()


def test_the_group_is_destroyed_even_when_the_block_raises():
    with pytest.raises(KeyError), fake_process_group(8):
        raise KeyError("boom")
    assert not dist.is_initialized()


def test_rejects_a_rank_outside_the_world():
    with pytest.raises(ValueError, match="rank"), fake_process_group(4, rank=4):
        pass


def test_refuses_to_replace_a_real_default_group():
    with pytest.raises(AssertionError, match="already has a 'gloo' group"):
        run_on_ranks(_fake_inside_a_rank, 1)
