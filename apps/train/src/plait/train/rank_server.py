"""The process local ranks are forked from: torch, the trainer and transformers imported once.

Starting a rank as a new interpreter imports torch, DTensor, FSDP, plait and transformers again in
every rank (seconds of CPU each, and all ranks of a CPU job share the same cores); a restarted
attempt pays it again. The local launcher instead starts one ``multiprocessing`` fork server that
imports them once, and torch's elastic agent forks each rank from it (``start_method
"forkserver"``): a rank starts in milliseconds, an attempt after a crash as well. Nothing in the
server touches a device, so each rank still initialises CUDA (or not) on its own.

Lifetime: the server dies with the launcher and the ranks, its children, with the server (each
asks the kernel for SIGKILL when its parent dies, ``PR_SET_PDEATHSIG``; see
:mod:`plait.train.server_lifetime` and :func:`plait.train.lifecycle.die_with_launcher`).

This module imports nothing heavy (the launcher imports it before it starts the server) and no
other module of the app: the rank's entry point is passed in (:func:`rank_main`).
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.forkserver
import os
import sys
import traceback
from collections.abc import Callable

__all__ = ["LAUNCHER_PID_ENV", "PRELOADED", "RUN_ID_PREFIX", "rank_main", "start_rank_server"]

LAUNCHER_PID_ENV = "PLAIT_LAUNCHER_PID"
"""Set by the local launcher for its ranks: the process whose death must end them."""
RUN_ID_PREFIX = "plait-train-"
"""The start of the elastic run id of every job of the local launcher (its ranks are forked here)."""
PRELOADED = (
    "plait.train.server_lifetime",
    "plait.train.quiet_logs",
    "plait.train.trainer",
    "transformers.modeling_utils",
    "transformers.masking_utils",
)
"""Modules the server imports before it forks a rank (one that is missing is skipped)."""


def start_rank_server() -> None:
    """Start the fork server with :data:`PRELOADED` imported, unless this launcher already has.

    Called as soon as the command line says "train" without a launcher, so that the server's imports
    run while the launcher checks the recipe.
    """
    os.environ[LAUNCHER_PID_ENV] = str(os.getpid())
    multiprocessing.set_forkserver_preload(list(PRELOADED))
    multiprocessing.forkserver.ensure_running()


def rank_main(main: Callable[[list[str]], int], argv: list[str], env: dict[str, str]) -> None:
    """One forked rank: ``main(argv)`` (what ``python -m plait.train <argv>`` runs), with ``env`` set.

    ``main`` is the command line's entry point, passed down by the launcher (pickled by reference).
    ``env`` holds what the launcher decided after the server started (the attempt number, the
    threads per rank); the rest of the environment is the server's, the launcher's at its start.

    An exception that escapes ``main`` has its traceback printed here, as an uncaught one would be
    under ``torchrun``: torch's worker wrapper would only hand it to the launcher's log.

    Raises:
        SystemExit: with the rank's exit code when it is not 0.
    """
    launcher = int(os.environ[LAUNCHER_PID_ENV])
    try:
        os.kill(launcher, 0)
    except ProcessLookupError:
        os._exit(1)
    # The server is the parent whose death must end this rank; it ends with the launcher.
    os.environ[LAUNCHER_PID_ENV] = str(os.getppid())
    os.environ.update(env)
    import torch

    torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    for stream in (sys.stdout, sys.stderr):
        stream.reconfigure(line_buffering=True, write_through=True)
    try:
        code = main(argv)
    except Exception:
        traceback.print_exc()
        raise
    if code:
        sys.exit(code)
