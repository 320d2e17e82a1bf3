"""Read DCP checkpoints without running code: only DCP's own metadata types are ever unpickled.

``torch.distributed.checkpoint`` stores its ``.metadata`` as a pickle and, in its default planner,
non-tensor entries (the optimizer's ``param_groups``) as ``torch.load(weights_only=False)`` blobs;
either can name any callable, and a crafted file then runs it on load. Every checkpoint plait
reads goes through :class:`SafeReader` and :class:`SafeLoadPlanner`: the metadata's unpickler
resolves only the names in :data:`_ALLOWED` (looked up in modules already imported, so a refused
name is never imported, let alone called), and byte entries load with torch's ``weights_only``
unpickler (plain containers, numbers, strings, tensors).
"""

from __future__ import annotations

import io
import pathlib
import pickle
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint.filesystem as dcp_filesystem
import torch.distributed.checkpoint.metadata as dcp_metadata
import torch.serialization
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import ReadItem

from plait.train.errors import UserError

__all__ = ["METADATA_FILE", "SafeLoadPlanner", "SafeReader", "UnsafeCheckpointError", "read_metadata"]

METADATA_FILE = ".metadata"
_MODULES: dict[str, Any] = {
    "torch.distributed.checkpoint.metadata": dcp_metadata,
    "torch.distributed.checkpoint.filesystem": dcp_filesystem,
    "torch.serialization": torch.serialization,
    "torch": torch,
    "pathlib": pathlib,
    "pathlib._local": pathlib,  # Python >= 3.13 pickles paths under their implementation module
}
_ALLOWED: dict[str, frozenset[str]] = {
    "torch.distributed.checkpoint.metadata": frozenset(
        {
            "Metadata",
            "StorageMeta",
            "MetadataIndex",
            "TensorStorageMetadata",
            "BytesStorageMetadata",
            "ChunkStorageMetadata",
            "TensorProperties",
            "_MEM_FORMAT_ENCODING",
        }
    ),
    "torch.distributed.checkpoint.filesystem": frozenset({"_StorageInfo"}),
    "torch.serialization": frozenset({"_get_layout"}),
    "torch": frozenset({"Size"}),  # and every torch dtype, checked by type in _resolve
    "pathlib": frozenset({"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"}),
    "pathlib._local": frozenset({"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"}),
}


class UnsafeCheckpointError(UserError):
    """A checkpoint file names something other than DCP's metadata types; it is not loaded."""


def _resolve(module: str, name: str) -> Any:
    """The allowed object ``module.name``, or None (without importing anything)."""
    owner = _MODULES.get(module)
    if owner is None:
        return None
    if name in _ALLOWED[module]:
        return getattr(owner, name)
    found = getattr(owner, name, None) if module == "torch" and name.isidentifier() else None
    return found if isinstance(found, torch.dtype) else None


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's ``Metadata`` and refuses every other global by name before resolving it."""

    def __init__(self, file: io.BufferedIOBase, source: Path) -> None:
        super().__init__(file)
        self._source = source

    def find_class(self, module: str, name: str) -> Any:
        found = _resolve(module, name)
        if found is None:
            raise UnsafeCheckpointError(
                f"checkpoint file {str(self._source)!r} names {module}.{name}, which DCP's metadata "
                "never holds; it was not loaded (nothing it names was imported or run); the file may "
                "have been crafted: resume only checkpoints you trust, or set checkpoint.resume: false"
            )
        return found


def read_metadata(path: str | Path) -> Metadata:
    """DCP's ``Metadata`` of the checkpoint directory ``path``, read with the restricted unpickler.

    Raises:
        UnsafeCheckpointError: the file names a global outside DCP's metadata types.
        UserError: the file is not a pickle of DCP ``Metadata``.
    """
    source = Path(path) / METADATA_FILE
    with open(source, "rb") as f:
        try:
            found = _MetadataUnpickler(f, source).load()
        except UnsafeCheckpointError:
            raise
        except Exception as err:  # a truncated or garbled pickle raises any of several types
            raise UserError(f"checkpoint file {str(source)!r} is not DCP metadata ({err})") from err
    if not isinstance(found, Metadata):
        raise UserError(f"checkpoint file {str(source)!r} holds a {type(found).__name__}, not DCP metadata")
    return found


class SafeReader(FileSystemReader):
    """``FileSystemReader`` whose ``.metadata`` is read by :func:`read_metadata` (no arbitrary pickle)."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        metadata = read_metadata(self.path)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """``DefaultLoadPlanner`` whose byte entries load with torch's ``weights_only`` unpickler."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        try:
            loaded = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as err:
            raise UnsafeCheckpointError(
                f"checkpoint entry {read_item.dest_index.fqn!r} holds an object outside plain data "
                f"({str(err).splitlines()[0]}); it was not loaded: resume only checkpoints you trust"
            ) from err
        # DefaultLoadPlanner.load_bytes with the same placement and a restricted load.
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded
