"""Acceptance: an HF Llama on a local tokenizer.json and local JSON Lines, 4 ranks, killed and resumed.

One launch under ``launch.max_restarts: 1``: the first attempt checkpoints every 5 steps and one
of its ranks is killed (SIGKILL, from the test) once step 9 is logged; the second attempt resumes
from the newest complete checkpoint and finishes. The steps after that checkpoint ran in both
attempts, so the resumed losses are compared with the uninterrupted ones exactly, and each attempt
has its own section of metrics.jsonl and its own TensorBoard directory.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import yaml

from tests.train._ranks import run_killing_a_rank
from tests.train.test_cli import _env, _ok
from tests.train.test_data import _bpe_tokenizer

REPO = Path(__file__).resolve().parents[2]
WORDS = ["the", "model", "reads", "tokens", "packs", "documents", "shards", "weights", "and", "resumes"]


def _corpus(path: Path) -> list[str]:
    texts = [" ".join(WORDS[(i * 7 + j * 3) % len(WORDS)] for j in range(40 + i % 13)) for i in range(120)]
    path.write_text("\n".join(json.dumps({"text": t, "id": i}) for i, t in enumerate(texts)) + "\n")
    return texts


@pytest.mark.slow  # 4 ranks twice over: tools/slow_tests (test_hf_datasets and test_checkpoint_resume cover resume)
def test_hf_llama_on_a_local_tokenizer_and_jsonl_resumes_exactly_on_four_ranks(tmp_path: Path):
    texts = _corpus(tmp_path / "docs.jsonl")
    tokenizer = _bpe_tokenizer(tmp_path / "tok", texts, vocab_size=300)
    run_dir = tmp_path / "run"
    recipe = {
        "name": "hf_tok",
        "out_dir": str(run_dir),
        "model": {
            "source": "hf",
            "hf_class": "LlamaForCausalLM",
            "hf_config": {
                "vocab_size": 304,
                "hidden_size": 64,
                "intermediate_size": 128,
                "num_hidden_layers": 2,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "max_position_embeddings": 64,
                "tie_word_embeddings": False,
            },
        },
        "parallel": {"strategy": "fsdp2", "tp_size": 2, "sequence_parallel": True},
        "data": {"source": "files", "paths": [str(tmp_path / "*.jsonl")], "tokenizer": str(tokenizer)},
        "train": {"steps": 20, "val_every": 0, "val_batches": 1, "tensorboard": True},
        "optim": {"warmup_steps": 2},
        "checkpoint": {"every": 5, "keep": 1, "export": False},
        "launch": {"nproc_per_node": 4, "max_restarts": 1},
    }
    recipe["data"].update(seq_len=32, micro_batch_size=2)
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    args = [sys.executable, "-m", "plait.train", "--recipe", str(tmp_path / "recipe.yaml")]
    proc = run_killing_a_rank(args, cwd=REPO, env=_env(), run_dir=run_dir, step=9)
    _ok(proc)
    assert f"tokenizer {tokenizer}" in proc.stdout and "device cpu | backend gloo" in proc.stdout
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    starts = [i for i, r in enumerate(records) if r["kind"] == "run_start"]
    assert len(starts) == 2 and [records[i]["attempt"] for i in starts] == [0, 1]
    saved = [r["step"] for r in records[: starts[1]] if r["kind"] == "checkpoint"]
    resumed_at = next(r["step"] for r in records[starts[1] :] if r["kind"] == "resume")
    assert f"[resume] step={resumed_at}" in proc.stdout and "MFU n/a" in proc.stdout
    assert resumed_at in (saved[-1], saved[-1] + 5), (saved, resumed_at)  # the newest complete one
    first = {r["step"]: r for r in records[: starts[1]] if r["kind"] == "train"}
    second = {r["step"]: r for r in records[starts[1] :] if r["kind"] == "train"}
    assert sorted(first) == list(range(1, len(first) + 1)) and 9 <= len(first) < 20, sorted(first)
    assert sorted(second) == list(range(resumed_at + 1, 21))
    both = range(resumed_at + 1, len(first) + 1)  # ran in both attempts: 6-9 or more when killed at step 9
    assert len(both) >= 1 and [second[s]["loss"] for s in both] == [first[s]["loss"] for s in both]
    assert [second[s]["grad_norm"] for s in both] == [first[s]["grad_norm"] for s in both]
    assert second[20]["loss"] < first[1]["loss"] - 0.5
    fields = {"loss", "lr", "grad_norm", "step_time_s", "tokens_per_s", "tokens_per_s_per_device"}
    fields |= {"tflops_per_device", "mfu", "mem_mib", "time"}
    assert fields <= set(second[20]) and second[20]["mfu"] is None and second[20]["tflops_per_device"] > 0
    for attempt in ("attempt_0", "attempt_1"):
        assert list((run_dir / "tensorboard" / attempt).glob("events.out.tfevents.*")), attempt
