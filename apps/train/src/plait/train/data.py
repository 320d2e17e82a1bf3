"""Tokenization, document packing and the token cache: the corpus as two memory-mapped token arrays.

The documents come from :mod:`plait.train.sources` (the stdlib sources, local files, a local
``datasets`` dataset), read lazily in a fixed order. Each document is tokenized
(:mod:`plait.train.tokenizer`) and followed by the tokenizer's EOS, and its tokens are appended to
the train or the validation split as they come (every k-th document is held out; the last one when
there are fewer than k), each split packed back to back and cut into ``seq_len + 1`` windows. The
whole corpus is read unless ``data.max_bytes`` caps the bytes of text; a cut is named in
:meth:`Corpus.describe` (the run's summary) and in the errors about too little data.

Memory: with a cache directory (the trainer's ``<run dir>/token_cache/``) the tokens go straight to
the cache's ``.npy`` files, so tokenizing holds one document (its text and tokens; a Parquet record
batch, a ``datasets`` batch of rows, a ``.json`` array file whole) plus a write buffer of
:data:`FLUSH_TOKENS` tokens per split, whatever the corpus size; the splits are then read back
memory-mapped. Without one the tokens are kept in memory (2 bytes a token for vocabularies up to
65,536 ids, else 4). ``progress`` gets a line every few seconds while tokenizing.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from plait.train.batches import PackedDataset
from plait.train.config import DataConfig
from plait.train.sources import DocumentStream, Extent, check_paths, open_documents, stdlib_files
from plait.train.tokenizer import BYTE_EOS, ByteTokenizer, Tokenizer

__all__ = [
    "EOS",
    "FLUSH_TOKENS",
    "TOKENIZER_VOCAB",
    "Corpus",
    "Extent",
    "check_corpus_ids",
    "check_paths",
    "corpus_fingerprint",
    "decode",
    "encode",
    "load_corpus",
    "prepare_corpus",
    "read_documents",
    "stdlib_files",
]

EOS = BYTE_EOS
"""End-of-document token of the byte tokenizer."""
TOKENIZER_VOCAB = ByteTokenizer.vocab_size
"""Token ids of the byte tokenizer: 256 bytes + EOS."""
FLUSH_TOKENS = 1 << 20
"""Tokens a split buffers before writing them to the cache (4 MiB as int32)."""
_NPY_HEADER = 128
"""Bytes of the ``.npy`` header the cache files are written with (version 1.0, padded)."""


def read_documents(cfg: DataConfig) -> list[bytes]:
    """The corpus documents in a fixed order, stopping after ``cfg.max_bytes`` bytes (all in memory)."""
    return [doc for doc, _ in open_documents(cfg).documents]


def encode(doc: bytes, tokenizer: Tokenizer | None = None) -> np.ndarray:
    """Token ids of one document followed by the tokenizer's EOS (default: bytes)."""
    tok = tokenizer or ByteTokenizer()
    return np.concatenate([tok.encode(doc), np.array([tok.eos_id], np.int32)])


def decode(tokens: list[int] | np.ndarray) -> str:
    """Bytes back to text (EOS becomes a newline); for samples and debugging."""
    return bytes(t if t < 256 else 10 for t in tokens).decode("utf-8", errors="replace")


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
        return _describe(self.num_documents, self.num_bytes, self.extent)


def _describe(num_documents: int, num_bytes: int, e: Extent) -> str:
    read = f"{num_documents:,} documents, {num_bytes:,} bytes"
    if e.cut_at is None:
        return read
    where = f"row {e.rows_read:,}" if e.rows_read is not None else f"file {e.files_read:,}"
    return (
        f"{read} read of the {e.file_bytes:,} bytes of its {e.files:,} files (data.max_bytes={e.cut_at:,} "
        f"stopped the reading in {where}; data.max_bytes: null reads them all)"
    )


def corpus_fingerprint(cfg: DataConfig, tokenizer: Tokenizer) -> str:
    """A key of everything the packed tokens depend on: files (paths, sizes, mtimes), tokenizer, split."""
    files = stdlib_files() if cfg.source == "stdlib" else check_paths(cfg)
    h = hashlib.sha256(f"v2|{cfg.source}|{cfg.text_key}|{cfg.max_bytes}|{cfg.val_fraction}".encode())
    if cfg.source == "hf_datasets":  # data.streaming reads the same rows: it shares the cache
        h.update(f"|{cfg.hf_split}".encode())
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


def _npy_header(dtype: np.dtype, length: int) -> bytes:
    """A ``.npy`` version 1.0 header of a 1-D array, padded to :data:`_NPY_HEADER` bytes."""
    d = repr({"descr": np.lib.format.dtype_to_descr(dtype), "fortran_order": False, "shape": (length,)})
    body = d.encode("latin1").ljust(_NPY_HEADER - 10 - 1) + b"\n"
    return b"\x93NUMPY\x01\x00" + len(body).to_bytes(2, "little") + body


class _Split:
    """One split's tokens, appended document by document: to a ``.npy`` file, or kept in memory."""

    def __init__(self, path: Path | None, dtype: np.dtype) -> None:
        self.path, self.dtype = path, dtype
        self.length = 0
        self.documents = 0
        self._pending: list[np.ndarray] = []
        self._pending_tokens = 0
        self._kept: list[np.ndarray] = []
        self._file = path.open("wb") if path is not None else None
        if self._file is not None:
            self._file.write(b"\0" * _NPY_HEADER)

    def add(self, tokens: np.ndarray) -> None:
        self._pending.append(tokens)
        self._pending_tokens += len(tokens)
        self.documents += 1
        if self._pending_tokens >= FLUSH_TOKENS:
            self._flush()

    def _flush(self) -> None:
        if not self._pending:
            return
        chunk = np.concatenate(self._pending)
        if self.dtype == np.uint16 and len(chunk) and int(chunk.max()) >= 2**16:
            raise ValueError(f"the tokenizer produced id {int(chunk.max())}, above its vocab_size")
        chunk = chunk.astype(self.dtype)
        if self._file is not None:
            self._file.write(chunk.data)  # no copy
        else:
            self._kept.append(chunk)
        self.length += len(chunk)
        self._pending, self._pending_tokens = [], 0

    def tokens(self) -> np.ndarray:
        """The tokens kept in memory (without a file; a file is read back memory-mapped)."""
        self._flush()
        return np.concatenate(self._kept) if self._kept else np.zeros(0, self.dtype)

    def close(self) -> None:
        """Write what is buffered and, with a file, the header (with the final length); close it."""
        self._flush()
        if self._file is None:
            return
        self._file.seek(0)
        self._file.write(_npy_header(self.dtype, self.length))
        self._file.close()
        self._file = None

    def discard(self) -> None:
        """Close and delete an unfinished file."""
        if self._file is not None:
            self._file.close()
            self._file = None
        if self.path is not None:
            self.path.unlink(missing_ok=True)


def _amount(n: float, unit: str) -> str:
    for scale, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if n >= scale:
            return f"{n / scale:.1f}{suffix if unit != 'bytes' else ' ' + suffix + 'B'}"
    return f"{int(n)}" + (" B" if unit == "bytes" else "")


class _Progress:
    """``tokenizing: 12.3 MB of 45.6 MB, 1.2M tokens`` every ``every_s`` seconds, and a last line."""

    def __init__(self, say: Callable[[str], None] | None, stream: DocumentStream, every_s: float) -> None:
        self.say, self.total, self.unit, self.every_s = say, stream.total, stream.unit, every_s
        self.start = self.last = time.monotonic()
        self.printed = False

    def _line(self, verb: str, read: int, tokens: int) -> str:
        rows = " rows" if self.unit == "rows" else ""
        amount = (lambda n: f"{n:,}") if rows else (lambda n: _amount(n, "bytes"))
        of = f" of {amount(self.total)}" if self.total is not None else ""
        return f"{verb}: {amount(read)}{of}{rows}, {_amount(tokens, 'tokens')} tokens"

    def update(self, read: int, tokens: int) -> None:
        now = time.monotonic()
        if self.say is not None and now - self.last >= self.every_s:
            self.say(self._line("tokenizing", read, tokens))
            self.last, self.printed = now, True

    def finish(self, read: int, tokens: int) -> None:
        """The last line, when a progress line was printed (a quick corpus prints none)."""
        if self.say is not None and self.printed:
            self.say(f"{self._line('tokenized', read, tokens)} in {time.monotonic() - self.start:.1f} s")


def _fill(
    cfg: DataConfig, stream: DocumentStream, tokenizer: Tokenizer, splits: list[_Split], progress: _Progress
) -> int:
    """Tokenize every document into ``splits`` (train, val); the bytes of text read."""
    train, val = splits
    every = max(2, round(1 / cfg.val_fraction))
    last: np.ndarray | None = None  # the newest train document: held out instead when it ends a tiny corpus
    index = num_bytes = tokens = read = 0
    for doc, read in stream.documents:
        ids = encode(doc, tokenizer)
        if index % every == every - 1:
            val.add(ids)
        else:
            if last is not None:
                train.add(last)
            last = ids
        index, num_bytes, tokens = index + 1, num_bytes + len(doc), tokens + len(ids)
        progress.update(read, tokens)
    if last is not None:
        (val if val.documents == 0 else train).add(last)
    progress.finish(read, tokens)
    return num_bytes


def _build_corpus(
    cfg: DataConfig,
    tokenizer: Tokenizer,
    cache: Path | None,
    say: Callable[[str], None] | None,
    every_s: float,
) -> Corpus:
    """Tokenize the corpus into ``cache`` (its ``.npy`` files and ``meta.json``), or into memory."""
    stream = open_documents(cfg, cache.parent / "hf_datasets" if cache is not None else None)
    dtype = np.dtype(np.uint16 if tokenizer.vocab_size <= 2**16 else np.int32)  # half the disk, small vocabs
    created = [d for d in (cache, *cache.parents) if not d.exists()] if cache is not None else []
    for directory in reversed(created):
        directory.mkdir(exist_ok=True)  # another rank may create the run directory meanwhile
    splits = [_Split(cache / f".{n}.{os.getpid()}.npy" if cache else None, dtype) for n in ("train", "val")]
    try:
        num_documents, num_bytes = _tokenize(cfg, tokenizer, stream, splits, _Progress(say, stream, every_s))
    except BaseException:
        for split in splits:
            split.discard()
        for directory in created:  # a failed run leaves no directory behind
            with contextlib.suppress(OSError):
                directory.rmdir()
        raise
    if cache is None:
        train, val = (PackedDataset(split.tokens(), cfg.seq_len) for split in splits)
        return Corpus(train, val, num_documents, num_bytes, stream.extent)
    for name, split in zip(("train", "val"), splits, strict=True):
        os.replace(split.path, cache / f"{name}.npy")
    extent = dataclasses.asdict(stream.extent)
    info = {"num_documents": num_documents, "num_bytes": num_bytes, "extent": extent}
    tmp = cache / f".meta.{os.getpid()}.json"
    tmp.write_text(json.dumps(info))
    os.replace(tmp, cache / "meta.json")  # last: a directory without meta.json is incomplete
    corpus = _read_cache(cache, cfg.seq_len)
    assert corpus is not None
    return corpus


def _tokenize(
    cfg: DataConfig, tokenizer: Tokenizer, stream: DocumentStream, splits: list[_Split], progress: _Progress
) -> tuple[int, int]:
    """Fill and close ``splits``; ``(documents, bytes of text)``; each split must hold a sequence."""
    num_bytes = _fill(cfg, stream, tokenizer, splits, progress)
    for split in splits:
        split.close()
    num_documents = splits[0].documents + splits[1].documents
    for name, split in zip(("train", "val"), splits, strict=True):
        if split.length < cfg.seq_len + 1:
            fix = "raise data.max_bytes, add data" if stream.extent.cut_at is not None else "add data"
            raise ValueError(
                f"the {name} split of the corpus ({_describe(num_documents, num_bytes, stream.extent)}) "
                f"holds no sequence of data.seq_len={cfg.seq_len}+1 tokens; {fix} or lower data.seq_len"
            )
    return num_documents, num_bytes


def load_corpus(
    cfg: DataConfig,
    tokenizer: Tokenizer | None = None,
    cache_dir: str | Path | None = None,
    *,
    progress: Callable[[str], None] | None = None,
    progress_every_s: float = 5.0,
) -> Corpus:
    """Read, tokenize (default: bytes), split (every k-th document to validation) and pack.

    With ``cache_dir`` the packed tokens are written to ``<cache_dir>/<fingerprint>/`` as ``.npy``
    files while the documents are read (memory: see the module docstring) and read back
    memory-mapped, so a rank touches only the windows it reads and a restarted or resumed run does
    not tokenize again. ``progress`` receives a line every ``progress_every_s`` seconds of
    tokenizing, and a last one when it printed any.

    Raises:
        ValueError: a split holds less than one sequence.
    """
    tokenizer = tokenizer or ByteTokenizer()
    cache = Path(cache_dir) / corpus_fingerprint(cfg, tokenizer) if cache_dir is not None else None
    cached = _read_cache(cache, cfg.seq_len) if cache is not None else None
    if cached is not None:
        return cached
    return _build_corpus(cfg, tokenizer, cache, progress, progress_every_s)


def check_corpus_ids(corpus: Corpus, vocab: int) -> None:
    """Every token id of both splits is below the model's ``vocab`` (else a ValueError naming both)."""
    for split in ("train", "val"):
        tokens = getattr(corpus, split).tokens
        if len(tokens) and int(tokens.max()) >= vocab:
            raise ValueError(
                f"the {split} data holds token id {int(tokens.max())} but the model's vocab_size is {vocab}; "
                f"raise the model's vocab_size to at least {int(tokens.max()) + 1}"
            )


def _say(line: str) -> None:
    print(line, flush=True)


def prepare_corpus(
    cfg: DataConfig, tokenizer: Tokenizer, cache_dir: str | Path, *, local_rank: int, device: torch.device
) -> Corpus:
    """:func:`load_corpus` in a job: local rank 0 of each node tokenizes into the cache (global rank
    0 printing progress), then every rank memory-maps it.

    A success flag is all-reduced (every rank reaches it, so a failed tokenization cannot leave the
    others waiting); a failure raises ``ValueError`` on every rank, with the cause on the ranks that
    tokenized.
    """
    import torch.distributed as dist

    error: ValueError | None = None
    if local_rank == 0:
        rank = dist.get_rank() if dist.is_initialized() else 0
        try:
            load_corpus(cfg, tokenizer, cache_dir, progress=_say if rank == 0 else None)
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
