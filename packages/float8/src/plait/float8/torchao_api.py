"""The one place torchao is imported from, with the install hint for a missing torchao."""

from __future__ import annotations

import importlib
from types import ModuleType

__all__ = ["INSTALL_HINT", "require_torchao"]

INSTALL_HINT = "pip install 'plait-float8[torchao]' (in this workspace: uv sync, whose dev group has it)"


def require_torchao(submodule: str = "") -> ModuleType:
    """Import ``torchao.float8`` (or one of its submodules) or raise an ImportError saying what to install."""
    name = f"torchao.float8.{submodule}" if submodule else "torchao.float8"
    try:
        return importlib.import_module(name)
    except ImportError as err:
        raise ImportError(
            f"FSDP2Config.float8 needs torchao, which is not importable ({err}); install it: {INSTALL_HINT}"
        ) from err
