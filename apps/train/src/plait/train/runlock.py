"""One job per run directory: rank 0 holds an exclusive ``flock`` on ``<run>/.lock`` for the whole job.

The lock is released by the kernel when the process ends, however it ends (``kill -9``
included), so a crashed job never leaves a stale lock; a job restarted by the launcher takes
it again. The lock file records who holds it, for the error message of the job that is refused.
"""

from __future__ import annotations

import fcntl
import os
import socket
from pathlib import Path
from typing import IO

import torch.distributed as dist

__all__ = ["LOCK_FILE", "RunDirLocked", "RunLock", "lock_run_dir"]

LOCK_FILE = ".lock"


class RunDirLocked(ValueError):
    """Another job holds the run directory."""


class RunLock:
    """An exclusive, non-blocking lock on ``<run_dir>/.lock`` (held until :meth:`release` or exit)."""

    def __init__(self, run_dir: Path) -> None:
        run_dir.mkdir(parents=True, exist_ok=True)
        self.path = run_dir / LOCK_FILE
        self._file: IO[str] | None = open(self.path, "a+")  # noqa: SIM115 - held for the job's lifetime
        try:
            fcntl.flock(self._file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._file.seek(0)
            holder = self._file.read().strip() or "another process"
            self._file.close()
            self._file = None
            raise RunDirLocked(
                f"run directory {str(run_dir)!r} is in use by another job ({holder}); wait for it to finish "
                f"or pick another out_dir"
            ) from None
        self._file.seek(0)
        self._file.truncate()
        self._file.write(f"pid {os.getpid()} on {socket.gethostname()}\n")
        self._file.flush()

    def release(self) -> None:
        """Drop the lock (also done by the kernel when the process exits)."""
        if self._file is not None:
            fcntl.flock(self._file.fileno(), fcntl.LOCK_UN)
            self._file.close()
            self._file = None


def lock_run_dir(run_dir: str | Path) -> RunLock | None:
    """Rank 0 takes the run directory's lock; every rank learns the outcome (a collective).

    Returns:
        The lock on rank 0, None elsewhere.

    Raises:
        RunDirLocked: on every rank, when another job holds the directory.
    """
    rank = dist.get_rank() if dist.is_initialized() else 0
    lock, error = None, None
    if rank == 0:
        try:
            lock = RunLock(Path(run_dir))
        except RunDirLocked as err:
            error = str(err)
    if dist.is_initialized() and dist.get_world_size() > 1:
        box = [error]
        dist.broadcast_object_list(box, src=0)
        error = box[0]
    if error is not None:
        raise RunDirLocked(error)
    return lock
