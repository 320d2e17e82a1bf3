"""``data.source: hf_datasets``: documents from a local Hugging Face ``datasets`` dataset.

``data.paths`` is either local data files (globs allowed) of one kind, read with
``datasets.load_dataset`` — ``.json`` / ``.jsonl`` (``json``), ``.parquet``, ``.arrow``, ``.csv``,
``.txt`` (``text``: one document per line, column ``text``) — or one directory written by
``save_to_disk``, read with ``datasets.load_from_disk`` (``data.hf_split`` picks the split of a
saved ``DatasetDict``). ``data.streaming: true`` iterates an ``IterableDataset`` instead (the files
are read lazily, no Arrow copy is written). Nothing is downloaded: ``HF_DATASETS_OFFLINE`` and
``HF_HUB_OFFLINE`` are set before ``datasets`` is imported.

The documents are the ``data.text_key`` column in dataset order; they go through the same packing,
token cache and global sampler as the other sources, so the resumable position is the same.
"""

from __future__ import annotations

import dataclasses
import glob
import importlib.util
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from plait.train.config import DataConfig

__all__ = ["BUILDERS", "HFSource", "check_installed", "hf_documents", "resolve_source"]

BUILDERS = {
    ".json": "json",
    ".jsonl": "json",
    ".parquet": "parquet",
    ".arrow": "arrow",
    ".csv": "csv",
    ".txt": "text",
}
"""``datasets`` builder of each data-file suffix."""
_SAVED_MARKERS = ("state.json", "dataset_dict.json")
_ROWS_PER_BATCH = 1000


@dataclasses.dataclass(frozen=True)
class HFSource:
    """What ``data.paths`` names: data files of one builder, or a ``save_to_disk`` directory."""

    files: list[Path]
    """Every file the dataset is read from (for the cache fingerprint and ``validate``)."""
    builder: str | None = None
    """The ``load_dataset`` builder of the data files; None for a saved directory."""
    saved: Path | None = None
    """The ``save_to_disk`` directory, read with ``load_from_disk``."""


def check_installed() -> None:
    """Raise the one-line ``ValueError`` naming the extra when ``datasets`` is not installed."""
    if importlib.util.find_spec("datasets") is None:
        raise ValueError(
            "data.source: hf_datasets needs the `datasets` package: pip install 'plait-train[datasets]'"
        )


def resolve_source(cfg: DataConfig) -> HFSource:
    """The files or the saved directory of ``data.paths``.

    Raises:
        ValueError: an entry matching nothing, a directory that ``save_to_disk`` did not write or
            that comes with other entries, files of an unknown suffix or of several kinds.
    """
    dirs = [Path(p) for p in cfg.paths if Path(p).is_dir()]
    if dirs:
        saved = dirs[0]
        if len(cfg.paths) > 1:
            raise ValueError(
                f"data.paths {cfg.paths!r}: a saved dataset directory ({saved}) must be the only entry"
            )
        if not any((saved / marker).is_file() for marker in _SAVED_MARKERS):
            raise ValueError(
                f"data.paths entry {str(saved)!r} is a directory without {' or '.join(_SAVED_MARKERS)}: "
                "give a directory written by save_to_disk, or its data files (globs allowed)"
            )
        return HFSource(sorted(p for p in saved.rglob("*") if p.is_file()), saved=saved)
    if cfg.hf_split is not None:
        raise ValueError(
            f"data.hf_split {cfg.hf_split!r} is only read for a saved DatasetDict directory; data files "
            "load as one split: drop data.hf_split"
        )
    files = [f for pattern in cfg.paths for f in _matches(pattern)]
    kinds = {BUILDERS.get(f.suffix) for f in files}
    if None in kinds:
        odd = next(f for f in files if f.suffix not in BUILDERS)
        raise ValueError(
            f"data.paths file {str(odd)!r}: data.source hf_datasets reads {', '.join(BUILDERS)} files "
            "(or a save_to_disk directory)"
        )
    if len(kinds) > 1:
        raise ValueError(f"data.paths mixes {sorted(kinds)} files; datasets loads one kind at a time")
    return HFSource(files, builder=kinds.pop())


def _matches(pattern: str) -> list[Path]:
    matches = sorted(glob.glob(pattern, recursive=True)) if glob.has_magic(pattern) else [pattern]
    found = [Path(m) for m in matches if Path(m).is_file()]
    if not found:
        raise ValueError(f"data.paths entry {pattern!r} matches no file (relative to {Path.cwd()})")
    return found


def _import_datasets() -> Any:
    check_installed()
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import datasets

    for flag in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):  # already imported by the caller: offline too
        if hasattr(datasets.config, flag):
            setattr(datasets.config, flag, True)
    return datasets


def _load(cfg: DataConfig, source: HFSource, cache_dir: Path | None) -> Any:
    datasets = _import_datasets()
    if source.saved is None:
        return datasets.load_dataset(
            source.builder,
            data_files=[str(f) for f in source.files],
            split="train",
            streaming=cfg.streaming,
            cache_dir=str(cache_dir) if cache_dir is not None and not cfg.streaming else None,
        )
    loaded = datasets.load_from_disk(str(source.saved))
    if isinstance(loaded, datasets.DatasetDict):
        splits = list(loaded)
        split = cfg.hf_split or (splits[0] if len(splits) == 1 else "train")
        if split not in loaded:
            raise ValueError(
                f"the saved DatasetDict {str(source.saved)!r} has no split {split!r}; its splits: {splits} "
                "(set data.hf_split)"
            )
        loaded = loaded[split]
    elif cfg.hf_split is not None:
        raise ValueError(
            f"{str(source.saved)!r} holds one Dataset, not a DatasetDict: drop data.hf_split {cfg.hf_split!r}"
        )
    return loaded.to_iterable_dataset() if cfg.streaming else loaded


def hf_documents(
    cfg: DataConfig, cache_dir: Path | None = None
) -> tuple[Iterator[tuple[bytes, int]], int | None]:
    """The documents of the dataset with the rows read so far, and the row count (None when streaming).

    Non-streaming ``load_dataset`` writes its Arrow copy under ``cache_dir`` (the run's token cache)
    when one is given, else in the ``datasets`` cache.

    Raises:
        ValueError: ``data.text_key`` is not a column (the columns named), or holds non-text values.
    """
    ds = _load(cfg, resolve_source(cfg), cache_dir)
    columns = ds.column_names
    if columns is not None and cfg.text_key not in columns:
        raise ValueError(f"the dataset has no column {cfg.text_key!r} (data.text_key); columns: {columns}")
    total = None if cfg.streaming else len(ds)
    return _rows(ds, cfg.text_key), total


def _rows(ds: Any, text_key: str) -> Iterator[tuple[bytes, int]]:
    rows = 0
    for batch in ds.iter(batch_size=_ROWS_PER_BATCH):
        if text_key not in batch:
            raise ValueError(
                f"the dataset has no column {text_key!r} (data.text_key); columns: {list(batch)}"
            )
        for value in batch[text_key]:
            rows += 1
            if isinstance(value, str):
                yield value.encode("utf-8"), rows
            elif value is not None:
                raise ValueError(
                    f"row {rows - 1} of the dataset: column {text_key!r} (data.text_key) holds a "
                    f"{type(value).__name__}, not text"
                )
