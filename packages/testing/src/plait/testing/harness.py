"""Run a module-level function on N real gloo ranks, reusing the worker processes across calls.

Each world size gets one pool of workers that stays alive for the whole test session. Workers
are forked from multiprocessing's forkserver, which imports torch (and transformers when
installed) once, while pytest collects the tests (the plugin's `pytest_configure`); a fresh pool
of 8 ranks then starts in well under a second instead of importing torch 8 times. Every worker holds an initialised default process group (gloo, CPU).
A call that raises, dies or hangs on any rank discards the pool; the next call starts a fresh one,
so a broken collective never leaks into another test.

Process groups a call creates (meshes) are never destroyed inside a live worker: tearing a gloo
group down while its peers tear down theirs races in gloo's event loop (the workers died with
SIGSEGV / general protection faults in the `pt_gloo_runloop` thread, torch 2.15). Instead, a pool
whose workers hold more than `rank_worker.MAX_SUBGROUPS` groups (each holds threads and sockets) is retired
after the call, all its ranks killed together, and the next call starts fresh workers.

DTensor's sharding cache is kept from one call to the next (a third of a parity case's time is spent
filling it) while every rank's cache went through the same hits and misses: meshes of the same
layout compare equal, so a kept entry hands out the earlier call's mesh, which is only safe when every
rank gets the same one. After a call whose ranks diverged (pipeline stages run different ops), the next
call starts with the cache empty on every rank.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib.util
import multiprocessing as mp
import multiprocessing.forkserver as mp_forkserver
import os
import pickle
import shutil
import signal
import sys
import tempfile
import time
import traceback
from collections import OrderedDict
from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection, wait
from typing import Any

import torch.distributed as dist

from plait.testing.rank_worker import HOST, IN_WORKER_ENV, PG_TIMEOUT, worker_main

__all__ = ["RankFailure", "run_on_ranks", "start_forkserver"]

_MAX_WORLD_SIZE = 16
"""16 for the tools' widest layouts (tools/combination_matrix.py); the test suite uses up to 8."""
_MAX_LIVE_WORKERS = 15
"""Worker processes kept alive across pools (1 + 2 + 4 + 8); least recently used pools go first."""
_STARTUP_TIMEOUT_S = 600.0
_ERROR_GRACE_S = 5.0
"""After one rank fails, how long the others get to finish before they count as hung."""
_STACK_WAIT_S = 2.0
_WORKER_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
_PRELOAD = (
    "numpy",
    "torch",
    "torch._dynamo",  # DTensor and FSDP import it lazily; without .pyc files that costs ~10 s per process
    "torch.distributed.tensor",
    "torch.distributed.fsdp",
    "plait.models",
    "plait.testing",
)
_PRELOAD_IF_INSTALLED = ("transformers",)


class RankFailure(AssertionError):
    """One or more ranks raised, died or hung; `reports` maps each such rank to its traceback or stack."""

    def __init__(self, summary: str, reports: dict[int, str]) -> None:
        self.reports = dict(sorted(reports.items()))
        body = "\n".join(f"===== rank {rank} =====\n{text.rstrip()}" for rank, text in self.reports.items())
        super().__init__(f"{summary}\n{body}")


def start_forkserver() -> None:
    """Start the workers' forkserver unless it runs, so that its imports overlap test collection."""
    mp.get_context("forkserver").set_forkserver_preload(_preload())
    with _worker_environment():
        mp_forkserver.ensure_running()


def _preload() -> list[str]:
    return [*_PRELOAD, *(m for m in _PRELOAD_IF_INSTALLED if importlib.util.find_spec(m) is not None)]


def run_on_ranks(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 180.0) -> list[Any]:
    """Run `fn(*args)` on `world_size` gloo ranks and return each rank's result in rank order.

    Args:
        fn: a module-level (picklable) function; it runs with the default process group
            initialised, after `torch.manual_seed(0)` and with float32 as the default dtype.
        world_size: number of ranks, 1 to 16.
        *args: picklable arguments passed to `fn` on every rank.
        timeout: seconds the whole call may take before the ranks count as hung.

    Raises:
        RankFailure: a rank raised, died, returned something unpicklable or the call timed out;
            the message holds each failing rank's traceback (or Python stack when hung).
    """
    if os.environ.get(IN_WORKER_ENV):
        raise RuntimeError("run_on_ranks cannot be called from inside a rank; call it from the test itself.")
    if not isinstance(world_size, int) or not 1 <= world_size <= _MAX_WORLD_SIZE:
        raise ValueError(f"world_size must be an int in 1..{_MAX_WORLD_SIZE}, got {world_size!r}.")
    if timeout <= 0:
        raise ValueError(f"timeout must be > 0 seconds, got {timeout!r}.")
    try:
        payload = pickle.dumps((fn, args))
    except Exception as exc:
        raise TypeError(
            f"run_on_ranks needs a module-level function and picklable arguments; cannot pickle "
            f"{getattr(fn, '__qualname__', fn)!r} with its arguments: {exc}"
        ) from exc
    label = f"run_on_ranks({getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', fn)}, world_size={world_size})"
    return _get_pool(world_size).run(payload, timeout, label)


_POOLS: OrderedDict[int, _Pool] = OrderedDict()
"""Explicit registry of live worker pools, keyed by world size, least recently used first."""


def _get_pool(world_size: int) -> _Pool:
    pool = _POOLS.pop(world_size, None)
    if pool is not None and not pool.usable():
        pool.close(kill=True)
        pool = None
    if pool is None:
        while _POOLS and sum(p.world_size for p in _POOLS.values()) + world_size > _MAX_LIVE_WORKERS:
            _POOLS.popitem(last=False)[1].close()
        pool = _Pool(world_size)
    _POOLS[world_size] = pool
    return pool


def _discard(pool: _Pool) -> None:
    if _POOLS.get(pool.world_size) is pool:
        del _POOLS[pool.world_size]
    pool.close(kill=True)


@atexit.register
def _close_all_pools() -> None:
    while _POOLS:
        _POOLS.popitem()[1].close()


@contextlib.contextmanager
def _worker_environment() -> Iterator[None]:
    """The forkserver copies os.environ when it starts; set the worker variables just for that moment."""
    saved = {key: os.environ.get(key) for key in _WORKER_ENV}
    os.environ.update(_WORKER_ENV)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


class _Pool:
    """`world_size` worker processes plus the TCPStore (hosted here) they rendezvous through."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.owner_pid = os.getpid()
        self.closed = False
        self.worn_out = False
        """Set when a rank asks for fresh workers (see `_Worker.call`); the pool is then discarded."""
        self.fresh_cache = True
        """Whether the next call empties DTensor's sharding cache: unless every rank's went the same way."""
        self.store = dist.TCPStore(HOST, 0, is_master=True, wait_for_workers=False, timeout=PG_TIMEOUT)
        self.tmpdir = tempfile.mkdtemp(prefix=f"plait-ranks{world_size}-")
        self.stack_files = [os.path.join(self.tmpdir, f"rank{r}.stack") for r in range(world_size)]
        self.procs: list[mp.process.BaseProcess] = []
        self.conns: list[Connection] = []
        try:
            self._start_workers()
            _, errors, hung, _ = self._collect(time.monotonic() + _STARTUP_TIMEOUT_S)
        except BaseException:
            self.close(kill=True)
            raise
        if errors or hung:
            self._fail(f"starting {world_size} gloo ranks", errors, hung, _STARTUP_TIMEOUT_S)

    def _start_workers(self) -> None:
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(_preload())
        for rank in range(self.world_size):
            parent_conn, child_conn = ctx.Pipe()
            args = (
                rank,
                self.world_size,
                self.store.port,
                child_conn,
                self.stack_files[rank],
                list(sys.path),
            )
            proc = ctx.Process(target=worker_main, args=args, name=f"plait-rank{rank}-of-{self.world_size}")
            with _worker_environment():
                proc.start()
            child_conn.close()
            self.procs.append(proc)
            self.conns.append(parent_conn)

    def usable(self) -> bool:
        if self.owner_pid != os.getpid():
            return False
        return not self.closed and all(proc.is_alive() for proc in self.procs)

    def run(self, payload: bytes, timeout: float, label: str) -> list[Any]:
        try:
            for conn in self.conns:
                conn.send(("run", list(sys.path), payload, self.fresh_cache))
            replies, errors, hung, cache_stats = self._collect(time.monotonic() + timeout)
            self.fresh_cache = len(cache_stats) != self.world_size or len(set(cache_stats)) != 1
        except BaseException:
            _discard(self)
            raise
        results: list[Any] = [None] * self.world_size
        for rank, data in replies.items():
            try:
                results[rank] = pickle.loads(data)
            except Exception:
                errors[rank] = (
                    f"could not unpickle the return value in the test process:\n{traceback.format_exc()}"
                )
        if errors or hung:
            self._fail(label, errors, hung, timeout)
        if self.worn_out:
            _discard(self)
        return results

    def _collect(self, deadline: float) -> tuple[dict[int, bytes], dict[int, str], list[int], list[Any]]:
        """Wait for one reply per rank; after the first failure the others get a short grace period.

        Returns the replies, errors and hung ranks, and the sharding-cache stats of the ranks that replied.
        """
        pending = {conn: rank for rank, conn in enumerate(self.conns)}
        replies: dict[int, bytes] = {}
        errors: dict[int, str] = {}
        cache_stats: list[Any] = []
        first_error = 0.0
        while pending:
            limit = deadline if not errors else min(deadline, first_error + _ERROR_GRACE_S)
            ready = wait(list(pending), timeout=max(0.0, limit - time.monotonic()))
            if not ready:
                break
            for conn in ready:
                rank = pending.pop(conn)  # type: ignore[index]
                try:
                    status, data, worn_out, stats = conn.recv()  # type: ignore[union-attr]
                    cache_stats.append(stats)
                except (EOFError, OSError):
                    self.procs[rank].join(timeout=1.0)
                    status, data = "err", f"worker process died (exit code {self.procs[rank].exitcode})"
                    worn_out = True
                self.worn_out |= worn_out
                if status == "ok":
                    replies[rank] = data
                    continue
                if not errors:
                    first_error = time.monotonic()
                errors[rank] = data
        return replies, errors, sorted(pending.values()), cache_stats

    def _fail(self, label: str, errors: dict[int, str], hung: list[int], timeout: float) -> None:
        reports = dict(errors)
        for rank, stack in self._dump_stacks(hung).items():
            why = (
                "kept waiting after another rank failed" if errors else f"did not finish within {timeout:g} s"
            )
            reports[rank] = f"hung: {why}; Python stacks at that moment:\n{stack}"
        _discard(self)
        parts = [f"rank {r}: {text.strip().splitlines()[-1]}" for r, text in sorted(errors.items())]
        if hung:
            parts.append(f"ranks {hung} hung")
        raise RankFailure(f"{label} failed ({'; '.join(parts)}); the worker pool was discarded.", reports)

    def _dump_stacks(self, ranks: list[int]) -> dict[int, str]:
        sizes = {r: _file_size(self.stack_files[r]) for r in ranks}
        for rank in ranks:
            with contextlib.suppress(ProcessLookupError, TypeError):
                os.kill(self.procs[rank].pid, signal.SIGUSR1)  # type: ignore[arg-type]
        deadline = time.monotonic() + _STACK_WAIT_S
        while time.monotonic() < deadline and any(_file_size(self.stack_files[r]) == sizes[r] for r in ranks):
            time.sleep(0.05)
        time.sleep(0.1)
        stacks = {}
        for rank in ranks:
            with open(self.stack_files[rank], "rb") as f:
                f.seek(sizes[rank])
                text = f.read().decode(errors="replace")
            stacks[rank] = text or "(no stack dumped: the process did not answer SIGUSR1)"
        return stacks

    def close(self, kill: bool = False) -> None:
        """Stop the workers (politely unless `kill`) and remove the pool's files."""
        if self.closed or self.owner_pid != os.getpid():
            return
        self.closed = True
        if not kill:
            for conn in self.conns:
                with contextlib.suppress(OSError):
                    conn.send(("stop",))
            deadline = time.monotonic() + 2.0
            for proc in self.procs:
                proc.join(timeout=max(0.0, deadline - time.monotonic()))
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()
            proc.join(timeout=5.0)
        for conn in self.conns:
            conn.close()
        shutil.rmtree(self.tmpdir, ignore_errors=True)
        del self.store


def _file_size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0
