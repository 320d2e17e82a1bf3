"""User errors as one line: ``plait-train: error: ...`` naming the file, key or value and the way out.

A mistake in the recipe, its files or the environment must never end in a multi-rank traceback.
:func:`user_message` decides whether an exception is such a mistake (our own ``ValueError`` /
``TypeError`` messages, an ``OSError`` on a named file, text that is not UTF-8, a file that is not
safetensors, a recipe nested too deeply) and phrases it; anything else is an internal error and
keeps its traceback. :func:`phase` adds what the job was doing (which file, which recipe key) to
the errors that do not say it themselves. ``PLAIT_TRAIN_TRACEBACK=1`` shows the traceback of every
error, user errors included.

Under the local launcher (:data:`REPORTS_ENV` set) a rank does not print its error line: it writes
it, with its exit code and the rank it happened on, to ``<reports>/rank_<r>.json``; the launcher
prints each distinct line once, naming its ranks (see :mod:`plait.train.launch`). The traceback of
an internal error is printed by the rank itself and kept in ``<run_dir>/errors/rank_<r>.txt``.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import sys
import time
import traceback
from collections.abc import Iterator
from pathlib import Path

__all__ = [
    "EXIT_INTERNAL",
    "EXIT_STOPPED",
    "EXIT_USER",
    "REPORTS_ENV",
    "RUN_ENTRIES",
    "TRACEBACK_ENV",
    "Stopped",
    "UserError",
    "check_run_dir",
    "one_line",
    "phase",
    "emit_error",
    "report",
    "report_internal",
    "user_message",
]

EXIT_USER = 2
"""A user error: the same job fails the same way again (a launcher never restarts it)."""
EXIT_INTERNAL = 1
"""An internal error (a bug, a crash): the traceback is printed once, by the rank it happened on."""
EXIT_STOPPED = 128 + 15
"""Stopped by SIGTERM (after saving a checkpoint where one could be written in time)."""
TRACEBACK_ENV = "PLAIT_TRAIN_TRACEBACK"
REPORTS_ENV = "PLAIT_TRAIN_REPORTS"
"""Set by the local launcher for its ranks: the directory each rank writes its error report to."""
RUN_ENTRIES = (".lock", "recipe.yaml", "metrics.jsonl", "checkpoints", "token_cache")
"""Entries only a run writes: an existing directory holding one of them is a run directory."""
_NAME_MAX = 255
_FIXES = {
    errno.ENOENT: "check the path",
    errno.ENOTDIR: "a parent of the path is a file, not a directory; pick another path",
    errno.EACCES: "check its permissions or pick a writable path",
    errno.EPERM: "check its permissions or pick a writable path",
    errno.EROFS: "the filesystem is read-only; pick a writable path",
    errno.ENOSPC: "free disk space or pick another filesystem",
    errno.EDQUOT: "free disk space or pick another filesystem",
    errno.ENAMETOOLONG: "use a shorter name / out_dir",
    errno.EISDIR: "it is a directory; name a file",
    errno.EEXIST: "remove it or pick another path",
}


class UserError(Exception):
    """A mistake in the recipe, its files or the environment; the message names it and the fix."""

    exit_code = EXIT_USER

    def __init__(self, message: str, *, exit_code: int = EXIT_USER, rank: int | None = None) -> None:
        """``rank``: the rank the error happened on, when it is another (its line, passed on)."""
        super().__init__(message)
        self.exit_code = exit_code
        self.rank = rank


class Stopped(Exception):
    """The job was stopped by a signal; the message says where it stopped and what was saved."""

    exit_code = EXIT_STOPPED


def one_line(text: str) -> str:
    """``text`` with every run of whitespace (newlines included) collapsed to one space."""
    return " ".join(text.split())


def stderr_line(text: str) -> None:
    """Write ``text`` and its newline to stderr in one write, so lines of ranks sharing it never interleave."""
    sys.stderr.flush()
    try:
        fd = sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):  # a captured or replaced stream (io.UnsupportedOperation)
        sys.stderr.write(text + "\n")
        sys.stderr.flush()
        return
    os.write(fd, (text + "\n").encode(errors="replace"))


def emit_error(message: str, code: int, *, origin: int | None = None) -> None:
    """Print ``plait-train: error: <message>``, or under the local launcher report it to the launcher.

    ``code`` is the rank's exit code, ``origin`` the rank the error happened on when it is another.
    A report that cannot be written is printed instead.
    """
    line = f"plait-train: error: {one_line(message)}"
    reports, rank = os.environ.get(REPORTS_ENV), os.environ.get("RANK")
    if reports and rank is not None:
        record = {"line": line, "code": code, "origin": int(rank) if origin is None else origin}
        with contextlib.suppress(OSError):
            Path(reports, f"rank_{rank}.json").write_text(json.dumps(record))
            return
    stderr_line(line)


def report(err: BaseException) -> int:
    """Print the one line of a user error (or a stop) and return the process exit code.

    With ``PLAIT_TRAIN_TRACEBACK=1`` the traceback (and its causes) is printed first.
    """
    if os.environ.get(TRACEBACK_ENV) == "1":
        traceback.print_exception(err, file=sys.stderr)
    if isinstance(err, Stopped):
        stderr_line(f"plait-train: {one_line(str(err))}")
        return EXIT_STOPPED
    code = getattr(err, "exit_code", EXIT_USER)
    emit_error(user_message(err) or str(err), code, origin=getattr(err, "rank", None))
    return code


def report_internal(err: BaseException, run_dir: str | Path) -> int:
    """Print the traceback of an internal error once, keep it in ``<run_dir>/errors/rank_<r>.txt``.

    Then its line is emitted (see :func:`emit_error`). Returns :data:`EXIT_INTERNAL`.
    """
    text = "".join(traceback.format_exception(err))
    stderr_line(text.rstrip("\n"))
    kept = Path(run_dir, "errors", f"rank_{os.environ.get('RANK', '0')}.txt")
    try:
        kept.parent.mkdir(parents=True, exist_ok=True)
        with kept.open("a") as f:
            f.write(f"--- {time.strftime('%Y-%m-%d %H:%M:%S')}, pid {os.getpid()}\n{text}\n")
        where = f"; kept in {kept}"
    except OSError:
        where = ""
    emit_error(f"internal error ({type(err).__name__}), traceback above{where}", EXIT_INTERNAL)
    return EXIT_INTERNAL


def _raised_by_plait(err: BaseException) -> bool:
    """Whether ``err`` was raised by plait's own code (our ValueError/TypeError messages are for users)."""
    tb = err.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb is not None and str(tb.tb_frame.f_globals.get("__name__", "")).startswith("plait.")


def _describe(err: BaseException) -> str | None:
    if isinstance(err, UnicodeDecodeError):
        byte = err.object[err.start : err.start + 1]
        return f"not UTF-8 text (byte 0x{byte.hex()} at offset {err.start}); save it as UTF-8"
    if isinstance(err, RecursionError):
        return "nested too deeply to read; flatten it"
    if isinstance(err, OSError) and err.filename is not None:
        fix = _FIXES.get(err.errno or 0, "check the path")
        return f"{err.filename!s}: {err.strerror or err}; {fix}"
    if type(err).__name__ == "SafetensorError":
        return f"not a valid .safetensors file ({err}); re-export the weights with safetensors"
    return None


def user_message(err: BaseException) -> str | None:
    """The one-line message of a user-caused error, or None for an internal error."""
    if isinstance(err, UserError | Stopped):
        return one_line(str(err))
    described = _describe(err)
    if described is not None:
        return one_line(described)
    if isinstance(err, ValueError | TypeError) and _raised_by_plait(err):
        return one_line(str(err))
    if type(err).__name__ == "SetupError":
        return one_line(str(err))
    return None


@contextlib.contextmanager
def phase(what: str) -> Iterator[None]:
    """Re-raise user-caused errors of one step of the job as a :class:`UserError` prefixed by ``what``.

    ``what`` names the file or recipe key being worked on, e.g. ``"model.pretrained_path '/w'"``.
    Internal errors pass through unchanged.
    """
    try:
        yield
    except (UserError, Stopped):
        raise
    except Exception as err:
        message = user_message(err)
        if message is None:
            raise
        raise UserError(f"{what}: {message}") from err


def check_run_dir(run_dir: str | Path) -> None:
    """Refuse a run directory that cannot exist or is not a run's, on every rank, before anything is written.

    A run writes, and its checkpoint rotation deletes, under its directory: ``/``, the home directory
    and an existing directory holding files but none of :data:`RUN_ENTRIES` are refused.

    Raises:
        UserError: a path component longer than the filesystem's 255-byte limit, or one of those.
    """
    for part in Path(run_dir).parts:
        size = len(os.fsencode(part))
        if size > _NAME_MAX:
            raise UserError(
                f"run directory {str(run_dir)[:60]!r}... has a {size}-byte component (the limit is {_NAME_MAX}); "
                "use a shorter name / out_dir"
            )
    resolved = Path(run_dir).resolve()
    if resolved == Path(resolved.anchor) or resolved == Path.home().resolve():
        what = "the filesystem root" if resolved == Path(resolved.anchor) else "your home directory"
        raise UserError(
            f"out_dir {str(run_dir)!r} is {what}; a run writes and deletes files in its directory: "
            "name a directory of its own, e.g. out_dir: runs/{name}"
        )
    if resolved.is_dir():
        with phase(f"out_dir {str(run_dir)!r}"):
            entries = sorted(p.name for p in resolved.iterdir())
        if entries and not set(entries) & set(RUN_ENTRIES):
            shown = ", ".join(entries[:3]) + (", ..." if len(entries) > 3 else "")
            raise UserError(
                f"out_dir {str(run_dir)!r} holds other files ({shown}) and is not a run directory; a run writes "
                "and deletes files in its directory: name a new or empty one"
            )
