"""One rank's life among the others: launcher death, SIGTERM, and a peer's failure.

- **Launcher death**: the rank asks the kernel for SIGKILL when its parent dies
  (``PR_SET_PDEATHSIG``); a watchdog thread also polls the parent pid where prctl is missing.
- **SIGTERM** (to the launcher, which forwards it, or to the job): the handler only sets a flag. At
  the end of each step the ranks agree, through the job's key-value store, on the step to stop
  after (the next one, which no rank can have finished yet); there they save a checkpoint and stop
  with one line. A stop that takes longer than ``PLAIT_TRAIN_STOP_TIMEOUT_S`` (default 25 s, inside
  the launcher's 30 s grace) ends the rank without a checkpoint; the last complete one is kept.
- **A peer's failure**: a rank that fails publishes its one line in the store before it exits. A
  rank whose collective then breaks (or that is blocked in one) prints that line instead of its
  own secondary traceback, so a user error is one line on every rank and an internal error keeps
  its traceback once, on the rank it happened on.
- **A peer's death**: each rank records its pid in the store. A rank whose collective breaks with
  no failure published, while a rank of its machine is gone, names that rank instead of printing a
  secondary traceback (the launcher, which saw it end, names its signal).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from functools import partial
from pathlib import Path
from types import FrameType

import torch.distributed as dist

from plait.train.errors import (
    EXIT_INTERNAL,
    EXIT_STOPPED,
    Stopped,
    UserError,
    emit_error,
    stderr_line,
    user_message,
)
from plait.train.rank_server import LAUNCHER_PID_ENV, RUN_ID_PREFIX

__all__ = ["STOP_TIMEOUT_ENV", "RankLifecycle", "die_with_launcher", "rank_parent"]

STOP_TIMEOUT_ENV = "PLAIT_TRAIN_STOP_TIMEOUT_S"
_STOP_TIMEOUT_S = 25.0
_PR_SET_PDEATHSIG = 1
_PEER_WAIT_S = 1.0
_FAILED_KEY = "failed"
_STOP_KEY = "stop_step"
_PID_KEY = "pid/{rank}"


def rank_parent() -> int:
    """The pid whose death must end this rank: :data:`LAUNCHER_PID_ENV` in a job of the local launcher.

    In any other job (``torchrun``, another tool's launcher) it is the parent process; a
    ``PLAIT_LAUNCHER_PID`` inherited from elsewhere is ignored there.
    """
    ours = os.environ.get("TORCHELASTIC_RUN_ID", "").startswith(RUN_ID_PREFIX)
    if ours and LAUNCHER_PID_ENV in os.environ:
        return int(os.environ[LAUNCHER_PID_ENV])
    return os.getppid()


def die_with_launcher(parent: int | None = None) -> None:
    """Make this process receive SIGKILL when ``parent`` dies; exit at once if it already has.

    ``parent`` defaults to :func:`rank_parent`.
    """
    expected = rank_parent() if parent is None else parent
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != expected:
        os._exit(EXIT_INTERNAL)


def _stop_timeout() -> float:
    raw = os.environ.get(STOP_TIMEOUT_ENV)
    if raw is None:
        return _STOP_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise UserError(f"{STOP_TIMEOUT_ENV}={raw!r} must be a positive number of seconds")
    return value


def _job_store(world: int) -> dist.Store | None:
    """A client of the job's store of its own (the main thread may block in the default one)."""
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if world == 1 or not addr or not port:
        return None
    try:
        store = dist.TCPStore(addr, int(port), is_master=False, timeout=timedelta(seconds=30))
    except (RuntimeError, ValueError):
        return None
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"plait/lifecycle/{attempt}/", store)


def _gone(pid: int) -> bool:
    """Whether process ``pid`` of this machine has ended (a zombie has); False where /proc is missing."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return Path("/proc/self/stat").exists()
    except (OSError, IndexError):
        return False
    return state in ("Z", "X")


class RankLifecycle:
    """SIGTERM, the launcher and the other ranks, for one rank of a training job."""

    def __init__(self, rank: int, world: int) -> None:
        self.rank, self.world = rank, world
        self.store = _job_store(world)
        self._signalled_at: float | None = None
        self._proposed = False
        self._stop_step: int | None = None
        self._settling = threading.Event()
        self._closed = threading.Event()
        self._print_lock = threading.Lock()
        self._parent = rank_parent()
        self._previous: signal.Handlers | None = None
        self._deadline = _stop_timeout()
        self._watchdog = threading.Thread(target=self._watch, name="plait-rank-watchdog", daemon=True)

    # -- set-up -------------------------------------------------------------------------------

    def start(self) -> RankLifecycle:
        """Install the SIGTERM handler (main thread only), record this rank's pid, start the watchdog."""
        with contextlib.suppress(ValueError):
            self._previous = signal.signal(signal.SIGTERM, self._on_sigterm)
        self._set_pid(os.getpid())
        self._watchdog.start()
        return self

    def close(self) -> None:
        """Stop the watchdog; restore the previous SIGTERM handler unless the rank is failing.

        A failing rank keeps ignoring SIGTERM while it shuts down, so the launcher's stop of the
        others does not cut off its one line or turn its exit code into -15.
        """
        self._closed.set()
        if not self._settling.is_set():
            self._set_pid(0)  # ended on purpose: not a death for the others
        if self._previous is not None and not self._settling.is_set():
            with contextlib.suppress(ValueError):
                signal.signal(signal.SIGTERM, self._previous)

    def _set_pid(self, pid: int) -> None:
        if self.store is not None:
            with contextlib.suppress(RuntimeError):
                self.store.set(_PID_KEY.format(rank=self.rank), str(pid))

    def _on_sigterm(self, signum: int, frame: FrameType | None) -> None:
        if self._signalled_at is None:
            self._signalled_at = time.monotonic()

    # -- stopping -----------------------------------------------------------------------------

    @property
    def signalled(self) -> bool:
        """Whether SIGTERM was received."""
        return self._signalled_at is not None

    def should_stop(self, step: int) -> bool:
        """Call at the end of every step on every rank: whether all ranks stop after ``step``."""
        if self.signalled and not self._proposed:
            self._proposed = True
            if self.store is None:
                self._stop_step = step
            else:
                self.store.compare_set(_STOP_KEY, "", str(step + 1))
        if self._stop_step is None and self.store is not None and self.store.check([_STOP_KEY]):
            self._stop_step = int(self.store.get(_STOP_KEY))
        return self._stop_step is not None and step >= self._stop_step

    # -- failures -----------------------------------------------------------------------------

    def settle(self, err: BaseException) -> BaseException:
        """The exception this rank ends with (called with the one it raised); publishes its line.

        A user error becomes a :class:`UserError`; a secondary error after a peer's failure
        becomes that peer's line; anything else is an internal error and is returned unchanged.
        """
        self._settling.set()
        message = user_message(err)
        if isinstance(err, Stopped):
            return err
        if message is not None:
            self._publish(f"2|{message}")
            return err if isinstance(err, UserError) else UserError(message)
        peer = self._peer_failure(_PEER_WAIT_S)
        if peer is not None:
            return peer
        dead = self._dead_peer()
        if dead is not None:
            line = f"rank {dead} died without a report (a signal, or a crash outside Python)"
            self._publish(f"{EXIT_INTERNAL}|{line}", origin=dead)
            return self._peer_failure(0.0) or UserError(line, exit_code=EXIT_INTERNAL, rank=dead)
        self._publish(f"{EXIT_INTERNAL}|internal error ({type(err).__name__}), traceback above")
        return err

    def _publish(self, payload: str, *, origin: int | None = None) -> None:
        if self.store is not None:
            with contextlib.suppress(RuntimeError):
                self.store.compare_set(
                    _FAILED_KEY, "", f"{self.rank if origin is None else origin}|{payload}"
                )

    def _dead_peer(self) -> int | None:
        """A rank of this machine that recorded its pid and has ended since without saying so."""
        local_rank, local_world = os.environ.get("LOCAL_RANK"), os.environ.get("LOCAL_WORLD_SIZE")
        if self.store is None or local_rank is None or local_world is None:
            return None
        first = self.rank - int(local_rank)
        for peer in range(first, first + int(local_world)):
            key = _PID_KEY.format(rank=peer)
            with contextlib.suppress(RuntimeError, ValueError):
                if peer != self.rank and self.store.check([key]):
                    pid = int(self.store.get(key))
                    if pid > 0 and _gone(pid):
                        return peer
        return None

    def _peer_failure(self, wait_s: float) -> UserError | None:
        if self.store is None:
            return None
        deadline = time.monotonic() + wait_s
        while True:
            with contextlib.suppress(RuntimeError):
                if self.store.check([_FAILED_KEY]):
                    rank, code, message = self.store.get(_FAILED_KEY).decode().split("|", 2)
                    if int(rank) != self.rank:
                        return UserError(f"{message} (on rank {rank})", exit_code=int(code), rank=int(rank))
                    return None
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.1)

    # -- the watchdog -------------------------------------------------------------------------

    def _watch(self) -> None:
        period = 1.0 + self.world / 2000
        while not self._closed.wait(period):
            if os.getppid() != self._parent:
                os.kill(os.getpid(), signal.SIGKILL)
            if self._settling.is_set():
                continue
            peer = self._peer_failure(0.0)
            if peer is not None:
                self._exit(peer.exit_code, partial(emit_error, str(peer), peer.exit_code, origin=peer.rank))
            if self._signalled_at is not None and time.monotonic() - self._signalled_at > self._deadline:
                line = (
                    f"plait-train: stopped by SIGTERM, but the ranks could not stop and save within "
                    f"{self._deadline:g} s ({STOP_TIMEOUT_ENV}); the last complete checkpoint is kept"
                )
                self._exit(EXIT_STOPPED, partial(stderr_line, line))

    def _exit(self, code: int, say: Callable[[], None]) -> None:
        """End the process from the watchdog (the main thread is blocked): ``say()`` its line, no cleanup."""
        with self._print_lock:
            if self._settling.is_set():
                return
            say()
            with contextlib.suppress(Exception):
                sys.stdout.flush()
            os._exit(code)
