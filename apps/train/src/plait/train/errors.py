"""User errors as one line: ``plait-train: error: ...`` naming the file, key or value and the way out.

A mistake in the recipe, its files or the environment must never end in a multi-rank traceback.
:func:`user_message` decides whether an exception is such a mistake (our own ``ValueError`` /
``TypeError`` messages, an ``OSError`` on a named file, text that is not UTF-8, a file that is not
safetensors, a recipe nested too deeply) and phrases it; anything else is an internal error and
keeps its traceback. :func:`phase` adds what the job was doing (which file, which recipe key) to
the errors that do not say it themselves. ``PLAIT_TRAIN_TRACEBACK=1`` shows the traceback of every
error, user errors included.
"""

from __future__ import annotations

import contextlib
import errno
import os
import sys
import traceback
from collections.abc import Iterator
from pathlib import Path

__all__ = [
    "EXIT_INTERNAL",
    "EXIT_STOPPED",
    "EXIT_USER",
    "TRACEBACK_ENV",
    "Stopped",
    "UserError",
    "check_run_dir",
    "one_line",
    "phase",
    "print_error",
    "report",
    "user_message",
]

EXIT_USER = 2
"""A user error: the same job fails the same way again (a launcher never restarts it)."""
EXIT_INTERNAL = 1
"""An internal error (a bug, a crash): the traceback is printed once, by the rank it happened on."""
EXIT_STOPPED = 128 + 15
"""Stopped by SIGTERM (after saving a checkpoint where one could be written in time)."""
TRACEBACK_ENV = "PLAIT_TRAIN_TRACEBACK"
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

    def __init__(self, message: str, *, exit_code: int = EXIT_USER) -> None:
        super().__init__(message)
        self.exit_code = exit_code


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


def print_error(message: str) -> None:
    """Print ``plait-train: error: <message>`` as one line on stderr."""
    stderr_line(f"plait-train: error: {one_line(message)}")


def report(err: BaseException) -> int:
    """Print the one line of a user error (or a stop) and return the process exit code.

    With ``PLAIT_TRAIN_TRACEBACK=1`` the traceback (and its causes) is printed first.
    """
    if os.environ.get(TRACEBACK_ENV) == "1":
        traceback.print_exception(err, file=sys.stderr)
    if isinstance(err, Stopped):
        stderr_line(f"plait-train: {one_line(str(err))}")
        return EXIT_STOPPED
    print_error(user_message(err) or str(err))
    return getattr(err, "exit_code", EXIT_USER)


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
    """Refuse a run directory whose name cannot exist, on every rank, before anything is written.

    Raises:
        UserError: a path component longer than the filesystem's 255-byte limit.
    """
    for part in Path(run_dir).parts:
        size = len(os.fsencode(part))
        if size > _NAME_MAX:
            raise UserError(
                f"run directory {str(run_dir)[:60]!r}... has a {size}-byte component (the limit is {_NAME_MAX}); "
                "use a shorter name / out_dir"
            )
