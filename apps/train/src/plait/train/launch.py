"""Start local ranks when not under a launcher: the same entry point under torch's elastic agent.

``uv run apps/train`` without ``RANK``/``WORLD_SIZE`` re-runs itself as ``python -m plait.train``
on ``nproc_per_node`` local ranks through ``torch.distributed.launcher.elastic_launch`` (the engine
behind ``torchrun --standalone``): a free rendezvous port, restarts on failure when asked.
Under ``torchrun`` nothing is launched; the launcher's ranks are used as they are.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import uuid
from collections.abc import Iterator

__all__ = ["defer_sigterm", "launch_local", "under_launcher"]


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


def launch_local(argv: list[str], *, nproc_per_node: int, max_restarts: int = 0) -> int:
    """Run ``python -m plait.train <argv>`` on ``nproc_per_node`` local ranks; return an exit code."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    if "OMP_NUM_THREADS" not in os.environ:
        os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // nproc_per_node))
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc_per_node,
        run_id=f"plait-train-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d",
        rdzv_endpoint="localhost:0",
        max_restarts=max_restarts,
        monitor_interval=0.2,
    )
    try:
        elastic_launch(config, sys.executable)("-u", "-m", "plait.train", *argv)
    except ChildFailedError as err:
        codes = sorted({f.exitcode for f in err.failures.values()})
        print(f"plait-train: {len(err.failures)} rank(s) failed (exit codes {codes})", file=sys.stderr)
        return next((c for c in codes if c > 0), 1)
    return 0
