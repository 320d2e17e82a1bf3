"""Sharded checkpoints (torch.distributed.checkpoint) that resume at any mesh, complete or skipped.

Layout: ``<run>/checkpoints/step_00000042/`` holds DCP's shards (``__<rank>_<n>.distcp``) and
``.metadata`` for the model and optimizer, ``rng/rank_<r>.safetensors`` per rank, and
``manifest.json`` (see :mod:`plait.train.integrity`): every file's size and SHA-256, the step,
data position, scheduler, mesh layout and the :mod:`plait.train.compat` fingerprint.

Save: every rank writes into ``.tmp-step_…``; each rank hashes the files it wrote; rank 0 writes
the manifest last and renames the directory, then rotates to the newest ``keep``. Any failure
(disk full, an I/O error on one rank) is agreed on by all ranks, the partial directory is
removed and a one-line :class:`CheckpointError` is raised; the previous checkpoints stay.

Resume: the newest directory whose files all match their manifest (verified by all ranks in
parallel, before DCP reads its pickled ``.metadata``); a bad one is skipped with one warning line
naming the file. DCP's pickles are read by :mod:`plait.train.safe_reader`, which refuses anything
but DCP's own metadata types and plain data. DCP reshards on load, so the mesh and world size may differ from the save.
The checkpoint directory must be on a filesystem all ranks share.
"""

from __future__ import annotations

import re
import shutil
import sys
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from plait.train.compat import fingerprint, mismatch
from plait.train.config import Recipe, to_dict
from plait.train.errors import UserError
from plait.train.integrity import (
    MANIFEST_FILE,
    file_digest,
    first_problem,
    fsync_dir,
    read_manifest,
    write_manifest,
)
from plait.train.rng_state import load_rng, rng_file_name, save_rng
from plait.train.safe_reader import SafeLoadPlanner, SafeReader, read_metadata

__all__ = [
    "CheckpointError",
    "Checkpointer",
    "complete_checkpoints",
    "latest_checkpoint",
    "step_dir_name",
    "verify_checkpoint",
]

_STEP_RE = re.compile(r"^step_(\d{8})$")
_OWNER_RE = re.compile(r"(?:^__|rank_)(\d+)")
_TMP_PREFIX = ".tmp-"
_FULL_BYTES = 1 << 20
"""Free space below which a failed save is reported as a full disk."""


class CheckpointError(UserError):
    """A checkpoint that cannot be written or resumed; the message is one line naming why."""


def step_dir_name(step: int) -> str:
    """``step_00000042``."""
    return f"step_{step:08d}"


def _step_dirs(root: Path) -> list[tuple[int, Path]]:
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), c) for c in root.iterdir() if (m := _STEP_RE.match(c.name)) and c.is_dir()]
    return sorted(found)


def complete_checkpoints(root: str | Path) -> list[tuple[int, Path]]:
    """``(step, path)`` of every checkpoint with a valid manifest under ``root``, oldest first.

    Only the manifest is read; :func:`verify_checkpoint` checks the files against it.
    """
    return [(s, p) for s, p in _step_dirs(Path(root)) if read_manifest(p) is not None]


def latest_checkpoint(root: str | Path) -> Path | None:
    """The newest checkpoint with a valid manifest under ``root`` (half-written ones are ignored)."""
    found = complete_checkpoints(root)
    return found[-1][1] if found else None


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _gather(obj: Any) -> list[Any]:
    if _world() == 1:
        return [obj]
    out: list[Any] = [None] * _world()
    dist.all_gather_object(out, obj)
    return out


def _reason(err: BaseException) -> str:
    """One line for an exception, digging the first rank's error out of DCP's CheckpointException."""
    failures = getattr(err, "failures", None)
    if isinstance(failures, dict) and failures:
        first = failures[min(failures)]
        err = first[0] if isinstance(first, tuple) else first
    cause: BaseException | None = err
    while cause is not None and not isinstance(cause, OSError):  # e.g. ENOSPC under a zip-writer error
        cause = cause.__cause__ or cause.__context__
    err = cause or err
    if isinstance(err, OSError) and err.strerror:
        text = f"{err.strerror} ({err.filename})" if err.filename else err.strerror
    else:
        text = f"{type(err).__name__}: {err}"
    return " ".join(text.split())[:300]


def _write_error(err: BaseException, directory: Path) -> str:
    """:func:`_reason` of a failed write, said as a full disk when the disk is (torch's zip writer hides ENOSPC)."""
    reason = _reason(err)
    try:
        free = shutil.disk_usage(directory).free
    except OSError:
        return reason
    if free < _FULL_BYTES and "No space left" not in reason:
        reason = f"No space left on device ({free} bytes free; the writer said: {reason})"
    return reason


def _owner(name: str, world: int) -> int:
    """The rank that hashes (at save) or verifies (at load) file ``name``."""
    match = _OWNER_RE.search(Path(name).name)
    return int(match.group(1)) % world if match else 0


def _files_of(directory: Path) -> list[str]:
    names = (p.relative_to(directory).as_posix() for p in directory.rglob("*") if p.is_file())
    return sorted(n for n in names if n != MANIFEST_FILE and not n.startswith(f".{MANIFEST_FILE}"))


_OPTIM_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)
"""Optimizer entries keyed by parameter FQN (``state.<fqn>.exp_avg``, ``param_groups.<fqn>.lr``).
Unflattened, ``param_groups.0`` of ranks holding different parameters (pipeline stages) collide in
the checkpoint and a rank loads another rank's groups."""


def _global_fingerprint(recipe: Recipe, model_state: dict[str, Any], optimizer: object) -> dict[str, Any]:
    """The fingerprint with every rank's model keys (pipeline stages hold different ones); a collective."""
    found = fingerprint(recipe, model_state, optimizer)
    if dist.is_initialized() and dist.get_world_size() > 1:
        parts: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(parts, found["model"])
        found["model"] = {k: v for part in parts for k, v in sorted(part.items())}
    return found


def _states(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    return {
        "model": get_model_state_dict(model),
        "optim": get_optimizer_state_dict(model, optimizer, options=_OPTIM_OPTIONS),
    }


def verify_checkpoint(path: str | Path) -> tuple[dict[str, Any] | None, str | None]:
    """Check every file of ``path`` against its manifest, the files split over the ranks (a collective).

    Returns:
        ``(manifest, None)`` when complete and intact, else ``(None, first problem naming the file)``.
    """
    path = Path(path)
    manifest = read_manifest(path)
    if manifest is None:
        problem = f"{path / MANIFEST_FILE} is missing or unreadable (the save did not finish)"
        return None, problem
    files = manifest["files"]
    mine = [n for n in sorted(files) if _owner(n, _world()) == _rank()]
    problems = [p for p in _gather(first_problem(path, files, mine)) if p is not None]
    return (None, problems[0]) if problems else (manifest, None)


@dataclass
class _Pending:
    """An async save whose shards are still being written."""

    step: int
    tmp: Path
    meta: dict[str, Any]
    future: Future[Any]


class Checkpointer:
    """Save and resume the run's checkpoints under ``root`` (every method is called on all ranks).

    Args:
        recipe: the job (``checkpoint.*`` settings, the resume fingerprint, the mesh layout).
        root: the checkpoint directory (``<run>/checkpoints``), on a filesystem all ranks share.
    """

    def __init__(self, recipe: Recipe, root: str | Path) -> None:
        self.recipe = recipe
        self.root = Path(root)
        self.keep = recipe.checkpoint.keep
        self.layout = {"world_size": _world(), **to_dict(recipe.parallel)}
        self._pending: _Pending | None = None
        self._group = None
        if recipe.checkpoint.async_save and dist.is_initialized():
            self._group = dist.new_group(
                backend="gloo"
            )  # DCP's background collectives stay off the training PG
        if _rank() == 0 and self.root.is_dir():  # the run lock is held: a .tmp- directory is a dead save
            for stale in self.root.glob(f"{_TMP_PREFIX}*"):
                shutil.rmtree(stale, ignore_errors=True)

    # -- save -----------------------------------------------------------------------------------

    def _fail_if_any(self, step: int, tmp: Path, errors: list[str | None]) -> None:
        first = next((e for e in errors if e), None)
        if first is None:
            return
        if _rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        previous = latest_checkpoint(self.root)
        kept = f"kept {previous.name}" if previous else "no earlier checkpoint to keep"
        raise CheckpointError(
            f"checkpoint of step {step} failed: {first}; removed the partial {tmp.name}, {kept}"
        )

    def save(
        self, step: int, model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]
    ) -> Path:
        """Save ``step`` (``state``: JSON data such as the data position and the scheduler).

        With ``checkpoint.async_save`` the shards are written in the background and the save is
        finished (hashed, manifest, rename, rotation) by the next :meth:`save` or :meth:`wait`.

        Raises:
            CheckpointError: on every rank, when any rank failed to write; the partial save is gone.
        """
        self.wait()
        tmp, final = self.root / f"{_TMP_PREFIX}{step_dir_name(step)}", self.root / step_dir_name(step)
        error = None
        if _rank() == 0:
            try:
                shutil.rmtree(tmp, ignore_errors=True)
                (tmp / "rng").mkdir(parents=True)
            except OSError as err:
                error = _reason(err)
        self._fail_if_any(step, tmp, _gather(error))
        states = _states(model, optimizer)
        meta = {
            **state,
            "layout": self.layout,
            "fingerprint": _global_fingerprint(self.recipe, states["model"], optimizer),
        }
        try:
            save_rng(tmp / rng_file_name(_rank()))
            if self._group is not None:
                future = dcp.async_save(states, checkpoint_id=str(tmp), process_group=self._group)
                self._pending = _Pending(step, tmp, meta, future)
                return final
            dcp.save(states, checkpoint_id=str(tmp))
        except (Exception, CheckpointException) as err:
            error = _write_error(err, self.root)
        self._fail_if_any(step, tmp, _gather(error))
        return self._finish(step, tmp, meta)

    def wait(self) -> Path | None:
        """Finish a pending async save (no-op without one); return its directory."""
        pending, self._pending = self._pending, None
        if pending is None:
            return None
        error = None
        try:
            pending.future.result()
        except (Exception, CheckpointException) as err:
            error = _write_error(err, self.root)
        self._fail_if_any(pending.step, pending.tmp, _gather(error))
        return self._finish(pending.step, pending.tmp, pending.meta)

    def _finish(self, step: int, tmp: Path, meta: dict[str, Any]) -> Path:
        error, digests = None, {}
        try:
            mine = [n for n in _files_of(tmp) if _owner(n, _world()) == _rank()]
            digests = {name: file_digest(tmp / name) for name in mine}
        except OSError as err:
            error = _reason(err)
        gathered = _gather((error, digests))
        self._fail_if_any(step, tmp, [e for e, _ in gathered])
        final = self.root / step_dir_name(step)
        if _rank() == 0:
            try:
                files = {name: d for _, part in gathered for name, d in part.items()}
                write_manifest(tmp, step, files, meta)
                shutil.rmtree(final, ignore_errors=True)
                tmp.rename(final)
                fsync_dir(self.root)
            except OSError as err:
                error = _reason(err)
        box = [error]
        if _world() > 1:
            dist.broadcast_object_list(box, src=0)
        self._fail_if_any(step, tmp, box)
        if _rank() == 0:
            for _, old in complete_checkpoints(self.root)[: -self.keep]:
                shutil.rmtree(old, ignore_errors=True)
        return final

    # -- resume ---------------------------------------------------------------------------------

    def _candidates(self) -> list[str]:
        box = [[str(p) for _, p in reversed(_step_dirs(self.root))] if _rank() == 0 else None]
        if _world() > 1:
            dist.broadcast_object_list(box, src=0)
        return box[0]

    def find(self) -> tuple[Path, dict[str, Any]] | None:
        """The checkpoint to resume and its manifest: ``checkpoint.resume_from``, else the newest intact one.

        Raises:
            CheckpointError: ``resume_from`` is not an intact checkpoint (naming the bad file).
        """
        cfg = self.recipe.checkpoint
        if cfg.resume_from:
            manifest, problem = verify_checkpoint(cfg.resume_from)
            if problem is not None:
                raise CheckpointError(f"checkpoint.resume_from {cfg.resume_from!r} cannot be used: {problem}")
            return Path(cfg.resume_from), manifest
        if not cfg.resume:
            return None
        for candidate in self._candidates():
            manifest, problem = verify_checkpoint(candidate)
            if problem is None:
                return Path(candidate), manifest
            if _rank() == 0:
                print(
                    f"plait-train: warning: skipping checkpoint {candidate}: {problem}",
                    file=sys.stderr,
                    flush=True,
                )
        return None

    def load(
        self, path: Path, manifest: dict[str, Any], model: nn.Module, optimizer: torch.optim.Optimizer
    ) -> dict[str, Any]:
        """Restore model, optimizer and RNG from a verified checkpoint; return its saved ``state``.

        Raises:
            CheckpointError: the checkpoint does not fit this job (naming the differences), or its
                step is already at or past ``train.steps``.
        """
        meta, step = manifest["meta"], manifest["step"]
        states = _states(model, optimizer)
        current = _global_fingerprint(self.recipe, states["model"], optimizer)
        problem = mismatch(meta.get("fingerprint", {}), current)
        if problem is not None:
            raise CheckpointError(
                f"checkpoint {str(path)!r} cannot resume this job: {problem}; use a new out_dir "
                f"(or set checkpoint.resume: false)"
            )
        steps = self.recipe.train.steps
        if step >= steps:
            raise CheckpointError(
                f"checkpoint {str(path)!r} is at step {step} and train.steps is {steps}: nothing left to train; "
                f"raise train.steps above {step} to continue, or start a separate run with --set name=<new name>"
            )
        # On every rank, before DCP's collectives: a crafted file is refused here in one line.
        read_metadata(path)
        dcp.load(states, storage_reader=SafeReader(path), planner=SafeLoadPlanner())
        set_model_state_dict(model, states["model"])
        set_optimizer_state_dict(model, optimizer, states["optim"], options=_OPTIM_OPTIONS)
        same_layout = meta.get("layout") == self.layout
        load_rng(path / rng_file_name(_rank() if same_layout else 0))
        return {k: v for k, v in meta.items() if k not in ("layout", "fingerprint")}
