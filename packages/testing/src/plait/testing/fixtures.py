"""pytest plugin: register with `pytest_plugins = ["plait.testing.fixtures"]` in a conftest."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager

import pytest
import torch.distributed as dist

from plait.testing.fake_pg import fake_process_group
from plait.testing.harness import start_forkserver

__all__ = ["fake_pg", "pytest_configure"]


def pytest_configure(config: pytest.Config) -> None:
    """Start the rank workers' forkserver while pytest collects the tests."""
    start_forkserver()


@pytest.fixture
def fake_pg() -> Iterator[Callable[..., AbstractContextManager[dist.ProcessGroup]]]:
    """Factory for fake process groups: `with fake_pg(1024): mesh = init_device_mesh("cpu", ...)`.

    The factory is `fake_process_group(world_size, rank=0)`; a fake group the test leaves open
    (for example after a failure mid-block) is destroyed at teardown.
    """
    yield fake_process_group
    if dist.is_initialized() and dist.get_backend() == "fake":
        dist.destroy_process_group()
