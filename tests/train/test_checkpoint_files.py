"""Only checkpoints with a whole manifest count; the manifest catches every changed byte."""

from __future__ import annotations

from pathlib import Path

import pytest

from plait.train.checkpoint import complete_checkpoints, latest_checkpoint, step_dir_name, verify_checkpoint
from plait.train.integrity import MANIFEST_FILE, NonFiniteError, check_finite, file_digest, write_manifest


def _complete(root: Path, step: int) -> Path:
    path = root / step_dir_name(step)
    path.mkdir(parents=True)
    (path / ".metadata").write_bytes(b"metadata")
    (path / "__0_0.distcp").write_bytes(bytes(range(256)) * 8)
    files = {name: file_digest(path / name) for name in (".metadata", "__0_0.distcp")}
    write_manifest(path, step, files, {"data": {"position": step}})
    return path


def test_half_written_checkpoints_are_ignored(tmp_path: Path):
    assert latest_checkpoint(tmp_path / "missing") is None
    good = _complete(tmp_path, 3)
    (tmp_path / f".tmp-{step_dir_name(9)}").mkdir()  # a crash during the shard writes
    no_manifest = tmp_path / step_dir_name(8)  # shards written, manifest never written
    no_manifest.mkdir()
    (no_manifest / ".metadata").write_bytes(b"x")
    torn = tmp_path / step_dir_name(7)  # manifest truncated mid-write
    torn.mkdir()
    (torn / MANIFEST_FILE).write_text('{"format": "plait-checkpoint/1", "st')
    (tmp_path / "step_10").mkdir()  # not our naming
    assert complete_checkpoints(tmp_path) == [(3, good)]
    assert latest_checkpoint(tmp_path) == good
    newer = _complete(tmp_path, 12)
    assert latest_checkpoint(tmp_path) == newer


def test_verify_names_the_first_changed_file(tmp_path: Path):
    path = _complete(tmp_path, 1)
    manifest, problem = verify_checkpoint(path)
    assert problem is None and manifest["meta"] == {"data": {"position": 1}}
    shard = path / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[1000] ^= 1  # one bit, same size
    shard.write_bytes(bytes(data))
    assert verify_checkpoint(path) == (
        None,
        f"{shard} does not match its SHA-256 in the manifest (changed after the save)",
    )
    shard.write_bytes(bytes(data[:100]))
    assert verify_checkpoint(path) == (None, f"{shard} has 100 bytes, the manifest says 2048")
    (path / MANIFEST_FILE).unlink()
    assert "missing or unreadable" in verify_checkpoint(path)[1]


def test_check_finite_names_the_step():
    check_finite(3, 1.5, 0.2)
    for loss, norm in ((float("nan"), 1.0), (1.0, float("inf"))):
        with pytest.raises(NonFiniteError, match=f"^step 7: loss {loss} / grad_norm {norm} is not finite"):
            check_finite(7, loss, norm)
