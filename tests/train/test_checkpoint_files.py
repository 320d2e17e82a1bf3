"""Only complete checkpoints count: half-written directories are ignored on resume."""

from __future__ import annotations

import json
from pathlib import Path

from plait.train.checkpoint import META_FILE, complete_checkpoints, latest_checkpoint, step_dir_name


def _complete(root: Path, step: int) -> Path:
    path = root / step_dir_name(step)
    path.mkdir(parents=True)
    (path / ".metadata").write_bytes(b"x")
    (path / META_FILE).write_text(json.dumps({"complete": True, "step": step}))
    return path


def test_half_written_checkpoints_are_ignored(tmp_path: Path):
    assert latest_checkpoint(tmp_path / "missing") is None
    good = _complete(tmp_path, 3)
    (tmp_path / f".tmp-{step_dir_name(9)}").mkdir()  # a crash during the shard writes
    no_meta = tmp_path / step_dir_name(8)  # shards written, meta never written
    no_meta.mkdir()
    (no_meta / ".metadata").write_bytes(b"x")
    torn = tmp_path / step_dir_name(7)  # meta truncated mid-write
    torn.mkdir()
    (torn / META_FILE).write_text('{"complete": tr')
    unfinished = tmp_path / step_dir_name(6)
    unfinished.mkdir()
    (unfinished / META_FILE).write_text(json.dumps({"complete": False}))
    (tmp_path / "step_10").mkdir()  # not our naming
    assert complete_checkpoints(tmp_path) == [(3, good)]
    assert latest_checkpoint(tmp_path) == good
    newer = _complete(tmp_path, 12)
    assert latest_checkpoint(tmp_path) == newer
