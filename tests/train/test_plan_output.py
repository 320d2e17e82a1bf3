"""``plan``'s output says what its figures assume: the traffic line names the batch it is for."""

from __future__ import annotations

import re

from plait.train.plan import plan
from plait.train.recipes import load_recipe

BATCH = ["data.micro_batch_size=3", "data.seq_len=64", "train.grad_accum=2"]


def _traffic_line(out: str) -> str:
    return next(line for line in out.splitlines() if line.startswith("communication per step"))


def test_the_traffic_line_names_the_micro_batch_sequence_and_global_batch_it_assumes():
    out = plan(load_recipe("fsdp_tp_sp", BATCH), 8)  # tp 2: dp 4
    line = _traffic_line(out)
    assert (
        "micro-batch 3 x seq 64 tokens, 2 micro-batches per step (train.grad_accum), "
        "global batch 24 sequences over dp 4" in line
    ), line
    assert re.search(r"\): [\d,.]+ (B|KiB|MiB|GiB|TiB)$", line), line


def test_the_tp_traffic_scales_with_the_tokens_the_line_names():
    def tp_bytes(micro: int) -> tuple[str, float]:
        out = plan(load_recipe("fsdp_tp_sp", [*BATCH, f"data.micro_batch_size={micro}"]), 4)
        row = re.search(r"^  tp_activations: ([\d,.]+) (KiB|MiB|GiB)$", out, re.M)
        assert row is not None, out
        scale = {"KiB": 1, "MiB": 1024, "GiB": 1024**2}[row.group(2)]
        return _traffic_line(out), float(row.group(1).replace(",", "")) * scale

    line2, two = tp_bytes(2)
    line4, four = tp_bytes(4)
    assert "micro-batch 2 x seq 64" in line2 and "micro-batch 4 x seq 64" in line4
    assert abs(four / two - 2) < 0.01, (two, four)
