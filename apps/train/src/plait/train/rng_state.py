"""Per-rank RNG state in checkpoints, stored as safetensors (no pickle)."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

__all__ = ["load_rng", "rng_file_name", "save_rng"]


def rng_file_name(rank: int) -> str:
    """The checkpoint-relative file of one rank's RNG state."""
    return f"rng/rank_{rank:05d}.safetensors"


def save_rng(path: Path) -> None:
    """Write this process's CPU (and initialised CUDA) RNG state as safetensors."""
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    save_file(state, str(path))


def load_rng(path: Path) -> None:
    """Restore the RNG state written by :func:`save_rng`."""
    state = load_file(str(path))
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
