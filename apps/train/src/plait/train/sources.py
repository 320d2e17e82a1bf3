"""Where the documents come from, read lazily: the stdlib sources, local files, a ``datasets`` dataset.

``data.source: stdlib`` is this Python's standard-library sources (``sysconfig.get_paths()["stdlib"]``,
``*.py``, sorted, without ``site-packages``), so it exists on every machine. ``files`` reads local
files in the order of ``data.paths`` (each glob sorted): ``.jsonl`` / ``.json`` as JSON Lines, one
line at a time (a ``.json`` array of records also works, read whole), and ``.parquet`` one record
batch at a time by the ``data.text_key`` field; anything else as one text document.
``hf_datasets`` is :mod:`plait.train.hf_datasets`.

:func:`open_documents` yields each document with how much of the source has been read after it
(bytes of the files, or rows of a dataset), so memory holds one document (one record batch) at a
time and the tokenizer can report progress.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os
import sysconfig
from collections.abc import Iterator
from pathlib import Path

from plait.train.config import DataConfig
from plait.train.hf_datasets import check_installed, hf_documents, resolve_source

__all__ = ["DocumentStream", "Extent", "check_paths", "open_documents", "stdlib_files"]


@dataclasses.dataclass
class Extent:
    """How much of the corpus was read: all of it, or what ``data.max_bytes`` let through."""

    files: int
    """Files of the corpus."""
    file_bytes: int
    """Their size on disk, all of them."""
    files_read: int = 0
    """Files read from (the last one only in part when the cap cut it)."""
    cut_at: int | None = None
    """``data.max_bytes`` when it stopped the reading before the end of the corpus, else None."""
    rows_read: int | None = None
    """Rows of an ``hf_datasets`` dataset read when the cap cut it (None for files)."""


@dataclasses.dataclass
class DocumentStream:
    """The documents of a corpus, each with how much of it has been read after it."""

    documents: Iterator[tuple[bytes, int]]
    """``(document, read)``: ``read`` counts bytes of the files, or rows with ``unit == "rows"``."""
    total: int | None
    """What ``read`` reaches at the end (None: a streamed dataset of unknown length)."""
    unit: str
    """``bytes`` or ``rows``."""
    extent: Extent
    """Filled in as the documents are read (``files_read``, and ``cut_at`` by the cap)."""


def stdlib_files() -> list[Path]:
    """This interpreter's standard-library ``*.py`` files, sorted by relative path (no site-packages)."""
    root = sysconfig.get_paths()["stdlib"]
    skip = {"site-packages", "dist-packages", "__pycache__"}
    found: list[tuple[str, str]] = []
    for directory, subdirs, names in os.walk(root):
        subdirs[:] = [d for d in subdirs if d not in skip]  # pruned, not walked (site-packages is large)
        prefix = "" if directory == root else Path(directory).relative_to(root).as_posix() + "/"
        found.extend((prefix + n, os.path.join(directory, n)) for n in names if n.endswith(".py"))
    return [Path(path) for _, path in sorted(found)]


def check_paths(cfg: DataConfig) -> list[Path]:
    """The files of ``data.paths`` in reading order (empty for the stdlib corpus).

    Raises:
        ValueError: an entry (file or glob pattern) that matches no file, named; with
            ``hf_datasets``, ``datasets`` not installed (naming the extra) or paths it cannot load.
    """
    if cfg.source == "hf_datasets":
        check_installed()
        return resolve_source(cfg).files
    files: list[Path] = []
    for pattern in cfg.paths if cfg.source == "files" else []:
        matches = sorted(glob.glob(pattern, recursive=True)) if glob.has_magic(pattern) else [pattern]
        found = [Path(m) for m in matches if Path(m).is_file()]
        if not found:
            raise ValueError(f"data.paths entry {pattern!r} matches no file (relative to {Path.cwd()})")
        files.extend(found)
    return files


def open_documents(cfg: DataConfig, cache_dir: Path | None = None) -> DocumentStream:
    """The corpus's documents in their fixed order, read lazily, cut by ``data.max_bytes``.

    ``cache_dir`` holds the Arrow copy a non-streaming ``hf_datasets`` load writes.
    """
    files = stdlib_files() if cfg.source == "stdlib" else check_paths(cfg)
    extent = Extent(files=len(files), file_bytes=sum(f.stat().st_size for f in files))
    if cfg.source == "hf_datasets":
        documents, rows = hf_documents(cfg, cache_dir)
        extent.files_read = len(files)
        stream = DocumentStream(documents, rows, "rows", extent)
    else:
        stream = DocumentStream(
            _files_documents(files, cfg.text_key, extent), extent.file_bytes, "bytes", extent
        )
    stream.documents = _capped(stream.documents, stream, cfg.max_bytes)
    return stream


def _capped(
    documents: Iterator[tuple[bytes, int]], stream: DocumentStream, max_bytes: int | None
) -> Iterator[tuple[bytes, int]]:
    total = 0
    for doc, read in documents:
        if max_bytes is not None and total + len(doc) > max_bytes:
            stream.extent.cut_at = max_bytes
            stream.extent.rows_read = read if stream.unit == "rows" else None
            if doc[: max_bytes - total]:
                yield doc[: max_bytes - total], read
            return
        total += len(doc)
        if doc:
            yield doc, read


def _files_documents(files: list[Path], text_key: str, extent: Extent) -> Iterator[tuple[bytes, int]]:
    base = 0
    for path in files:
        extent.files_read += 1
        for doc, read in _documents_of(path, text_key):
            yield doc, base + read
        base += path.stat().st_size


def _documents_of(path: Path, text_key: str) -> Iterator[tuple[bytes, int]]:
    if path.suffix in (".jsonl", ".json"):
        yield from _json_documents(path, text_key)
    elif path.suffix == ".parquet":
        yield from _parquet_documents(path, text_key)
    else:
        data = path.read_bytes()
        yield data, len(data)


def _record_text(record: object, where: str, text_key: str) -> bytes:
    if not isinstance(record, dict) or not isinstance(record.get(text_key), str):
        raise ValueError(f"{where}: expected a JSON object with a string {text_key!r} (data.text_key)")
    return record[text_key].encode("utf-8")


def _utf8(raw: bytes, path: Path, offset: int) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(
            f"{path}: not UTF-8 text (byte 0x{raw[err.start : err.start + 1].hex()} at offset "
            f"{offset + err.start}); save it as UTF-8 or drop it from data.paths"
        ) from None


def _json_documents(path: Path, text_key: str) -> Iterator[tuple[bytes, int]]:
    with path.open("rb") as f:
        if path.suffix == ".json" and f.read(4096).lstrip().startswith(b"["):  # an array: read whole
            data = path.read_bytes()
            for i, record in enumerate(json.loads(_utf8(data, path, 0))):
                yield _record_text(record, f"{path}[{i}]", text_key), len(data)
            return
        f.seek(0)
        offset = 0
        for lineno, raw in enumerate(f, 1):  # binary lines end at \n only (not at U+2028)
            line = _utf8(raw, path, offset)
            offset += len(raw)
            if line.strip():
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as err:
                    raise ValueError(f"{path}:{lineno}: not a JSON Lines record ({err.msg})") from None
                yield _record_text(record, f"{path}:{lineno}", text_key), offset


def _parquet_documents(path: Path, text_key: str) -> Iterator[tuple[bytes, int]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ValueError(f"{path}: reading Parquet needs `pyarrow` (pip install pyarrow)") from None
    table = pq.ParquetFile(path)
    if text_key not in table.schema_arrow.names:
        raise ValueError(
            f"{path}: no column {text_key!r} (data.text_key); columns: {table.schema_arrow.names}"
        )
    size, rows, done = path.stat().st_size, max(1, table.metadata.num_rows), 0
    for batch in table.iter_batches(columns=[text_key]):
        for value in batch.column(0).to_pylist():
            done += 1
            if isinstance(value, str):
                yield value.encode("utf-8"), size * done // rows
