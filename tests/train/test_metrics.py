"""Rank-0 metrics: a line per step, JSONL records in one section per attempt, TensorBoard, a bar on a tty."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import torch
from torch import nn

from plait.train.metrics import MetricsLogger, flops_per_token, peak_tflops, throughput

VALUES = {"loss": 2.5, "lr": 1e-3, "grad_norm": 0.5, "tokens_per_s": 1234.0, "mem_mib": 100.0}


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_lines_and_jsonl_sections_per_attempt_without_a_bar_when_not_a_terminal(tmp_path: Path):
    out = io.StringIO()
    speed = throughput(8000.0, 2.0, 4, flops_per_token=1e9, peak=None)
    assert speed == {
        "step_time_s": 2.0,
        "tokens_per_s": 4000.0,
        "tokens_per_s_per_device": 1000.0,
        "tflops_per_device": 1.0,
        "mfu": None,
    }
    for _ in range(2):  # a re-run opens a new section, never a silent append
        logger = MetricsLogger(
            tmp_path / "m.jsonl", total_steps=4, enabled=True, stream=out, log_every=2, run_info={"name": "x"}
        )
        for step in range(1, 5):
            logger.step(step, **{**VALUES, **speed})
        logger.validation(4, 2.0)
        logger.close()
    lines = out.getvalue().splitlines()
    assert lines[1] == (
        "step      2/4 | loss 2.5000 | lr 1.00e-03 | grad_norm 0.500 | 2,000 ms | tok/s 4,000 | "
        "tok/s/dev 1,000 | TFLOPs/dev 1.00 | MFU n/a | mem 100 MiB"
    )
    assert len(lines) == 8 and "val_loss 2.0000" in lines[3] and "eta" not in out.getvalue()
    records = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    starts = [i for i, r in enumerate(records) if r["kind"] == "run_start"]
    assert starts == [0, 6] and [records[i]["attempt"] for i in starts] == [0, 1]
    assert records[0]["name"] == "x"
    assert [r["step"] for r in records[1:6]] == [1, 2, 3, 4, 4]
    assert records[5]["kind"] == "val" and records[5]["val_loss"] == 2.0
    assert all("T" in r["time"] and r["time"].endswith("+00:00") for r in records)
    assert records[1]["mfu"] is None and records[1]["tokens_per_s_per_device"] == 1000.0


@pytest.mark.parametrize(
    ("first", "total", "printed"),
    [(1, 200, [1, *range(10, 201, 10)]), (7, 25, [7, 10, 20, 25]), (1, 1, [1]), (30, 30, [30])],
)
def test_every_log_every_th_step_is_printed_and_the_first_and_last_always(
    first: int, total: int, printed: list[int]
):
    out = io.StringIO()
    logger = MetricsLogger(None, total_steps=total, enabled=True, stream=out, log_every=10)
    for step in range(first, total + 1):  # a resumed attempt starts after its checkpoint's step
        logger.step(step, **VALUES)
    assert [int(line.split()[1].split("/")[0]) for line in out.getvalue().splitlines()] == printed


def test_progress_bar_with_eta_on_a_terminal(tmp_path: Path):
    out = _Terminal()
    logger = MetricsLogger(None, total_steps=4, enabled=True, stream=out)
    logger.step(1, **VALUES)
    logger.step(2, **VALUES)
    assert "[###############...............] 2/4 eta 0:00:0" in out.getvalue()
    logger.close()


def test_other_ranks_write_nothing(tmp_path: Path):
    out = io.StringIO()
    logger = MetricsLogger(
        tmp_path / "m.jsonl", total_steps=2, enabled=False, stream=out, tensorboard_dir=tmp_path / "tb"
    )
    logger.step(1, **VALUES)
    logger.info("summary")
    logger.close()
    assert out.getvalue() == "" and not (tmp_path / "m.jsonl").exists() and not (tmp_path / "tb").exists()


def test_tensorboard_sink_writes_one_event_directory_per_attempt(tmp_path: Path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    for _ in range(2):
        logger = MetricsLogger(
            tmp_path / "m.jsonl",
            total_steps=2,
            enabled=True,
            stream=io.StringIO(),
            tensorboard_dir=tmp_path / "tb",
        )
        logger.step(1, **VALUES)
        logger.step(2, **{**VALUES, "loss": 2.0})
        logger.close()
    assert sorted(p.name for p in (tmp_path / "tb").iterdir()) == ["attempt_0", "attempt_1"]
    events = EventAccumulator(str(tmp_path / "tb" / "attempt_1")).Reload()
    assert [(e.step, e.value) for e in events.Scalars("train/loss")] == [(1, 2.5), (2, 2.0)]


def test_flops_per_token_and_the_peak_table():
    model = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 4, bias=False))
    model.get_input_embeddings = lambda: model[0]  # an HF-style accessor
    model.config = type("C", (), {"num_hidden_layers": 2, "hidden_size": 4})()
    assert flops_per_token(model, seq_len=8) == 6 * 16 + 12 * 2 * 4 * 8
    assert peak_tflops(torch.device("cpu")) is None
