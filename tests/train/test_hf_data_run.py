"""Acceptance: an HF Llama on a local tokenizer.json and local JSON Lines, 4 ranks, killed and resumed.

One launch under ``--max-restarts 1``: the first attempt checkpoints at step 5 and is killed at
step 10, the second resumes from step 5 and finishes. Steps 6-9 ran in both attempts, so the
resumed losses are compared with the uninterrupted ones exactly, and each attempt has its own
section of metrics.jsonl and its own TensorBoard directory.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import yaml

from tests.train.test_cli import _env, _ok
from tests.train.test_data import _bpe_tokenizer

REPO = Path(__file__).resolve().parents[2]
WORDS = ["the", "model", "reads", "tokens", "packs", "documents", "shards", "weights", "and", "resumes"]


def _corpus(path: Path) -> list[str]:
    texts = [" ".join(WORDS[(i * 7 + j * 3) % len(WORDS)] for j in range(40 + i % 13)) for i in range(120)]
    path.write_text("\n".join(json.dumps({"text": t, "id": i}) for i, t in enumerate(texts)) + "\n")
    return texts


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
        "train": {"steps": 12, "val_every": 0, "val_batches": 1, "tensorboard": True},
        "optim": {"warmup_steps": 2},
        "checkpoint": {"every": 5, "keep": 1, "export": False},
        "launch": {"nproc_per_node": 4, "max_restarts": 1},
    }
    recipe["data"].update(seq_len=32, micro_batch_size=2)
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    proc = subprocess.run(
        [sys.executable, "-m", "plait.train", "--recipe", str(tmp_path / "recipe.yaml")],
        cwd=REPO,
        env=_env(PLAIT_TRAIN_FAIL_AT_STEP="10"),
        capture_output=True,
        text=True,
        timeout=400,
    )
    _ok(proc)
    assert f"tokenizer {tokenizer}" in proc.stdout and "device cpu | backend gloo" in proc.stdout
    assert "[resume] step=5" in proc.stdout and "MFU n/a" in proc.stdout
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    starts = [i for i, r in enumerate(records) if r["kind"] == "run_start"]
    assert len(starts) == 2 and [records[i]["attempt"] for i in starts] == [0, 1]
    first = {r["step"]: r for r in records[: starts[1]] if r["kind"] == "train"}
    second = {r["step"]: r for r in records[starts[1] :] if r["kind"] == "train"}
    assert sorted(first) == list(range(1, 10)) and sorted(second) == list(range(6, 13))
    assert [second[s]["loss"] for s in range(6, 10)] == [first[s]["loss"] for s in range(6, 10)]
    assert [second[s]["grad_norm"] for s in range(6, 10)] == [first[s]["grad_norm"] for s in range(6, 10)]
    assert second[12]["loss"] < first[1]["loss"] - 0.5
    fields = {"loss", "lr", "grad_norm", "step_time_s", "tokens_per_s", "tokens_per_s_per_device"}
    fields |= {"tflops_per_device", "mfu", "mem_mib", "time"}
    assert fields <= set(second[12]) and second[12]["mfu"] is None and second[12]["tflops_per_device"] > 0
    for attempt in ("attempt_0", "attempt_1"):
        assert list((run_dir / "tensorboard" / attempt).glob("events.out.tfevents.*")), attempt
