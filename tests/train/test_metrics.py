"""Rank-0 metrics: a line per step, JSONL records, a progress bar only on a terminal."""

from __future__ import annotations

import io
import json
from pathlib import Path

from plait.train.metrics import MetricsLogger

VALUES = {"loss": 2.5, "lr": 1e-3, "grad_norm": 0.5, "tokens_per_s": 1234.0, "mem_mib": 100.0}


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_lines_and_jsonl_without_a_bar_when_not_a_terminal(tmp_path: Path):
    out = io.StringIO()
    logger = MetricsLogger(tmp_path / "m.jsonl", total_steps=4, enabled=True, stream=out, log_every=2)
    for step in range(1, 5):
        logger.step(step, **VALUES)
    logger.validation(4, 2.0)
    logger.close()
    lines = out.getvalue().splitlines()
    assert (
        lines[0] == "step      2/4 | loss 2.5000 | lr 1.00e-03 | grad_norm 0.500 | tok/s 1,234 | mem 100 MiB"
    )
    assert len(lines) == 3 and "val_loss 2.0000" in lines[2] and "eta" not in out.getvalue()
    records = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4, 4]
    assert records[-1] == {"kind": "val", "step": 4, "val_loss": 2.0}


def test_progress_bar_with_eta_on_a_terminal(tmp_path: Path):
    out = _Terminal()
    logger = MetricsLogger(None, total_steps=4, enabled=True, stream=out)
    logger.step(1, **VALUES)
    logger.step(2, **VALUES)
    assert "[###############...............] 2/4 eta 0:00:0" in out.getvalue()
    logger.close()


def test_other_ranks_write_nothing(tmp_path: Path):
    out = io.StringIO()
    logger = MetricsLogger(tmp_path / "m.jsonl", total_steps=2, enabled=False, stream=out)
    logger.step(1, **VALUES)
    logger.info("summary")
    logger.close()
    assert out.getvalue() == "" and not (tmp_path / "m.jsonl").exists()
