"""Damaged, interrupted, foreign and concurrent checkpoints: each refused or skipped, nothing good lost."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from plait.testing import RankFailure, run_on_ranks
from plait.train.checkpoint import Checkpointer, CheckpointError, verify_checkpoint
from plait.train.compat import mismatch
from plait.train.recipes import load_recipe
from plait.train.runlock import RunLock
from tests.train._ckpt_jobs import SMALL, losses, train

TWO_SAVES = ["train.steps=4", "checkpoint.every=2", "checkpoint.keep=3"]


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-rank FSDP2 run with checkpoints at steps 2 and 4."""
    run_dir = tmp_path_factory.mktemp("saved") / "run"
    (result, _) = run_on_ranks(train, 2, str(run_dir), TWO_SAVES)
    assert result["error"] is None, result["error"]
    return run_dir


def _copy(saved: Path, run_dir: Path) -> Path:
    shutil.copytree(saved / "checkpoints", run_dir / "checkpoints")
    return run_dir / "checkpoints"


def _shard(step_dir: Path) -> Path:
    return max(step_dir.glob("*.distcp"), key=lambda p: p.stat().st_size)


def _truncate(step_dir: Path) -> Path:
    shard = _shard(step_dir)
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size // 2)
    return shard


def _flip(step_dir: Path) -> Path:
    shard = _shard(step_dir)  # the measured case: 4 KiB of 0xFF into the middle of a shard
    with open(shard, "r+b") as f:
        f.seek(shard.stat().st_size // 2 - 2048)
        f.write(b"\xff" * 4096)
    return shard


def _no_metadata(step_dir: Path) -> Path:
    (step_dir / ".metadata").unlink()
    return step_dir / ".metadata"


def _no_manifest(step_dir: Path) -> Path:
    (step_dir / "manifest.json").unlink()
    return step_dir / "manifest.json"


@pytest.mark.parametrize("damage", [_truncate, _flip, _no_metadata, _no_manifest])
def test_a_damaged_checkpoint_is_skipped_for_the_previous_one_with_one_warning(
    saved: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], damage: Callable[[Path], Path]
):
    root = _copy(saved, tmp_path / "run")
    bad = damage(root / "step_00000004")
    recipe = load_recipe(None, [*SMALL, f"out_dir={tmp_path / 'run'}"])
    path, manifest = Checkpointer(recipe, root).find()
    assert path == root / "step_00000002" and manifest["step"] == 2
    warning = capsys.readouterr().err.strip().splitlines()
    assert len(warning) == 1 and warning[0].startswith("plait-train: warning: skipping checkpoint"), warning
    assert str(bad) in warning[0]
    assert (root / "step_00000004").exists()  # kept for inspection, never loaded
    explicit = load_recipe(None, [*SMALL, f"checkpoint.resume_from={root / 'step_00000004'}"])
    with pytest.raises(CheckpointError, match=f"cannot be used: {bad}"):
        Checkpointer(explicit, root).find()


def test_flipped_bytes_resume_from_the_previous_checkpoint_on_two_ranks(saved: Path, tmp_path: Path):
    run_dir = tmp_path / "run"
    _flip(_copy(saved, run_dir) / "step_00000004")
    rank0, rank1 = run_on_ranks(train, 2, str(run_dir), ["train.steps=5", "checkpoint.every=0"])
    assert rank0["error"] is None and rank1["error"] is None
    assert sorted(rank0["samples"]) == [3, 4, 5]  # resumed at step 2, the intact one
    assert rank0["stderr"].count("warning: skipping checkpoint") == 1 and rank1["stderr"] == ""
    assert verify_checkpoint(run_dir / "checkpoints" / "step_00000005") == (
        verify_checkpoint(run_dir / "checkpoints" / "step_00000005")[0],
        None,
    )


def test_disk_full_during_a_save_removes_the_partial_directory_and_keeps_the_previous(
    saved: Path, tmp_path: Path
):
    size = sum(p.stat().st_size for p in (saved / "checkpoints" / "step_00000002").rglob("*") if p.is_file())
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size * 3 // 2}", "tmpfs", str(disk)])
    if mounted.returncode != 0:
        pytest.skip("cannot mount a small tmpfs here (needs root): disk-full path not exercised")
    try:
        run_dir = disk / "run"
        results = run_on_ranks(
            train, 2, str(run_dir), ["train.steps=4", "checkpoint.every=2", "checkpoint.keep=1"]
        )
        errors = {r["error"] for r in results}
        assert len(errors) == 1, errors
        (error,) = errors
        assert "\n" not in error and "checkpoint of step 4 failed: No space left on device" in error, error
        assert "removed the partial .tmp-step_00000004, kept step_00000002" in error
        names = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
        assert names == ["step_00000002"]
        assert verify_checkpoint(run_dir / "checkpoints" / "step_00000002")[1] is None
    finally:
        subprocess.run(["umount", "--lazy", str(disk)], check=True)  # a worker may still hold a file


def test_kill_9_during_a_save_leaves_the_previous_checkpoint_and_the_rerun_continues(tmp_path: Path):
    run_dir = tmp_path / "run"
    overrides = ["train.steps=4", "checkpoint.every=2", "checkpoint.keep=1"]
    with pytest.raises(RankFailure):
        run_on_ranks(train, 2, str(run_dir), overrides, 0, 4, timeout=120)
    root = run_dir / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == [".tmp-step_00000004", "step_00000002"]
    rank0, _ = run_on_ranks(train, 2, str(run_dir), overrides)
    assert rank0["error"] is None and sorted(rank0["samples"]) == [3, 4]
    assert sorted(p.name for p in root.iterdir()) == ["step_00000004"]  # the dead .tmp- is cleaned


def test_a_nan_loss_stops_the_run_before_it_saves_or_rotates(tmp_path: Path):
    run_dir = tmp_path / "run"
    overrides = ["train.steps=6", "checkpoint.every=1", "checkpoint.keep=1"]
    results = run_on_ranks(train, 2, str(run_dir), overrides, 3)
    for result in results:
        assert "step 3: loss nan / grad_norm nan is not finite" in result["error"], result["error"]
        assert sorted(result["samples"]) == [1, 2, 3]
    root = run_dir / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["step_00000002"]
    assert verify_checkpoint(root / "step_00000002")[1] is None


def test_a_checkpoint_of_another_shape_or_an_exhausted_step_count_is_refused(saved: Path, tmp_path: Path):
    run_dir = tmp_path / "run"
    _copy(saved, run_dir)
    (other,) = run_on_ranks(
        train,
        1,
        str(run_dir),
        [
            "parallel.tp_size=1",
            "train.steps=6",
            "model.arch.num_hidden_layers=3",
            "model.arch.intermediate_size=48",
        ],
    )
    assert "cannot resume this job: not in the checkpoint: model.layers.2." in other["error"], other["error"]
    assert (
        "shape differs: model.layers.0.mlp." in other["error"]
        and "(64, 32) saved vs (48, 32) now" in other["error"]
    )
    (done,) = run_on_ranks(train, 1, str(run_dir), ["parallel.tp_size=1", "train.steps=4"])
    assert "is at step 4 and train.steps is 4: nothing left to train" in done["error"], done["error"]
    assert "or start a separate run with --set name=<new name>" in done["error"], done["error"]
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step_00000002", "step_00000004"]


def test_the_sample_order_and_the_optimizer_must_match():
    saved = {
        "model": {"w": [2, 3]},
        "optimizer": "AdamW",
        "data_order": {"data.seq_len": 16, "train.seed": 0},
    }
    now = {"model": {"w": [2, 3]}, "optimizer": "SGD", "data_order": {"data.seq_len": 32, "train.seed": 0}}
    assert mismatch(saved, saved) is None
    assert mismatch(saved, now) == (
        "optimizer AdamW saved vs SGD now; the sample order changed: data.seq_len 16 saved vs 32 now"
    )


def test_a_second_job_on_the_same_run_directory_is_refused(tmp_path: Path):
    run_dir = tmp_path / "run"
    holder = RunLock(run_dir)
    try:
        (refused,) = run_on_ranks(train, 1, str(run_dir), ["parallel.tp_size=1", "train.steps=1"])
    finally:
        holder.release()
    assert "is in use by another job (pid" in refused["error"] and "\n" not in refused["error"]
    assert not (run_dir / "checkpoints").exists() and not (run_dir / "metrics.jsonl").exists()


def test_an_async_save_holds_the_step_it_was_taken_at(saved: Path, tmp_path: Path):
    """The async run's step-2 checkpoint, resumed, continues exactly like the synchronous run."""
    async_dir = tmp_path / "async"
    (result, _) = run_on_ranks(train, 2, str(async_dir), [*TWO_SAVES, "checkpoint.async_save=true"])
    assert result["error"] is None, result["error"]
    root = async_dir / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["step_00000002", "step_00000004"]
    assert all(verify_checkpoint(p)[1] is None for p in root.iterdir())
    resumed = tmp_path / "resumed"
    shutil.copytree(root / "step_00000002", resumed / "checkpoints" / "step_00000002")
    (again, _) = run_on_ranks(train, 2, str(resumed), ["train.steps=4", "checkpoint.every=0"])
    assert again["error"] is None and sorted(again["samples"]) == [3, 4]
    want, got = losses(saved), losses(resumed)
    assert [got[s] for s in (3, 4)] == pytest.approx([want[s] for s in (3, 4)], abs=1e-6)
