"""Corpus, tokenization, document packing, a resumable sampler over the ``dp`` mesh, validation.

The built-in corpus is this Python's standard-library sources (``sysconfig.get_paths()["stdlib"]``,
``*.py``, sorted, without ``site-packages``), so it exists on every machine. ``data.source: files``
reads local files in the order of ``data.paths`` (each glob sorted): ``.jsonl`` / ``.json`` as
JSON Lines (a ``.json`` array of records also works) and ``.parquet`` by the ``data.text_key``
field, anything else as one text document. Each document is tokenized (:mod:`plait.train.tokenizer`)
and followed by the tokenizer's EOS. Documents are split into train and validation by index
(every k-th document is held out; the last one when there are fewer than k), each side
concatenated (packed) and cut into ``seq_len + 1`` windows. The whole corpus is read unless
``data.max_bytes`` caps the bytes of text; a cut is named in :meth:`Corpus.describe` (the run's
summary) and in the errors about too little data, with how much of the corpus was read.

The sampler walks one global order (a seeded permutation per epoch); each optimizer micro-step
takes ``micro_batch_size * dp_size`` consecutive positions and data-parallel rank ``r`` keeps the
r-th slice. TP ranks share a dp rank, so they get the same batch; the global batch is the same
whatever the mesh; the position is the whole resumable state.
"""

from __future__ import annotations

import dataclasses
import glob
import hashlib
import json
import os
import sysconfig
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from plait.train.batches import PackedDataset
from plait.train.config import DataConfig
from plait.train.tokenizer import BYTE_EOS, ByteTokenizer, Tokenizer

__all__ = [
    "EOS",
    "TOKENIZER_VOCAB",
    "Corpus",
    "Extent",
    "check_corpus_ids",
    "check_paths",
    "corpus_fingerprint",
    "decode",
    "encode",
    "load_corpus",
    "read_documents",
    "stdlib_files",
]

EOS = BYTE_EOS
"""End-of-document token of the byte tokenizer."""
TOKENIZER_VOCAB = ByteTokenizer.vocab_size
"""Token ids of the byte tokenizer: 256 bytes + EOS."""


def stdlib_files() -> list[Path]:
    """This interpreter's standard-library ``*.py`` files, sorted by relative path (no site-packages)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "dist-packages", "__pycache__"}
    found = [p for p in root.rglob("*.py") if not skip & set(p.relative_to(root).parts)]
    return sorted(found, key=lambda p: p.relative_to(root).as_posix())


def check_paths(cfg: DataConfig) -> list[Path]:
    """The files of ``data.paths`` in reading order (empty for the stdlib corpus).

    Raises:
        ValueError: an entry (file or glob pattern) that matches no file, named.
    """
    files: list[Path] = []
    for pattern in cfg.paths if cfg.source == "files" else []:
        matches = sorted(glob.glob(pattern, recursive=True)) if glob.has_magic(pattern) else [pattern]
        found = [Path(m) for m in matches if Path(m).is_file()]
        if not found:
            raise ValueError(f"data.paths entry {pattern!r} matches no file (relative to {Path.cwd()})")
        files.extend(found)
    return files


def _record_text(record: object, where: str, text_key: str) -> bytes:
    if not isinstance(record, dict) or not isinstance(record.get(text_key), str):
        raise ValueError(f"{where}: expected a JSON object with a string {text_key!r} (data.text_key)")
    return record[text_key].encode("utf-8")


def _json_documents(path: Path, text_key: str) -> Iterator[bytes]:
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(
            f"{path}: not UTF-8 text (byte 0x{err.object[err.start : err.start + 1].hex()} at offset "
            f"{err.start}); save it as UTF-8 or drop it from data.paths"
        ) from None
    if path.suffix == ".json" and text.lstrip().startswith("["):
        for i, record in enumerate(json.loads(text)):
            yield _record_text(record, f"{path}[{i}]", text_key)
        return
    for lineno, line in enumerate(text.split("\n"), 1):  # records end at \n only (not at U+2028)
        if line.strip():
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{lineno}: not a JSON Lines record ({err.msg})") from None
            yield _record_text(record, f"{path}:{lineno}", text_key)


def _parquet_documents(path: Path, text_key: str) -> Iterator[bytes]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ValueError(f"{path}: reading Parquet needs `pyarrow` (pip install pyarrow)") from None
    table = pq.ParquetFile(path)
    if text_key not in table.schema_arrow.names:
        raise ValueError(
            f"{path}: no column {text_key!r} (data.text_key); columns: {table.schema_arrow.names}"
        )
    for batch in table.iter_batches(columns=[text_key]):
        for value in batch.column(0).to_pylist():
            if isinstance(value, str):
                yield value.encode("utf-8")


def _documents_of(path: Path, text_key: str) -> Iterator[bytes]:
    if path.suffix in (".jsonl", ".json"):
        yield from _json_documents(path, text_key)
    elif path.suffix == ".parquet":
        yield from _parquet_documents(path, text_key)
    else:
        yield path.read_bytes()


def read_documents(cfg: DataConfig) -> list[bytes]:
    """The corpus documents in a fixed order, stopping after ``cfg.max_bytes`` bytes."""
    return _read(cfg)[0]


def _read(cfg: DataConfig) -> tuple[list[bytes], Extent]:
    files = stdlib_files() if cfg.source == "stdlib" else check_paths(cfg)
    extent = Extent(files=len(files), file_bytes=sum(f.stat().st_size for f in files))
    docs: list[bytes] = []
    total = 0
    for path in files:
        extent.files_read += 1
        for doc in _documents_of(path, cfg.text_key):
            if cfg.max_bytes is not None and total + len(doc) > cfg.max_bytes:
                docs.append(doc[: cfg.max_bytes - total])
                extent.cut_at = cfg.max_bytes
                return [d for d in docs if d], extent
            docs.append(doc)
            total += len(doc)
    return [d for d in docs if d], extent


def encode(doc: bytes, tokenizer: Tokenizer | None = None) -> np.ndarray:
    """Token ids of one document followed by the tokenizer's EOS (default: bytes)."""
    tok = tokenizer or ByteTokenizer()
    return np.concatenate([tok.encode(doc), np.array([tok.eos_id], np.int32)])


def decode(tokens: list[int] | np.ndarray) -> str:
    """Bytes back to text (EOS becomes a newline); for samples and debugging."""
    return bytes(t if t < 256 else 10 for t in tokens).decode("utf-8", errors="replace")


@dataclasses.dataclass
class Extent:
    """How much of the corpus's files was read: all of them, or what ``data.max_bytes`` let through."""

    files: int
    """Files of the corpus."""
    file_bytes: int
    """Their size on disk, all of them."""
    files_read: int = 0
    """Files read from (the last one only in part when the cap cut it)."""
    cut_at: int | None = None
    """``data.max_bytes`` when it stopped the reading before the end of the corpus, else None."""


@dataclasses.dataclass
class Corpus:
    """Train and validation splits of the packed corpus."""

    train: PackedDataset
    val: PackedDataset
    num_documents: int
    num_bytes: int
    extent: Extent

    def describe(self) -> str:
        """``N documents, B bytes``; when ``data.max_bytes`` cut the corpus, how much of it was read."""
        read = f"{self.num_documents:,} documents, {self.num_bytes:,} bytes"
        e = self.extent
        if e.cut_at is None:
            return read
        return (
            f"{read} read of the {e.file_bytes:,} bytes of its {e.files:,} files (data.max_bytes={e.cut_at:,} "
            f"stopped the reading in file {e.files_read:,}; data.max_bytes: null reads them all)"
        )


def corpus_fingerprint(cfg: DataConfig, tokenizer: Tokenizer) -> str:
    """A key of everything the packed tokens depend on: files (paths, sizes, mtimes), tokenizer, split."""
    files = stdlib_files() if cfg.source == "stdlib" else check_paths(cfg)
    h = hashlib.sha256(f"v2|{cfg.source}|{cfg.text_key}|{cfg.max_bytes}|{cfg.val_fraction}".encode())
    h.update(f"|{tokenizer.name}|{tokenizer.vocab_size}|{tokenizer.eos_id}".encode())
    tok_file = Path(tokenizer.name)
    for f in [tok_file] if tok_file.is_file() else []:
        h.update(f.read_bytes())
    for f in files:
        st = f.stat()
        h.update(f"|{f.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode())
    return h.hexdigest()[:16]


def _read_cache(directory: Path, seq_len: int) -> Corpus | None:
    meta = directory / "meta.json"
    if not meta.is_file():
        return None
    info = json.loads(meta.read_text())
    train, val = (np.load(directory / f"{split}.npy", mmap_mode="r") for split in ("train", "val"))
    extent = Extent(**info.pop("extent"))
    return Corpus(PackedDataset(train, seq_len), PackedDataset(val, seq_len), **info, extent=extent)


def _write_cache(directory: Path, corpus: Corpus) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    for split in ("train", "val"):
        tmp = directory / f".{split}.{os.getpid()}.npy"
        tokens = getattr(corpus, split).tokens
        small = len(tokens) == 0 or int(tokens.max()) < 2**16
        np.save(tmp, tokens.astype(np.uint16) if small else tokens)  # half the disk for byte/small vocabs
        os.replace(tmp, directory / f"{split}.npy")
    info = {
        "num_documents": corpus.num_documents,
        "num_bytes": corpus.num_bytes,
        "extent": dataclasses.asdict(corpus.extent),
    }
    tmp = directory / f".meta.{os.getpid()}.json"
    tmp.write_text(json.dumps(info))
    os.replace(tmp, directory / "meta.json")  # last: a directory without meta.json is incomplete


def load_corpus(
    cfg: DataConfig, tokenizer: Tokenizer | None = None, cache_dir: str | Path | None = None
) -> Corpus:
    """Read, tokenize (default: bytes), split (every k-th document to validation) and pack.

    With ``cache_dir`` the packed tokens are kept in ``<cache_dir>/<fingerprint>/`` as ``.npy`` files
    and read back memory-mapped, so a rank touches only the windows it reads and a restarted or
    resumed run does not tokenize again.

    Raises:
        ValueError: a split holds less than one sequence.
    """
    tokenizer = tokenizer or ByteTokenizer()
    cache = Path(cache_dir) / corpus_fingerprint(cfg, tokenizer) if cache_dir is not None else None
    cached = _read_cache(cache, cfg.seq_len) if cache is not None else None
    if cached is not None:
        return cached
    corpus = _build_corpus(cfg, tokenizer)
    if cache is not None:
        _write_cache(cache, corpus)
        return _read_cache(cache, cfg.seq_len) or corpus
    return corpus


def _build_corpus(cfg: DataConfig, tokenizer: Tokenizer) -> Corpus:
    docs, extent = _read(cfg)
    every = max(2, round(1 / cfg.val_fraction))
    held_out = {i for i in range(len(docs)) if i % every == every - 1} or {len(docs) - 1}
    train = [encode(d, tokenizer) for i, d in enumerate(docs) if i not in held_out]
    val = [encode(d, tokenizer) for i, d in enumerate(docs) if i in held_out]
    corpus = Corpus(
        train=PackedDataset(np.concatenate(train) if train else np.zeros(0, np.int32), cfg.seq_len),
        val=PackedDataset(np.concatenate(val) if val else np.zeros(0, np.int32), cfg.seq_len),
        num_documents=len(docs),
        num_bytes=sum(len(d) for d in docs),
        extent=extent,
    )
    for split in ("train", "val"):
        if len(getattr(corpus, split)) == 0:
            fix = "raise data.max_bytes, add data" if extent.cut_at is not None else "add data"
            raise ValueError(
                f"the {split} split of the corpus ({corpus.describe()}) holds no sequence of "
                f"data.seq_len={cfg.seq_len}+1 tokens; {fix} or lower data.seq_len"
            )
    return corpus


def check_corpus_ids(corpus: Corpus, vocab: int) -> None:
    """Every token id of both splits is below the model's ``vocab`` (else a ValueError naming both)."""
    for split in ("train", "val"):
        tokens = getattr(corpus, split).tokens
        if len(tokens) and int(tokens.max()) >= vocab:
            raise ValueError(
                f"the {split} data holds token id {int(tokens.max())} but the model's vocab_size is {vocab}; "
                f"raise the model's vocab_size to at least {int(tokens.max()) + 1}"
            )


def prepare_corpus(
    cfg: DataConfig, tokenizer: Tokenizer, cache_dir: str | Path, *, local_rank: int, device: torch.device
) -> Corpus:
    """:func:`load_corpus` in a job: local rank 0 of each node tokenizes into the cache, then every
    rank memory-maps it.

    A success flag is all-reduced (every rank reaches it, so a failed tokenization cannot leave the
    others waiting); a failure raises ``ValueError`` on every rank, with the cause on the ranks that
    tokenized.
    """
    import torch.distributed as dist

    error: ValueError | None = None
    if local_rank == 0:
        try:
            load_corpus(cfg, tokenizer, cache_dir)
        except ValueError as err:
            error = err
    ok = torch.tensor([0.0 if error else 1.0], device=device)
    if dist.is_initialized():
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    if error is not None:
        raise error
    if float(ok) < 1.0:
        raise ValueError("tokenizing the corpus failed on another rank (its error line names the cause)")
    return load_corpus(cfg, tokenizer, cache_dir)
