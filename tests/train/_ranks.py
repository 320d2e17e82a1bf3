"""A job's processes seen from outside (``/proc``), and a rank killed the way a crash kills it.

A test that needs a rank to die mid-run starts the job, waits for a step in ``metrics.jsonl`` and
sends SIGKILL to one rank that is not rank 0 (rank 0 writes the metrics): the trainer carries no
hook for it.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import tempfile
import time
from pathlib import Path

__all__ = ["alive", "children", "cmdline", "descendants", "rank_pids", "run_killing_a_rank", "train_steps"]


def children(pid: int) -> list[int]:
    """The pids whose parent is ``pid``."""
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def descendants(pid: int) -> list[int]:
    """Every process below ``pid``, parents before their children."""
    return [d for child in children(pid) for d in (child, *descendants(child))]


def cmdline(pid: int) -> bytes:
    """``pid``'s command line (NUL-separated), empty once it is gone."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


def rank_pids(launcher: int) -> list[int]:
    """The ranks of the job ``launcher`` runs: forked from its rank server, or its own children (torchrun)."""
    kids = children(launcher)
    servers = [pid for pid in kids if b"multiprocessing.forkserver" in cmdline(pid)]
    return children(servers[0]) if servers else kids


def train_steps(run_dir: Path) -> list[int]:
    """The steps of the ``train`` records of ``<run_dir>/metrics.jsonl`` so far (every attempt's).

    A line still being written (no newline yet) is left for the next call.
    """
    metrics = run_dir / "metrics.jsonl"
    lines = metrics.read_text().split("\n")[:-1] if metrics.is_file() else []
    return [r["step"] for r in map(json.loads, lines) if r["kind"] == "train"]


def _open_files(pid: int) -> set[str]:
    names = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(OSError):
            names.add(os.readlink(fd))
    return names


def _kill_a_rank_after(proc: subprocess.Popen[str], run_dir: Path, step: int, deadline: float) -> None:
    """SIGKILL one rank but rank 0 of ``proc``'s job as soon as ``step`` is in its metrics."""
    while not train_steps(run_dir):
        assert proc.poll() is None and time.monotonic() < deadline, "the job did not start training"
        time.sleep(0.05)
    ranks = rank_pids(proc.pid)
    others = [pid for pid in ranks if str((run_dir / "metrics.jsonl").resolve()) not in _open_files(pid)]
    assert len(others) == len(ranks) - 1, f"rank 0 is not the one writer of the metrics among {ranks}"
    victim = max(others)
    while step not in train_steps(run_dir):
        assert proc.poll() is None and time.monotonic() < deadline, f"the job never reached step {step}"
        time.sleep(0.01)
    last = train_steps(run_dir)[-1]
    os.kill(victim, signal.SIGKILL)
    assert proc.poll() is None, f"the job ended before the kill (at step {last})"


def run_killing_a_rank(
    args: list[str], *, cwd: Path, env: dict[str, str], run_dir: Path, step: int, timeout: float = 400
) -> subprocess.CompletedProcess[str]:
    """Run the job ``args``; SIGKILL one of its ranks (not rank 0) once ``step`` is logged; wait for it.

    The job's ranks are found in ``/proc`` (see :func:`rank_pids`); rank 0 is the one that holds
    ``<run_dir>/metrics.jsonl`` open. The kill lands at ``step`` or a little after it.
    """
    deadline = time.monotonic() + timeout
    failure = None
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(args, cwd=cwd, env=env, stdout=out, stderr=err, text=True)
        try:
            _kill_a_rank_after(proc, run_dir, step, deadline)
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except (AssertionError, subprocess.TimeoutExpired) as caught:
            failure = str(caught)
        finally:
            proc.kill()  # nothing once it has ended; its ranks die with it
            proc.wait()
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read(), err.read()
    assert failure is None, f"{failure}\n{stderr[-3000:]}"
    return subprocess.CompletedProcess(args, proc.returncode, stdout, stderr)
