"""Run paths: a run name is one path component; a run directory is never /, home or another's directory."""

from __future__ import annotations

from pathlib import Path

import pytest

from plait.train.cli import main
from plait.train.config import Recipe
from plait.train.errors import UserError, check_run_dir


def _refused(overrides: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """The one line ``validate`` refuses ``overrides`` with (exit 2)."""
    assert main(["validate", *[a for o in overrides for a in ("--set", o)]]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("plait-train: error: "), err
    return err[0]


@pytest.mark.parametrize("name", ["../../../tmp/escaped", "a/b", "..", ".", ""])
def test_a_run_name_must_be_one_path_component(
    name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    line = _refused([f"name={name!r}", f"out_dir={tmp_path}/runs/{{name}}"], capsys)
    assert f"name {name!r} must be one path component" in line, line
    with pytest.raises(ValueError, match="must be one path component"):
        Recipe(name=name)
    assert list(tmp_path.iterdir()) == []


def test_an_empty_out_dir_is_refused() -> None:
    with pytest.raises(ValueError, match="out_dir ' ' is empty"):
        Recipe(out_dir=" ")


def test_root_and_home_are_never_run_directories(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    assert "out_dir '/' is the filesystem root" in _refused(["out_dir=/"], capsys)
    assert "out_dir '/tmp/..' is the filesystem root" in _refused(["out_dir=/tmp/.."], capsys)
    assert f"out_dir '{home}' is your home directory" in _refused([f"out_dir={home}"], capsys)
    assert "is your home directory" in _refused([f"out_dir={home}/x/..", "name=x"], capsys)


def test_a_directory_holding_other_files_is_refused_a_run_directory_is_not(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    foreign = tmp_path / "photos"
    foreign.mkdir()
    (foreign / "cat.jpg").write_bytes(b"\xff\xd8")
    line = _refused([f"out_dir={foreign}"], capsys)
    assert f"out_dir '{foreign}' holds other files (cat.jpg) and is not a run directory" in line, line
    assert [p.name for p in foreign.iterdir()] == ["cat.jpg"]
    with pytest.raises(UserError, match="holds other files"):
        check_run_dir(foreign)
    (foreign / "metrics.jsonl").write_text("")  # a run wrote here: it is a run directory
    check_run_dir(foreign)
    empty = tmp_path / "empty"
    empty.mkdir()
    check_run_dir(empty)
    check_run_dir(tmp_path / "new" / "run")
