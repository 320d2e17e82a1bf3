"""Corpus, packing, sampler and validation split: deterministic, mesh-independent, resumable."""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path

import numpy as np
import pytest

from plait.train.batches import GlobalSampler, PackedDataset
from plait.train.config import DataConfig
from plait.train.data import EOS, load_corpus, read_documents, stdlib_files


def test_stdlib_corpus_is_sorted_deterministic_and_excludes_site_packages():
    files = stdlib_files()
    root = Path(sysconfig.get_paths()["stdlib"])
    rel = [f.relative_to(root).as_posix() for f in files]
    assert len(files) > 100
    assert rel == sorted(rel)
    assert not any("site-packages" in r for r in rel)
    assert all(r.endswith(".py") for r in rel)
    assert files == stdlib_files()


def test_max_bytes_caps_the_corpus_and_documents_keep_their_order():
    docs = read_documents(DataConfig(max_bytes=50_000))
    assert sum(len(d) for d in docs) == 50_000
    assert docs[0] == stdlib_files()[0].read_bytes()[: len(docs[0])]


def test_a_users_6_mb_corpus_is_read_whole_by_default(tmp_path: Path):
    lines = [f"line {i}: the user's own text, every byte of it\n" for i in range(130_000)]
    for part in range(3):
        (tmp_path / f"part{part}.txt").write_text("".join(lines[part::3]))
    size = sum(f.stat().st_size for f in tmp_path.iterdir())
    assert size > 6_000_000
    corpus = load_corpus(DataConfig(source="files", paths=[str(tmp_path / "*.txt")]))
    assert corpus.num_bytes == size and corpus.num_documents == 3
    assert len(corpus.train.tokens) + len(corpus.val.tokens) == size + 3  # every byte, and an EOS each
    assert corpus.describe() == f"3 documents, {size:,} bytes"


def test_a_cap_the_user_sets_is_announced_with_how_much_of_the_corpus_was_read(tmp_path: Path):
    for i in range(4):
        (tmp_path / f"{i}.txt").write_text(f"document {i} " * 100)  # 1,100 bytes each
    cfg = DataConfig(source="files", paths=[str(tmp_path / "*.txt")], seq_len=8, max_bytes=2_000)
    assert load_corpus(cfg).describe() == (
        "2 documents, 2,000 bytes read of the 4,400 bytes of its 4 files "
        "(data.max_bytes=2,000 stopped the reading in file 2; data.max_bytes: null reads them all)"
    )
    tiny = DataConfig(source="files", paths=[str(tmp_path / "*.txt")], seq_len=8, max_bytes=5)
    with pytest.raises(
        ValueError, match=r"5 bytes read of the 4,400 bytes of its 4 files .* raise data.max_bytes"
    ):
        load_corpus(tiny)


def test_packing_shifts_labels_and_splits_documents(tmp_path: Path):
    texts = [f"document number {i} " * 5 for i in range(20)]
    (tmp_path / "a.jsonl").write_text("\n".join(json.dumps({"text": t}) for t in texts[:10]))
    (tmp_path / "b.jsonl").write_text("\n".join(json.dumps({"text": t}) for t in texts[10:]))
    cfg = DataConfig(source="files", paths=[str(tmp_path / "*.jsonl")], seq_len=16, val_fraction=0.25)
    corpus = load_corpus(cfg)
    assert corpus.num_documents == 20
    val_text = bytes(int(t) for t in corpus.val.tokens if t != EOS).decode()
    train_text = bytes(int(t) for t in corpus.train.tokens if t != EOS).decode()
    held_out = [t for i, t in enumerate(texts) if i % 4 == 3]
    assert val_text == "".join(held_out)
    assert all(t not in train_text for t in held_out)
    inputs, labels = corpus.train.batch([0, 2])
    assert inputs.shape == labels.shape == (2, 16)
    assert (inputs[:, 1:] == labels[:, :-1]).all()
    assert inputs[1, 0] == corpus.train.tokens[32]


def test_bad_data_paths_and_tiny_corpora_are_errors(tmp_path: Path):
    with pytest.raises(ValueError, match="matches no file"):
        load_corpus(DataConfig(source="files", paths=[str(tmp_path / "missing.txt")]))
    (tmp_path / "t.txt").write_text("short")
    with pytest.raises(ValueError, match="holds no sequence"):
        load_corpus(DataConfig(source="files", paths=[str(tmp_path / "t.txt")], seq_len=64))


def _global_batches(dp_size: int, steps: int, mbs: int, start: int = 0) -> list[list[int]]:
    samplers = [GlobalSampler(37, mbs, r, dp_size, seed=3, shuffle=True) for r in range(dp_size)]
    for s in samplers:
        s.load_state_dict({"position": start})
    return [[i for s in samplers for i in s.next_indices()] for _ in range(steps)]


def test_global_batch_is_the_same_whatever_the_dp_size():
    one = _global_batches(1, 6, mbs=4)
    two = _global_batches(2, 6, mbs=2)
    four = _global_batches(4, 6, mbs=1)
    assert one == two == four


def test_sampler_resumes_exactly_and_covers_each_epoch():
    full = _global_batches(2, 10, mbs=2)
    resumed = _global_batches(2, 4, mbs=2, start=6 * 4)
    assert resumed == full[6:]
    first_epoch = [i for batch in _global_batches(1, 37, mbs=1) for i in batch]
    assert sorted(first_epoch) == list(range(37))
    second = [i for batch in _global_batches(1, 37, mbs=1, start=37) for i in batch]
    assert sorted(second) == list(range(37)) and second != first_epoch


def test_packed_dataset_length():
    assert len(PackedDataset(np.arange(33), 8)) == 4
    assert len(PackedDataset(np.arange(32), 8)) == 3


def test_a_small_corpus_still_holds_out_one_document(tmp_path: Path):
    for i in range(3):
        (tmp_path / f"{i}.txt").write_text(f"text {i} " * 20)
    corpus = load_corpus(DataConfig(source="files", paths=[str(tmp_path / "*.txt")], seq_len=8))
    assert bytes(int(t) for t in corpus.val.tokens if t != EOS).decode() == "text 2 " * 20


def _bpe_tokenizer(directory: Path, texts: list[str], vocab_size: int = 300) -> Path:
    """A byte-level BPE trained locally on ``texts``, saved as ``directory/tokenizer.json``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(texts, trainer)
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    return directory / "tokenizer.json"


def test_hf_tokenizer_packs_documents_with_eos_between_them_from_jsonl_json_and_parquet(tmp_path: Path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from plait.train.tokenizer import load_tokenizer

    texts = [f"record {i}: the quick brown fox {i * 7} jumps" for i in range(12)]
    _bpe_tokenizer(tmp_path / "model", texts)
    (tmp_path / "model" / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    (tmp_path / "a.jsonl").write_text("\n".join(json.dumps({"body": t}) for t in texts[:4]))
    (tmp_path / "b.json").write_text(json.dumps([{"body": t} for t in texts[4:8]]))
    pq.write_table(pa.table({"body": texts[8:]}), tmp_path / "c.parquet")
    tok = load_tokenizer(str(tmp_path / "model"))  # an HF model directory: EOS from tokenizer_config.json
    assert tok.eos_id == 0 and tok.vocab_size <= 300
    paths = [str(tmp_path / n) for n in ("a.jsonl", "b.json", "c.parquet")]
    cfg = DataConfig(
        source="files", paths=paths, text_key="body", tokenizer=str(tmp_path / "model"), seq_len=8
    )
    corpus = load_corpus(cfg, tok, cache_dir=tmp_path / "cache")
    assert corpus.num_documents == 12
    train_docs = [t for i, t in enumerate(texts) if i % 50 != 49 and i != 11]  # the last document is held out
    expected = np.concatenate([np.append(tok.encode(t.encode()), tok.eos_id) for t in train_docs])
    np.testing.assert_array_equal(np.asarray(corpus.train.tokens), expected)
    assert isinstance(corpus.train.tokens, np.memmap)  # read back from the cache
    assert corpus.train.tokens.dtype == np.uint16  # ids below 2**16: two bytes a token on disk
    again = load_corpus(cfg, tok, cache_dir=tmp_path / "cache")
    np.testing.assert_array_equal(np.asarray(again.val.tokens), np.append(tok.encode(texts[11].encode()), 0))


def test_unreadable_tokenizers_and_missing_columns_are_errors_naming_them(tmp_path: Path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from plait.train.tokenizer import load_tokenizer

    with pytest.raises(ValueError, match=r"neither a tokenizer.json file nor a directory holding one"):
        load_tokenizer(str(tmp_path / "nothing"))
    _bpe_tokenizer(tmp_path / "tok", ["some text here"] * 3)
    with pytest.raises(ValueError, match=r"no end-of-document token named '<eos>'; set data.eos_token"):
        load_tokenizer(str(tmp_path / "tok" / "tokenizer.json"), "<eos>")
    pq.write_table(pa.table({"content": ["x" * 100]}), tmp_path / "d.parquet")
    with pytest.raises(ValueError, match=r"no column 'text' \(data.text_key\)"):
        load_corpus(DataConfig(source="files", paths=[str(tmp_path / "d.parquet")]))


def test_a_position_saved_over_another_corpus_is_refused():
    sampler = GlobalSampler(37, 2, 0, 1, seed=0, shuffle=True)
    with pytest.raises(ValueError, match="over 40 training sequences but this corpus has 37"):
        sampler.load_state_dict({"position": 8, "num_samples": 40})
    sampler.load_state_dict({"position": 8})  # a position from before num_samples was saved
    assert sampler.state_dict() == {"position": 8, "num_samples": 37}


def _jsonl_corpus(directory: Path, files: int, lines: int) -> list[Path]:
    paths = []
    for part in range(files):
        path = directory / f"part{part}.jsonl"
        rows = (
            json.dumps({"text": f"record {part}-{i}: " + "some words of the user's corpus " * 3})
            for i in range(lines)
        )
        path.write_text("\n".join(rows) + "\n")
        paths.append(path)
    return paths


def test_tokenizing_streams_into_the_cache_in_bounded_memory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    import tracemalloc

    from plait.train import data

    paths = _jsonl_corpus(tmp_path, files=3, lines=18_000)
    size = sum(p.stat().st_size for p in paths)
    assert size > 6_000_000
    monkeypatch.setattr(data, "FLUSH_TOKENS", 1 << 16)
    cfg = DataConfig(source="files", paths=[str(tmp_path / "*.jsonl")], seq_len=64)
    tracemalloc.start()
    try:
        corpus = load_corpus(cfg, cache_dir=tmp_path / "cache")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    # text and tokens of the whole corpus would be > 6 MB + 4 bytes a token; the bound is one
    # document and the split buffers (2**16 tokens each here), whatever the corpus size
    assert peak < 2_000_000, f"peak {peak:,} bytes while tokenizing {size:,} bytes"
    assert isinstance(corpus.train.tokens, np.memmap) and corpus.num_documents == 54_000
    assert corpus.train.tokens.dtype == np.uint16
    whole = load_corpus(cfg)  # the same tokens in memory, without a cache
    np.testing.assert_array_equal(np.asarray(corpus.train.tokens), whole.train.tokens)
    np.testing.assert_array_equal(np.asarray(corpus.val.tokens), whole.val.tokens)
    assert not list((tmp_path / "cache").glob("*/.*"))  # no temporary file left


def test_tokenizing_prints_progress_lines(tmp_path: Path):
    import re

    _jsonl_corpus(tmp_path, files=2, lines=2_000)
    cfg = DataConfig(source="files", paths=[str(tmp_path / "*.jsonl")], seq_len=64)
    lines: list[str] = []
    corpus = load_corpus(cfg, cache_dir=tmp_path / "cache", progress=lines.append, progress_every_s=0.0)
    tokens = len(corpus.train.tokens) + len(corpus.val.tokens)
    assert len(lines) == corpus.num_documents + 1  # one a document at every_s 0, then the last one
    assert re.fullmatch(r"tokenizing: \d+ B of [\d.]+ kB, \d+ tokens", lines[0]), lines[0]
    assert re.fullmatch(r"tokenizing: [\d.]+ kB of [\d.]+ kB, [\d.]+k tokens", lines[1_000]), lines[1_000]
    total = f"{sum(p.stat().st_size for p in tmp_path.glob('*.jsonl')) / 1e3:.1f} kB"
    assert re.fullmatch(rf"tokenized: {total} of {total}, {tokens / 1e3:.1f}k tokens in [\d.]+ s", lines[-1])
    quiet: list[str] = []
    load_corpus(cfg, cache_dir=tmp_path / "other", progress=quiet.append, progress_every_s=3600.0)
    assert quiet == []  # a corpus tokenized before the first interval prints nothing, no last line either
