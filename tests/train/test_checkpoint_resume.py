"""Resume anywhere: a checkpoint of dp_shard=2 x tp=2 continues at dp_shard=4, on 2 ranks and on 1.

HSDP, expert-parallel, pp 2 x cp 2, pp 2 x ep 2 and tp 2 x cp 2 checkpoints resume at other meshes too.

The global batch stays 4 sequences (micro-batch x dp x accumulation), so an uninterrupted run at
the new mesh is the reference: its losses after the resume step and the samples of every step
must be those of the resumed run.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from plait.testing import run_on_ranks
from tests.train._ckpt_jobs import losses, train

SAVED_AT = ["parallel.tp_size=2", "data.micro_batch_size=2", "train.steps=6", "checkpoint.every=3"]
NEW_MESHES = {
    "dp_shard=4": (
        4,
        ["parallel.tp_size=1", "data.micro_batch_size=1", "train.steps=6", "checkpoint.every=3"],
    ),
    "world 2": (2, ["parallel.tp_size=1", "data.micro_batch_size=2", "train.steps=6", "checkpoint.every=3"]),
    "world 1": (1, ["parallel.tp_size=1", "data.micro_batch_size=2", "train.grad_accum=2", "train.steps=6"]),
}


def _one(results: list[dict]) -> dict:
    assert all(r["error"] is None for r in results), [r["error"] for r in results]
    return results[0]


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    run_dir = tmp_path_factory.mktemp("saved") / "run"
    result = _one(run_on_ranks(train, 4, str(run_dir), SAVED_AT))
    return run_dir, result


@pytest.mark.parametrize("mesh", list(NEW_MESHES))
def test_resume_at_another_mesh_matches_an_uninterrupted_run_there(saved, mesh: str, tmp_path: Path):
    old_dir, old = saved
    world, overrides = NEW_MESHES[mesh]
    resumed_dir = tmp_path / "resumed"
    shutil.copytree(old_dir / "checkpoints" / "step_00000003", resumed_dir / "checkpoints" / "step_00000003")
    resumed = _one(run_on_ranks(train, world, str(resumed_dir), overrides))
    reference = _one(run_on_ranks(train, world, str(tmp_path / "reference"), overrides))

    assert sorted(resumed["samples"]) == [4, 5, 6]
    consumed = {**{s: old["samples"][s] for s in (1, 2, 3)}, **resumed["samples"]}
    assert consumed == reference["samples"]  # the same samples at every step: none twice, none skipped
    got, want = losses(resumed_dir), losses(tmp_path / "reference")
    assert sorted(got) == [4, 5, 6]
    for step in (4, 5, 6):
        assert got[step] == pytest.approx(want[step], abs=1e-5), (step, got, want)


HSDP_TO_FSDP = (
    4,
    ["parallel.dp_replicate_size=2", "parallel.tp_size=1", "data.micro_batch_size=1"],
    2,
    ["parallel.tp_size=1", "data.micro_batch_size=2"],
)
EP_TO_ONE = (
    2,
    ["model.source=moe", "parallel.ep_size=2", "parallel.tp_size=1", "data.micro_batch_size=2"],
    1,
    ["model.source=moe", "parallel.tp_size=1", "data.micro_batch_size=2", "train.grad_accum=2"],
)

PP_CP_TO_FSDP = (
    4,
    ["parallel.pp_size=2", "parallel.cp_size=2", "parallel.tp_size=1", "data.micro_batch_size=4"],
    4,
    ["parallel.tp_size=1", "data.micro_batch_size=1"],
)
"""Two stages, each context-parallel over 2 ranks, to dp_shard 4: the same 4 sequences a step."""

PP_EP_TO_ONE_STAGE = (
    4,
    [
        "model.source=moe",
        "parallel.pp_size=2",
        "parallel.ep_size=2",
        "parallel.tp_size=1",
        "data.micro_batch_size=2",
    ],
    2,
    ["model.source=moe", "parallel.tp_size=1", "data.micro_batch_size=2"],
)
"""The MoE model in two stages with experts over ep 2 (dp_shard 2), to plain FSDP on 2 ranks."""

TP_CP_TO_PP = (
    4,
    ["parallel.tp_size=2", "parallel.cp_size=2", "data.micro_batch_size=4"],
    2,
    ["parallel.pp_size=2", "parallel.tp_size=1", "data.micro_batch_size=4"],
)
"""tp 2 x cp 2 (one replica) to two pipeline stages: 4 sequences a step on both."""


@pytest.mark.parametrize(
    ("saved_world", "saved_at", "world", "resumed_at"),
    [HSDP_TO_FSDP, EP_TO_ONE, PP_CP_TO_FSDP, PP_EP_TO_ONE_STAGE, TP_CP_TO_PP],
    ids=["hsdp", "ep", "pp2 x cp2", "pp2 x ep2", "tp2 x cp2"],
)
def test_hsdp_and_expert_parallel_checkpoints_resume_elsewhere(
    saved_world: int, saved_at: list[str], world: int, resumed_at: list[str], tmp_path: Path
):
    common = ["train.steps=4", "checkpoint.every=2"]
    old = _one(run_on_ranks(train, saved_world, str(tmp_path / "saved"), [*saved_at, *common]))
    resumed_dir = tmp_path / "resumed"
    shutil.copytree(
        tmp_path / "saved" / "checkpoints" / "step_00000002", resumed_dir / "checkpoints" / "step_00000002"
    )
    resumed = _one(run_on_ranks(train, world, str(resumed_dir), [*resumed_at, *common]))
    reference = _one(run_on_ranks(train, world, str(tmp_path / "reference"), [*resumed_at, *common]))
    assert {**{s: old["samples"][s] for s in (1, 2)}, **resumed["samples"]} == reference["samples"]
    got, want = losses(resumed_dir), losses(tmp_path / "reference")
    assert sorted(got) == [3, 4]
    assert [got[s] for s in (3, 4)] == pytest.approx([want[s] for s in (3, 4)], abs=1e-5)
