"""One rank of the test harness: the worker process that joins the gloo group and runs payloads.

The test process side (pools, timeouts, failure reports) is :mod:`plait.testing.harness`.
"""

from __future__ import annotations

import faulthandler
import os
import pickle
import random
import signal
import sys
import traceback
from datetime import timedelta
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.tensor.debug import (
    _clear_sharding_prop_cache,
    _get_fast_path_sharding_prop_cache_stats,
    _get_python_sharding_prop_cache_info,
)

__all__ = ["HOST", "IN_WORKER_ENV", "MAX_SUBGROUPS", "PG_TIMEOUT", "worker_main"]

HOST = "127.0.0.1"
PG_TIMEOUT = timedelta(seconds=120)
IN_WORKER_ENV = "PLAIT_TESTING_WORKER"
"""Set inside a worker: ``run_on_ranks`` refuses to be called from a rank."""
MAX_SUBGROUPS = 96
"""Live non-default process groups per worker after which its pool is replaced (~3 threads each)."""


def _merge_sys_path(paths: list[str]) -> None:
    for path in reversed(paths):
        if path not in sys.path:
            sys.path.insert(0, path)


def worker_main(
    rank: int, world_size: int, port: int, conn: Connection, stack_file: str, paths: list[str]
) -> None:
    """Entry point of one worker: join the process group, then serve calls until told to stop."""
    os.environ[IN_WORKER_ENV] = "1"
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the test process's business
    stack_out = open(stack_file, "w")  # noqa: SIM115 - must stay open for the process lifetime
    faulthandler.register(signal.SIGUSR1, file=stack_out, all_threads=True)
    _merge_sys_path(paths)
    torch.set_num_threads(1)
    try:
        worker = _Worker(rank, world_size, port)
    except BaseException:
        conn.send(("err", traceback.format_exc(), True, None))
        os._exit(1)
    conn.send(("ok", b"", False, None))
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            break
        if message[0] == "stop":
            break
        _, paths, payload, fresh_cache = message
        conn.send(worker.call(paths, payload, fresh_cache))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # skip interpreter teardown: the gloo group needs no goodbye


class _Worker:
    """One rank's state: the store client and the default group this worker created."""

    def __init__(self, rank: int, world_size: int, port: int) -> None:
        self.rank = rank
        self.world_size = world_size
        self.store = dist.TCPStore(HOST, port, is_master=False, timeout=PG_TIMEOUT)
        self.group: dist.ProcessGroup | None = None
        self._init_group()

    def _init_group(self) -> None:
        dist.init_process_group(
            "gloo",
            store=dist.PrefixStore("plait/pg", self.store),
            rank=self.rank,
            world_size=self.world_size,
            timeout=PG_TIMEOUT,
        )
        self.group = dist.group.WORLD

    def call(self, paths: list[str], payload: bytes, fresh_cache: bool) -> tuple[str, Any, bool, Any]:
        """Run one payload; returns (status, data, whether to retire the pool, the sharding cache's stats).

        ``fresh_cache`` empties DTensor's sharding cache first. The test process asks for it unless
        every rank's cache went through the same hits and misses so far: a kept entry carries the mesh
        object of the call that made it, and two ranks may only pair collectives on the same groups.
        """
        _merge_sys_path(paths)
        try:
            fn, args = pickle.loads(payload)
            if fresh_cache:
                _clear_sharding_prop_cache()
            torch.manual_seed(0)
            random.seed(0)
            np.random.seed(0)
            torch.set_default_dtype(torch.float32)
            torch.set_grad_enabled(True)
            result = fn(*args)
        except BaseException:
            return "err", traceback.format_exc(), True, None
        try:
            return "ok", pickle.dumps(result), self._worn_out(), _cache_stats()
        except Exception:
            return "err", f"the return value cannot be pickled:\n{traceback.format_exc()}", True, None

    def _worn_out(self) -> bool:
        """Whether the call destroyed the default group or the live groups passed the limit."""
        if not (dist.is_initialized() and dist.group.WORLD is self.group):
            return True
        return len(dist.distributed_c10d._world.pg_map) - 1 > MAX_SUBGROUPS


def _cache_stats() -> tuple[int, ...]:
    """DTensor's sharding caches' counters (Python: hits, misses, size; fast path: hits, misses)."""
    info = _get_python_sharding_prop_cache_info()
    return (info.hits, info.misses, info.currsize, *_get_fast_path_sharding_prop_cache_stats())
