"""``data.source: hf_datasets``: local files and saved datasets, streaming, the resumable position, no hub."""

from __future__ import annotations

import importlib.util
import json
import socket
from pathlib import Path

import numpy as np
import pytest

from plait.train.batches import GlobalSampler
from plait.train.config import DataConfig
from plait.train.data import check_paths, corpus_fingerprint, load_corpus
from plait.train.tokenizer import ByteTokenizer

TEXTS = [f"row {i}: a document of the dataset, number {i * 13} " * 3 for i in range(120)]


@pytest.fixture(autouse=True)
def _offline(monkeypatch: pytest.MonkeyPatch) -> None:
    """No network: a connection to anything but this machine fails the test."""
    connect, create = socket.socket.connect, socket.create_connection

    def local(address: object) -> bool:
        host = address[0] if isinstance(address, tuple) else None
        return host is None or host in ("localhost", "127.0.0.1", "::1")

    def guarded_connect(self: socket.socket, address: object) -> None:
        assert local(address), f"tried to connect to {address}"
        connect(self, address)

    def guarded_create(address: object, *args: object, **kwargs: object) -> socket.socket:
        assert local(address), f"tried to connect to {address}"
        return create(address, *args, **kwargs)

    monkeypatch.setattr(socket.socket, "connect", guarded_connect)
    monkeypatch.setattr(socket, "create_connection", guarded_create)


def _hf(paths: list[Path | str], **kw: object) -> DataConfig:
    return DataConfig(source="hf_datasets", paths=[str(p) for p in paths], seq_len=16, **kw)


def _tokens(cfg: DataConfig, cache: Path | None = None) -> tuple[np.ndarray, np.ndarray]:
    corpus = load_corpus(cfg, cache_dir=cache)
    return np.asarray(corpus.train.tokens), np.asarray(corpus.val.tokens)


def test_local_jsonl_files_read_like_the_files_source_streaming_or_not(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    import datasets

    loaded: list[object] = []
    real = datasets.load_dataset
    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **k: loaded.append(real(*a, **k)) or loaded[-1])
    for part in range(2):
        rows = "\n".join(
            json.dumps({"text": t, "id": i}) for i, t in enumerate(TEXTS[part * 60 : part * 60 + 60])
        )
        (tmp_path / f"p{part}.jsonl").write_text(rows + "\n")
    files = DataConfig(source="files", paths=[str(tmp_path / "*.jsonl")], seq_len=16)
    expected = _tokens(files)
    for streaming in (False, True):
        cfg = _hf([tmp_path / "*.jsonl"], streaming=streaming)
        got = _tokens(cfg, tmp_path / f"cache_{streaming}")
        np.testing.assert_array_equal(got[0], expected[0])
        np.testing.assert_array_equal(got[1], expected[1])
    assert [type(d) for d in loaded] == [datasets.Dataset, datasets.IterableDataset]
    assert load_corpus(_hf([tmp_path / "*.jsonl"])).num_documents == 120
    assert list((tmp_path / "cache_False").glob("hf_datasets/*"))  # the Arrow copy sits in the run's cache
    assert not (tmp_path / "cache_True" / "hf_datasets").exists()  # streaming writes none
    assert corpus_fingerprint(_hf([tmp_path / "*.jsonl"]), ByteTokenizer()) == corpus_fingerprint(
        _hf([tmp_path / "*.jsonl"], streaming=True), ByteTokenizer()
    )  # the same rows: one cache for both modes


def test_parquet_and_a_saved_dataset_dict_with_its_splits(tmp_path: Path):
    import datasets

    data = datasets.Dataset.from_dict({"body": TEXTS, "n": list(range(len(TEXTS)))})
    data.to_parquet(str(tmp_path / "d.parquet"))
    parquet = _tokens(_hf([tmp_path / "d.parquet"], text_key="body"))
    datasets.DatasetDict({"train": data, "test": data.select(range(30))}).save_to_disk(
        str(tmp_path / "saved")
    )
    for streaming in (False, True):
        saved = _tokens(_hf([tmp_path / "saved"], text_key="body", streaming=streaming))
        np.testing.assert_array_equal(saved[0], parquet[0])  # the train split by default
    test_split = load_corpus(_hf([tmp_path / "saved"], text_key="body", hf_split="test"))
    assert test_split.num_documents == 30
    with pytest.raises(ValueError, match=r"has no split 'val'; its splits: \['train', 'test'\]"):
        load_corpus(_hf([tmp_path / "saved"], text_key="body", hf_split="val"))
    with pytest.raises(ValueError, match=r"no column 'text' \(data.text_key\); columns: \['body', 'n'\]"):
        load_corpus(_hf([tmp_path / "saved"]))
    data.save_to_disk(str(tmp_path / "one"))
    assert load_corpus(_hf([tmp_path / "one"], text_key="body")).num_documents == len(TEXTS)
    with pytest.raises(ValueError, match=r"holds one Dataset, not a DatasetDict: drop data\.hf_split"):
        load_corpus(_hf([tmp_path / "one"], text_key="body", hf_split="train"))


def test_a_resumed_run_sees_no_sample_twice(tmp_path: Path):
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps({"text": t}) for t in TEXTS))
    cfg = _hf([tmp_path / "d.jsonl"], streaming=True)
    corpus = load_corpus(cfg, cache_dir=tmp_path / "cache")
    n = len(corpus.train)
    assert n > 40
    samplers = [GlobalSampler(n, 2, r, 2, seed=5, shuffle=True) for r in range(2)]
    seen = [i for _ in range(5) for s in samplers for i in s.next_indices()]
    state = samplers[0].state_dict()
    assert state == {"position": 20, "num_samples": n}
    # the resumed job: a fresh load (the cache, or the dataset again) and a sampler at another dp size
    again = load_corpus(_hf([tmp_path / "d.jsonl"]), cache_dir=tmp_path / "cache")
    resumed = GlobalSampler(len(again.train), 4, 0, 1, seed=5, shuffle=True)
    resumed.load_state_dict(state)
    while resumed.position < n:
        seen.extend(resumed.next_indices())
    assert sorted(seen[:n]) == list(range(n))  # every sample of the epoch once
    _, val = _tokens(_hf([tmp_path / "d.jsonl"]))
    np.testing.assert_array_equal(np.asarray(again.val.tokens), val)


def test_offline_and_the_missing_extra_is_one_line_naming_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps({"text": t}) for t in TEXTS))
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    load_corpus(_hf([tmp_path / "d.jsonl"]))
    import os

    assert os.environ["HF_DATASETS_OFFLINE"] == "1"
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "datasets" else real(name, *a)
    )
    with pytest.raises(
        ValueError, match=r"needs the `datasets` package: pip install 'plait-train\[datasets\]'$"
    ):
        check_paths(_hf([tmp_path / "d.jsonl"]))


def test_settings_it_would_not_read_are_refused(tmp_path: Path):
    (tmp_path / "d.jsonl").write_text("{}")
    (tmp_path / "d.txt").write_text("x")
    (tmp_path / "plain").mkdir()
    with pytest.raises(ValueError, match=r"data\.streaming is only read with data\.source: hf_datasets"):
        DataConfig(source="files", paths=["x"], streaming=True)
    with pytest.raises(ValueError, match=r"data\.hf_split is only read with data\.source: hf_datasets"):
        DataConfig(hf_split="train")
    with pytest.raises(ValueError, match=r"data\.source 'hf_datasets' needs data\.paths"):
        DataConfig(source="hf_datasets")
    with pytest.raises(ValueError, match="only read for a saved DatasetDict directory"):
        check_paths(_hf([tmp_path / "d.jsonl"], hf_split="train"))
    with pytest.raises(ValueError, match=r"mixes \['json', 'text'\] files"):
        check_paths(_hf([tmp_path / "d.jsonl", tmp_path / "d.txt"]))
    with pytest.raises(ValueError, match=r"is a directory without state\.json or dataset_dict\.json"):
        check_paths(_hf([tmp_path / "plain"]))
    with pytest.raises(ValueError, match="matches no file"):
        check_paths(_hf([tmp_path / "*.csv"]))


def test_a_training_job_on_a_saved_dataset_resumes_where_it_stopped(tmp_path: Path):
    """Trainer, checkpoint and data position end to end: steps 3-4 after a resume take new samples."""
    import datasets

    from plait.testing import run_on_ranks
    from tests.train._ckpt_jobs import train

    datasets.Dataset.from_dict({"text": TEXTS}).save_to_disk(str(tmp_path / "saved"))
    data = ["parallel.tp_size=1", "data.source=hf_datasets", f"data.paths=[{tmp_path / 'saved'}]"]
    run_dir = str(tmp_path / "run")
    (first,) = run_on_ranks(train, 1, run_dir, [*data, "train.steps=2", "checkpoint.every=2"])
    assert first["error"] is None, first["error"]
    (second,) = run_on_ranks(train, 1, run_dir, [*data, "data.streaming=true", "train.steps=4"])
    assert second["error"] is None, second["error"]
    assert sorted(first["samples"]) == [1, 2] and sorted(second["samples"]) == [3, 4]
    seen = [i for run in (first, second) for indices in run["samples"].values() for i in indices]
    assert len(seen) == 16 and len(set(seen)) == 16  # 4 steps x 4 sequences, none seen twice
