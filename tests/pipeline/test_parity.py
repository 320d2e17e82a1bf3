"""`pipeline_model` on real gloo ranks: loss, every gradient and params after 2 SGD steps vs unsharded.

Lean on purpose (a few configurations per multi-rank body); the full acceptance matrix (pp=4,
pp x dp_shard x tp on 8 ranks, every schedule) is `tools/pipeline_matrix.py`.
"""

from __future__ import annotations

import pytest
import torch

from plait.mesh import FSDP2Config, MeshContext, ParallelismSizes
from plait.pipeline import PipelineConfig, pipeline_model
from plait.sidecar import parallelize_model
from plait.testing import Parity, assert_parity, lm_loss, pipeline_decoder, pipeline_parity, run_on_ranks


def _cases(cases: list[tuple]) -> list[Parity]:
    return [pipeline_parity(*case) for case in cases]


def test_two_stages_every_schedule_family_dense_llama_moe() -> None:
    pp2 = ParallelismSizes(pp_size=2)
    cases = [
        ("dense 1f1b", "dense", 4, pp2, PipelineConfig(schedule="1f1b", layers_per_stage=(1, 3))),
        ("dense interleaved_1f1b", "dense", 4, pp2, PipelineConfig(schedule="interleaved_1f1b")),
        ("dense zbv_zero_bubble", "dense", 4, pp2, PipelineConfig(schedule="zbv_zero_bubble")),
        ("llama 1f1b", "llama", 4, pp2, PipelineConfig(schedule="1f1b", microbatches=4)),
        ("moe gpipe", "moe", 4, pp2, PipelineConfig(schedule="gpipe")),
    ]
    results = run_on_ranks(_cases, 2, cases, timeout=600)
    assert_parity(results)
    assert [r.extra["stage_indices"] for r in results[0]] == [[0], [0, 2], [0, 3], [0], [0]]
    for i, case in enumerate(cases):
        total = len(list(pipeline_decoder(case[1], case[2]).parameters()))
        assert results[0][i].grads_compared + results[1][i].grads_compared == total, case[0]


def test_two_stages_with_fsdp_and_with_tp_on_four_ranks() -> None:
    cases = [
        ("pp2 x dp_shard2 1f1b", "dense", 4, ParallelismSizes(pp_size=2), PipelineConfig(schedule="1f1b")),
        (
            "pp2 x tp2 interleaved_1f1b llama",
            "llama",
            4,
            ParallelismSizes(pp_size=2, tp_size=2),
            PipelineConfig(schedule="interleaved_1f1b"),
        ),
    ]
    results = run_on_ranks(_cases, 4, cases, timeout=600)
    assert_parity(results)
    for rank in results:  # FSDP's PP rule: no unit reshards after forward
        units = rank[0].extra
        assert units["fsdp_units"] >= 3 and units["resharded_after_forward"] == 0, rank[0]


def _refusals() -> list[str]:
    """Bad input raises the same error on every rank, before any collective (nothing would hang)."""
    messages = []
    torch.manual_seed(0)
    ctx = MeshContext.build(FSDP2Config(mp_policy=None), ParallelismSizes(pp_size=2))
    for call in (
        lambda: parallelize_model(pipeline_decoder("dense", 2), ctx),
        lambda: pipeline_model(
            pipeline_decoder("dense", 2), ctx, lm_loss, PipelineConfig(schedule="interleaved_1f1b")
        ),
    ):
        try:
            call()
        except ValueError as err:
            messages.append(str(err))
    pipe = pipeline_model(pipeline_decoder("dense", 2), ctx, lm_loss, PipelineConfig(microbatches=2))
    ids = torch.zeros(3, 8, dtype=torch.long)
    try:
        pipe.step(ids, ids)
    except ValueError as err:
        messages.append(str(err))
    return messages


def test_bad_input_is_refused_on_every_rank() -> None:
    results = run_on_ranks(_refusals, 2)
    assert results[0] == results[1] and len(results[0]) == 3, results
    assert "call plait.pipeline.pipeline_model" in results[0][0]
    assert "4 pipeline stages but DenseDecoder has only 2 layers" in results[0][1]
    assert "does not split into microbatches=2" in results[0][2]


def test_pp_with_ddp_is_refused(fake_pg) -> None:
    from plait.mesh import DDPConfig

    with fake_pg(4), pytest.raises(ValueError, match="DDP does not support pp_size=2"):
        MeshContext.build(DDPConfig(), ParallelismSizes(pp_size=2))  # the table, before any mesh exists


def _step_without_positions() -> str:
    ctx = MeshContext.build(FSDP2Config(mp_policy=None), ParallelismSizes(pp_size=2, cp_size=2))
    pipe = pipeline_model(pipeline_decoder("dense", 2), ctx, lm_loss, PipelineConfig(microbatches=2))
    ids = torch.zeros(2, 4, dtype=torch.long)  # this cp rank's half of 8 tokens, but no position_ids
    with pytest.raises(ValueError) as info:
        pipe.step(ids, ids)
    return str(info.value)


def test_a_cp_step_without_positions_is_refused_on_every_rank() -> None:
    """The stage-1 ranks refuse too, instead of waiting for the first stage's activations."""
    for message in run_on_ranks(_step_without_positions, 4):
        assert "under cp_size=2 needs position_ids=" in message, message
