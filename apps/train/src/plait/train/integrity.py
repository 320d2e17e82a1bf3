"""Checkpoint integrity: a manifest of every file's size and SHA-256, written last and checked first.

A checkpoint directory counts only when its ``manifest.json`` parses, and each file it lists has
the recorded size and digest. Nothing in the directory is opened by a loader (DCP's ``.metadata``
is a pickle) before that check passes. The manifest is written to a temporary name, fsynced and
renamed, so it is either whole or absent.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from pathlib import Path
from typing import Any

from plait.train.errors import UserError

__all__ = [
    "MANIFEST_FILE",
    "MANIFEST_FORMAT",
    "NonFiniteError",
    "check_finite",
    "file_digest",
    "first_problem",
    "fsync_dir",
    "read_manifest",
    "write_manifest",
]

MANIFEST_FILE = "manifest.json"
MANIFEST_FORMAT = "plait-checkpoint/1"
_CHUNK = 1 << 22


class NonFiniteError(UserError):
    """The loss or the gradient norm is NaN or infinite: the run stops before it can save."""


def check_finite(step: int, loss: float, grad_norm: float) -> None:
    """Raise :class:`NonFiniteError` when ``loss`` or ``grad_norm`` is not finite.

    Both values are global (reduced over every rank), so every rank raises at the same step.
    """
    if math.isfinite(loss) and math.isfinite(grad_norm):
        return
    raise NonFiniteError(
        f"step {step}: loss {loss} / grad_norm {grad_norm} is not finite; stopped before the optimizer step, "
        f"no checkpoint was written or rotated (lower optim.lr, raise optim.warmup_steps or set optim.grad_clip)"
    )


def file_digest(path: Path) -> dict[str, Any]:
    """``{"size": bytes, "sha256": hex}`` of one file."""
    digest = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
            size += len(chunk)
    return {"size": size, "sha256": digest.hexdigest()}


def fsync_dir(path: Path) -> None:
    """Make a rename or a new entry in ``path`` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_manifest(
    directory: Path, step: int, files: dict[str, dict[str, Any]], meta: dict[str, Any]
) -> None:
    """Write ``manifest.json`` atomically: the step, every file's size and digest, and ``meta``."""
    body = {"format": MANIFEST_FORMAT, "step": step, "files": dict(sorted(files.items())), "meta": meta}
    tmp = directory / f".{MANIFEST_FILE}.tmp"
    with open(tmp, "w") as f:
        json.dump(body, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, directory / MANIFEST_FILE)
    fsync_dir(directory)


def read_manifest(directory: Path) -> dict[str, Any] | None:
    """The parsed manifest of ``directory``, or None if it is missing, torn or not ours."""
    try:
        body = json.loads((directory / MANIFEST_FILE).read_text())
    except (OSError, ValueError):
        return None
    ok = (
        isinstance(body, dict)
        and body.get("format") == MANIFEST_FORMAT
        and isinstance(body.get("step"), int)
        and isinstance(body.get("files"), dict)
        and isinstance(body.get("meta"), dict)
    )
    return body if ok else None


def first_problem(directory: Path, files: dict[str, dict[str, Any]], names: list[str]) -> str | None:
    """The first of ``names`` whose size or digest differs from ``files`` (the manifest), or None.

    The size is compared before hashing, so a truncated file is found without reading it.
    """
    for name in names:
        path = directory / name
        want = files[name]
        try:
            size = path.stat().st_size
        except OSError:
            return f"{path} is missing"
        if size != want.get("size"):
            return f"{path} has {size} bytes, the manifest says {want.get('size')}"
        if file_digest(path)["sha256"] != want.get("sha256"):
            return f"{path} does not match its SHA-256 in the manifest (changed after the save)"
    return None
