"""Start local ranks when not under a launcher: the same entry point under torch's elastic agent.

``uv run apps/train`` without ``RANK``/``WORLD_SIZE`` runs the same command line on
``nproc_per_node`` local ranks through ``torch.distributed.launcher.elastic_launch`` (the engine
behind ``torchrun --standalone``), each rank forked from :mod:`plait.train.rank_server`: a free
rendezvous port, restarts of crashed attempts when
asked (never of a user error, exit 2), one line on SIGTERM, at most as many ranks as the machine
runs. Under ``torchrun`` nothing is launched; the launcher's ranks are used as they are.

When ranks fail, the ranks' error lines come to the launcher (each rank writes its own to a
directory of the launcher's, see :data:`plait.train.errors.REPORTS_ENV`), which prints each distinct
line once, naming its ranks when several printed it (``... (on ranks 0-3)``), then one line that
names a rank killed by a signal (``rank 3 was killed by SIGKILL``) and counts the failed ranks:
those that failed on their own or were killed, not those that stopped after them.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import sys
import tempfile
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from plait.train.errors import EXIT_STOPPED, EXIT_USER, REPORTS_ENV, stderr_line
from plait.train.rank_server import RUN_ID_PREFIX, rank_main, start_rank_server

__all__ = [
    "ATTEMPT_ENV",
    "check_nproc",
    "defer_sigterm",
    "launch_local",
    "max_local_ranks",
    "under_launcher",
]

ATTEMPT_ENV = "PLAIT_TRAIN_ATTEMPT"
"""Set by the local launcher: 0 for the first attempt, then 1, 2, ... per restart."""
_RANKS_PER_CORE = 4


def under_launcher() -> bool:
    """Whether this process is one rank of a launched job (``RANK`` or ``WORLD_SIZE`` set)."""
    return "RANK" in os.environ or "WORLD_SIZE" in os.environ


@contextlib.contextmanager
def defer_sigterm() -> Iterator[None]:
    """Hold SIGTERM while the recipe is checked; re-deliver it afterwards.

    When every rank rejects a bad recipe, the launcher stops the others as soon as the first one
    exits; holding the signal for this short, collective-free stretch lets each rank still print
    its own one-line error. Outside the main thread this does nothing.
    """
    received: list[int] = []
    try:
        previous = signal.signal(signal.SIGTERM, lambda signum, frame: received.append(signum))
    except ValueError:
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)
        if received:
            sys.stderr.flush()
            os.kill(os.getpid(), signal.SIGTERM)


def max_local_ranks(device: str) -> int:
    """Ranks this machine can run: one per GPU under CUDA, else ``_RANKS_PER_CORE`` per CPU core."""
    import torch

    if device == "cuda" or (device == "auto" and torch.cuda.is_available()):
        count = torch.cuda.device_count()
        if device == "cuda" or count > 0:
            return max(count, 1)
    return _RANKS_PER_CORE * (os.cpu_count() or 1)


def check_nproc(nproc_per_node: int, device: str, *, oversubscribe: bool) -> None:
    """Refuse more local ranks than the machine can run, unless ``launch.oversubscribe`` says so.

    Raises:
        ValueError: ``nproc_per_node`` above :func:`max_local_ranks`.
    """
    limit = max_local_ranks(device)
    if nproc_per_node > limit and not oversubscribe:
        cores = os.cpu_count() or 1
        raise ValueError(
            f"launch.nproc_per_node {nproc_per_node} is more ranks than this machine can run (at most {limit}: "
            f"{cores} CPU core(s), train.device {device!r}); lower it, or set launch.oversubscribe: true"
        )


def launch_local(
    main: Callable[[list[str]], int], argv: list[str], *, nproc_per_node: int, max_restarts: int = 0
) -> int:
    """Run ``main(argv)``, the command line, on ``nproc_per_node`` local ranks; return an exit code.

    ``main`` is the entry point each rank runs (the caller's own, passed down rather than imported).
    A failed attempt is restarted (up to ``max_restarts`` times, each resuming from the last
    checkpoint) unless a rank exited with a user error (exit 2): the same recipe would fail the
    same way again. SIGTERM/SIGINT to the launcher stops the ranks (they save a checkpoint where they
    can in time) and returns 143; the ranks die with the launcher (see
    :func:`plait.train.lifecycle.die_with_launcher`).
    """
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    threads = os.environ.get("OMP_NUM_THREADS") or str(max(1, (os.cpu_count() or 1) // nproc_per_node))
    start_rank_server()
    _quiet_elastic_logs()
    attempt = 0
    with tempfile.TemporaryDirectory(prefix="plait-train-reports-") as reports:
        while True:
            for old in Path(reports).iterdir():
                old.unlink()
            try:
                env = {ATTEMPT_ENV: str(attempt), "OMP_NUM_THREADS": threads, REPORTS_ENV: reports}
                _launch_once(main, argv, nproc_per_node, env)
            except SignalException as err:
                _print_lines(_records(reports))
                stderr_line(f"plait-train: stopped by {signal.Signals(err.sigval).name}")
                return EXIT_STOPPED
            except ChildFailedError as err:
                codes, what = _failed(_records(reports), err.failures, nproc_per_node)
                if codes == [EXIT_STOPPED]:
                    stderr_line("plait-train: the ranks were stopped by SIGTERM")
                    return EXIT_STOPPED
                if EXIT_STOPPED in codes or EXIT_USER in codes or attempt >= max_restarts:
                    why = (
                        "a user error is not retried; "
                        if EXIT_USER in codes and attempt < max_restarts
                        else ""
                    )
                    stderr_line(f"plait-train: {what}; {why}{attempt} restart(s) made")
                    return next((c for c in codes if c > 0), 1)
                attempt += 1
                stderr_line(f"plait-train: restart {attempt} of {max_restarts} ({what})")
                continue
            return 0


def _records(reports: str) -> dict[int, dict[str, Any]]:
    """The ranks' error reports (see :func:`plait.train.errors.emit_error`), by rank."""
    found = {}
    for path in Path(reports).glob("rank_*.json"):
        with contextlib.suppress(OSError, ValueError):
            found[int(path.stem.removeprefix("rank_"))] = json.loads(path.read_text())
    return found


def _spans(ranks: list[int]) -> str:
    """``[0, 1, 2, 5]`` as ``0-2, 5``."""
    spans: list[list[int]] = []
    for rank in sorted(ranks):
        if spans and rank == spans[-1][-1] + 1:
            spans[-1].append(rank)
        else:
            spans.append([rank])
    return ", ".join(f"{s[0]}-{s[-1]}" if len(s) > 1 else str(s[0]) for s in spans)


def _print_lines(records: dict[int, dict[str, Any]], skip: set[int] | frozenset[int] = frozenset()) -> None:
    """Each distinct line once, in rank order; a rank's own line printed by several gets ``(on ranks ...)``.

    Lines passed on from a rank in ``skip`` (one killed by a signal, named by the launcher) are left out.
    """
    by_line: dict[str, list[int]] = {}
    for rank in sorted(records):
        if records[rank]["origin"] not in skip:
            by_line.setdefault(records[rank]["line"], []).append(rank)
    for line, ranks in by_line.items():
        own = all(records[r]["origin"] == r for r in ranks)
        stderr_line(f"{line} (on ranks {_spans(ranks)})" if own and len(ranks) > 1 else line)


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {_spans(ranks)}"


def _failed(
    records: dict[int, dict[str, Any]], failures: dict[int, Any], world: int
) -> tuple[list[int], str]:
    """Print the ranks' lines and a killed rank's signal; return the exit codes and what failed.

    ``failures`` (torch elastic's, by global rank) holds the first rank seen to end: its exit code,
    negative for a signal. Failed ranks are those that failed on their own, ended without a report
    (killed) or were named by others as the origin of their error; the rest stopped after them.
    """
    killed = {r: f.signal_name() for r, f in failures.items() if f.exitcode < 0 and r not in records}
    _print_lines(records, set(killed))
    for rank, name in sorted(killed.items()):
        stderr_line(f"plait-train: rank {rank} was killed by {name}")
    failed = {r: f"exit code {rec['code']}" for r, rec in records.items() if rec["origin"] == r}
    failed.update(
        {r: f"exit code {f.exitcode}" for r, f in failures.items() if f.exitcode > 0 and r not in records}
    )
    failed.update(killed)
    for origin in {rec["origin"] for rec in records.values()} - set(failed):
        failed[origin] = "no report"
    codes = sorted({*(rec["code"] for rec in records.values()), *(f.exitcode for f in failures.values())})
    groups: dict[str, list[int]] = {}
    for rank in sorted(failed):
        groups.setdefault(failed[rank], []).append(rank)
    what = f"{len(failed)} of {world} ranks failed ({'; '.join(f'{_ranks(rs)}: {how}' for how, rs in groups.items())})"
    after = sorted(set(records) - set(failed))
    if after:
        what += f"; {_ranks(after)} stopped after {'it' if len(failed) == 1 else 'them'}"
    return codes, what


def _launch_once(
    main: Callable[[list[str]], int], argv: list[str], nproc_per_node: int, env: dict[str, str]
) -> None:
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    config = LaunchConfig(
        start_method="forkserver",
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc_per_node,
        run_id=f"{RUN_ID_PREFIX}{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d",
        rdzv_endpoint="localhost:0",
        max_restarts=0,
        monitor_interval=0.2,
    )
    elastic_launch(config, rank_main)(main, argv, env)


def _quiet_elastic_logs() -> None:
    """Our own lines say what failed; torch elastic's multi-line failure reports would repeat it."""
    for name in list(logging.root.manager.loggerDict):
        if name.startswith(
            ("torch.distributed.elastic", "torch.distributed.launcher", "torch.multiprocessing")
        ):
            logging.getLogger(name).setLevel(logging.CRITICAL)
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
