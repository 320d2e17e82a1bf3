"""Assemble full-tensor safetensors files from DCP's per-rank shard files, one tensor in memory at a time.

``HuggingFaceStorageWriter(save_distributed=True)`` leaves one ``shard-<r>-model-<i>-of-<n>``
file per rank and chunk, each tensor piece tagged with its offset in the full tensor
(``DCP_SHARDING_INFO`` in the file's metadata). :func:`assemble` writes the output files
assigned to this rank: for each tensor it allocates the full tensor, reads every piece straight
into its slice (plain file reads at the header's offsets, no mmap), writes it and drops it, so
a rank holds one full tensor plus one piece beyond what it already has. The safetensors format
is an 8-byte little-endian header length, a JSON header, then the raw tensor bytes.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

__all__ = ["INDEX_FILE", "Piece", "assemble", "output_name", "read_header", "write_index"]

INDEX_FILE = "model.safetensors.index.json"
_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
_SHARDING_KEY = "DCP_SHARDING_INFO"


@dataclass(frozen=True)
class Piece:
    """One shard of a tensor inside a shard file."""

    file: Path
    offsets: tuple[int, ...]
    shape: tuple[int, ...]
    begin: int
    """Absolute byte offset of the piece's data in ``file``."""


def output_name(index: int, count: int) -> str:
    """``model-00001-of-00003.safetensors``, the Hugging Face file naming."""
    return f"model-{index:05d}-of-{count:05d}.safetensors"


def read_header(path: Path) -> tuple[dict[str, Any], int]:
    """The JSON header of a safetensors file and the byte offset where its data starts."""
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(length)), 8 + length


def _pieces(sharded: Path) -> dict[str, list[Piece]]:
    found: dict[str, list[Piece]] = {}
    for path in sorted(sharded.glob("*.safetensors")):
        header, start = read_header(path)
        info = json.loads(header.get("__metadata__", {}).get(_SHARDING_KEY, "{}"))
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            shape = tuple(entry["shape"])
            offsets = tuple(info.get(name, {}).get("saved_offsets", [0] * len(shape)))
            found.setdefault(name, []).append(Piece(path, offsets, shape, start + entry["data_offsets"][0]))
    return found


def _read_into(piece: Piece, target: torch.Tensor) -> None:
    buffer = torch.empty(piece.shape, dtype=target.dtype)
    view = memoryview(buffer.reshape(-1).view(torch.uint8).numpy()).cast("B")
    with open(piece.file, "rb") as f:
        f.seek(piece.begin)
        got = f.readinto(view)
    if got != len(view):
        raise OSError(f"{piece.file}: short read of a tensor piece ({got} of {len(view)} bytes)")
    region = tuple(slice(o, o + n) for o, n in zip(piece.offsets, piece.shape, strict=True))
    target[region].copy_(buffer)


def _write_file(
    path: Path,
    names: list[str],
    specs: dict[str, tuple[list[int], torch.dtype]],
    pieces: dict[str, list[Piece]],
) -> None:
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name in names:
        shape, dtype = specs[name]
        size = math.prod(shape) * dtype.itemsize
        header[name] = {"dtype": _DTYPES[dtype], "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # data aligned to 8 bytes, as the safetensors writer does
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for name in names:
            shape, dtype = specs[name]
            full = torch.empty(shape, dtype=dtype)
            covered = sum(math.prod(p.shape) for p in pieces[name])
            if covered != full.numel():
                raise OSError(f"the shard files cover {covered} of the {full.numel()} elements of {name}")
            for piece in pieces[name]:
                _read_into(piece, full)
            f.write(memoryview(full.reshape(-1).view(torch.uint8).numpy()).cast("B"))
            del full


def assemble(
    sharded: Path,
    out_dir: Path,
    specs: dict[str, tuple[list[int], torch.dtype]],
    mapping: dict[str, int],
    rank: int,
    world: int,
) -> None:
    """Write the output files ``i`` with ``i % world == rank`` (``mapping``: name -> file index).

    Args:
        specs: name -> (global shape, dtype) of every tensor.
    """
    pieces = _pieces(sharded)
    missing = sorted(set(specs) - set(pieces))
    if missing:
        raise OSError(f"{sharded}: no shard file holds {missing[:3]}")
    count = max(mapping.values())
    for index in range(1, count + 1):
        if index % world == rank % world:
            names = [n for n, i in mapping.items() if i == index]
            _write_file(out_dir / output_name(index, count), names, specs, pieces)


def write_index(
    out_dir: Path, specs: dict[str, tuple[list[int], torch.dtype]], mapping: dict[str, int]
) -> None:
    """``model.safetensors.index.json``: total size and tensor name -> file."""
    count = max(mapping.values())
    total = sum(math.prod(shape) * dtype.itemsize for shape, dtype in specs.values())
    body = {
        "metadata": {"total_size": total},
        "weight_map": {n: output_name(i, count) for n, i in mapping.items()},
    }
    (out_dir / INDEX_FILE).write_text(json.dumps(body, indent=2))
