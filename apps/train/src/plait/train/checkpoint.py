"""Sharded checkpoints (torch.distributed.checkpoint) that are either complete or ignored.

Layout: ``<run>/checkpoints/step_00000042/`` holding the DCP shards of model and optimizer,
``rng_rank<r>.pt`` per rank and ``meta.json`` (step, data position, scheduler, world size).
Every rank writes into ``.tmp-step_…``; after a barrier rank 0 writes ``meta.json`` last and
renames the directory. So a crash mid-save leaves only a ``.tmp-`` directory (or, at worst, a
``step_`` directory without a readable ``meta.json``), and :func:`latest_checkpoint` skips both.
The checkpoint directory must be on a filesystem all ranks share.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

__all__ = [
    "META_FILE",
    "complete_checkpoints",
    "export_safetensors",
    "latest_checkpoint",
    "load_checkpoint",
    "save_checkpoint",
    "step_dir_name",
]

META_FILE = "meta.json"
_STEP_RE = re.compile(r"^step_(\d{8})$")


def step_dir_name(step: int) -> str:
    """``step_00000042``."""
    return f"step_{step:08d}"


def _read_meta(path: Path) -> dict[str, Any] | None:
    try:
        meta = json.loads((path / META_FILE).read_text())
    except (OSError, ValueError):
        return None
    return meta if isinstance(meta, dict) and meta.get("complete") is True else None


def complete_checkpoints(root: str | Path) -> list[tuple[int, Path]]:
    """``(step, path)`` of every complete checkpoint under ``root``, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        match = _STEP_RE.match(child.name)
        if match and child.is_dir() and _read_meta(child) is not None:
            found.append((int(match.group(1)), child))
    return sorted(found)


def latest_checkpoint(root: str | Path) -> Path | None:
    """The newest complete checkpoint under ``root`` (half-written ones are ignored), or None."""
    found = complete_checkpoints(root)
    return found[-1][1] if found else None


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _rng_state() -> dict[str, torch.Tensor]:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _states(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    return {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer)}


def save_checkpoint(
    root: str | Path,
    step: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    extra: dict[str, Any],
    *,
    keep: int,
) -> Path:
    """Save a complete checkpoint of ``step`` (all ranks call this); keep the newest ``keep``.

    ``extra`` (JSON data: data position, scheduler state, ...) goes into ``meta.json``.
    """
    root = Path(root)
    final = root / step_dir_name(step)
    tmp = root / f".tmp-{step_dir_name(step)}"
    if _rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    _barrier()
    dcp.save(_states(model, optimizer), checkpoint_id=str(tmp))
    torch.save(_rng_state(), tmp / f"rng_rank{_rank()}.pt")
    _barrier()
    if _rank() == 0:
        world = dist.get_world_size() if dist.is_initialized() else 1
        meta = {"complete": True, "step": step, "world_size": world, **extra}
        with open(tmp / META_FILE, "w") as f:
            json.dump(meta, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        for _, old in complete_checkpoints(root)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    _barrier()
    return final


def load_checkpoint(path: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Restore model, optimizer and this rank's RNG from ``path``; return its ``meta.json`` data.

    Raises:
        ValueError: ``path`` is not a complete checkpoint, or was written by another world size.
    """
    path = Path(path)
    meta = _read_meta(path)
    if meta is None:
        raise ValueError(
            f"{str(path)!r} is not a complete checkpoint (no valid {META_FILE}); pick a step_ directory"
        )
    world = dist.get_world_size() if dist.is_initialized() else 1
    rng_file = path / f"rng_rank{_rank()}.pt"
    if meta.get("world_size") != world or not rng_file.is_file():
        raise ValueError(
            f"checkpoint {str(path)!r} was written by {meta.get('world_size')} ranks, this job has {world}; "
            f"resume with the same world size"
        )
    states = _states(model, optimizer)
    dcp.load(states, checkpoint_id=str(path))
    set_model_state_dict(model, states["model"])
    set_optimizer_state_dict(model, optimizer, states["optim"])
    rng = torch.load(rng_file, weights_only=True)
    torch.set_rng_state(rng["cpu"])
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state(rng["cuda"])
    return meta


def export_safetensors(model: nn.Module, path: str | Path) -> Path | None:
    """Gather the full weights and write one ``model.safetensors`` (rank 0 writes; all ranks call)."""
    from safetensors.torch import save_file

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    state = get_model_state_dict(model, options=options)
    path = Path(path)
    if _rank() == 0:
        tensors = {k: v.detach().to("cpu").clone().contiguous() for k, v in state.items()}
        tmp = path.with_name(f".tmp-{path.name}")
        save_file(tensors, str(tmp), metadata={"format": "pt"})
        os.replace(tmp, path)
    _barrier()
    return path if _rank() == 0 else None
