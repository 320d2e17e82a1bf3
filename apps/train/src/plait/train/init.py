"""Pretrained weights as a source for plait.mesh's mesh-independent :func:`~plait.mesh.materialize`.

The initialisation itself (per-parameter seeds from the clean FQN, each rank copying its shard of
the full value) lives in the library, ``plait.mesh.materialize``; the app adds only the reader of
``model.pretrained_path``.
"""

from __future__ import annotations

import difflib
from pathlib import Path

import torch

from plait.mesh import clean_fqn, init_value, materialize, param_seed

__all__ = ["SafetensorsSource", "clean_fqn", "init_value", "materialize", "param_seed"]


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
