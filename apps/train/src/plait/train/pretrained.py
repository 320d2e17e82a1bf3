"""Load pretrained weights in the Hugging Face layout, each rank reading only the slices it holds.

``model.pretrained_path`` is a directory of ``*.safetensors`` files (a Hugging Face model
directory, or a plait export). After ``parallelize_model`` the model's DCP state dict holds each
rank's shards; ``torch.distributed.checkpoint`` loads it through ``HuggingFaceStorageReader``,
which reads just those slices from the files. Names and shapes are compared first, from the
safetensors headers (JSON, no pickle), and a difference is a ``ValueError`` naming it.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from safetensors import safe_open
from torch import nn
from torch.distributed.checkpoint import HuggingFaceStorageReader
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)
from torch.distributed.tensor import DTensor

__all__ = ["check_pretrained", "load_pretrained", "loading_text", "pretrained_shapes"]

_SHOWN = 3


def pretrained_shapes(path: str | Path) -> dict[str, list[int]]:
    """Tensor name -> shape of every ``*.safetensors`` file in ``path`` (headers only).

    Raises:
        ValueError: ``path`` is not a directory holding ``*.safetensors`` files.
    """
    root = Path(path)
    files = sorted(root.glob("*.safetensors")) if root.is_dir() else []
    if not files:
        raise ValueError(
            f"model.pretrained_path {str(path)!r} is not a directory with *.safetensors files "
            f"(a Hugging Face model directory or a plait export)"
        )
    shapes: dict[str, list[int]] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                shapes[key] = list(f.get_slice(key).get_shape())
    return shapes


def loading_text(path: str | Path) -> str:
    """The progress text of loading ``path``: how many ``*.safetensors`` files, how many bytes."""
    files = sorted(Path(path).glob("*.safetensors"))
    size = sum(f.stat().st_size for f in files)
    return (
        f"loading pretrained weights from {path}: {len(files)} file{'s' if len(files) != 1 else ''}, "
        f"{size / 2**20:,.1f} MiB"
    )


def _storage(tensor: torch.Tensor) -> int:
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return local.untyped_storage().data_ptr()


def _wanted(
    state: dict[str, Any],
    shapes: dict[str, list[int]],
    path: str | Path,
    same: Callable[[Any], int] = _storage,
) -> dict[str, Any]:
    """The entries to read; a tied weight missing from the files is filled through its twin (``same`` key)."""
    present = {same(v) for k, v in state.items() if k in shapes}
    missing = [k for k, v in state.items() if k not in shapes and same(v) not in present]
    reshaped = [k for k, v in state.items() if k in shapes and list(v.shape) != shapes[k]]
    if missing or reshaped:
        parts = []
        if missing:
            more = f" (+{len(missing) - _SHOWN} more)" if len(missing) > _SHOWN else ""
            parts.append(f"missing: {', '.join(missing[:_SHOWN])}{more}")
        if reshaped:
            shown = [
                f"{k} {tuple(shapes[k])} in the files vs {tuple(state[k].shape)} in the model"
                for k in reshaped
            ]
            parts.append(f"shape differs: {', '.join(shown[:_SHOWN])}")
        raise ValueError(f"model.pretrained_path {str(path)!r} does not fit the model: {'; '.join(parts)}")
    return {k: v for k, v in state.items() if k in shapes}


def check_pretrained(model: nn.Module, path: str | Path) -> None:
    """Compare an unwrapped (e.g. meta) model's names and shapes with ``path``'s headers, reading no tensor.

    The check :func:`load_pretrained` makes after parallelization, made up front (recipe checks,
    ``validate``, ``plan``): tied parameters are recognised as the same object.

    Raises:
        ValueError: as :func:`load_pretrained`.
    """
    _wanted(model.state_dict(keep_vars=True), pretrained_shapes(path), path, same=id)


def load_pretrained(model: nn.Module, path: str | Path) -> None:
    """Fill ``model``'s parameters and persistent buffers from ``path`` (all ranks call this).

    Raises:
        ValueError: ``path`` has no safetensors files, lacks a tensor the model needs, or holds
            one of another shape (the first differences named).
    """
    state = get_model_state_dict(model)
    wanted = _wanted(state, pretrained_shapes(path), path)
    dcp.load(wanted, storage_reader=HuggingFaceStorageReader(str(path)))
    set_model_state_dict(model, wanted, options=StateDictOptions(strict=False))  # tied twins stay out
