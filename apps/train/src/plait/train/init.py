"""Pretrained weights as a source for plait.mesh's mesh-independent :func:`~plait.mesh.materialize`.

The initialisation itself (per-parameter seeds from the clean FQN, each rank copying its shard of
the full value) lives in the library, ``plait.mesh.materialize``; the app adds only the reader of
``model.pretrained_path`` and the one-line progress of materialising (rank 0 only).
"""

from __future__ import annotations

import contextlib
import difflib
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from plait.mesh import clean_fqn, init_value, materialize, param_seed

__all__ = [
    "SafetensorsSource",
    "clean_fqn",
    "init_value",
    "materialize",
    "materializing",
    "param_seed",
    "progress",
]


class SafetensorsSource:
    """Full tensors by clean FQN from every ``*.safetensors`` file of a directory (or one file)."""

    def __init__(self, path: str | Path) -> None:
        from safetensors import safe_open

        root = Path(path)
        files = [root] if root.is_file() else sorted(root.glob("*.safetensors"))
        if not files:
            raise ValueError(f"model.pretrained_path {str(path)!r} has no *.safetensors file")
        self._handles = [safe_open(str(f), framework="pt") for f in files]
        self._where = {key: h for h in self._handles for key in h.keys()}  # noqa: SIM118

    def __call__(self, fqn: str, shape: torch.Size) -> torch.Tensor:
        handle = self._where.get(fqn)
        if handle is None:
            near = difflib.get_close_matches(fqn, list(self._where), n=3)
            raise ValueError(f"pretrained weights have no tensor {fqn!r} (closest: {near})")
        tensor = handle.get_tensor(fqn)
        if tensor.shape != shape:
            raise ValueError(
                f"pretrained tensor {fqn!r} has shape {tuple(tensor.shape)}, the model wants {tuple(shape)}"
            )
        return tensor


@contextlib.contextmanager
def progress(what: str) -> Iterator[None]:
    """On rank 0, print ``what ...`` before the block and `` done in T s`` after it, on one line.

    A block that raises ends the line with `` failed`` (its error follows on the next line).
    """
    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    if rank0:
        sys.stdout.write(f"{what} ...")
        sys.stdout.flush()
    start = time.perf_counter()
    try:
        yield
    except BaseException:
        if rank0:
            print(" failed", flush=True)
        raise
    if rank0:
        print(f" done in {time.perf_counter() - start:.1f} s", flush=True)


def materializing(model: nn.Module, device: torch.device | str, seed: int) -> str:
    """The progress text of materialising ``model``: its full size, the device, the init rule's seed."""
    params = list(model.parameters())
    size = sum(p.numel() * p.dtype.itemsize for p in params)
    numel = sum(p.numel() for p in params)
    return f"materialising the model: {numel:,} parameters ({size / 2**20:,.1f} MiB) on {device}, seed {seed}"
