"""Every user error of the trainer's life is one line and exit 2, before anything is written or lost."""

from __future__ import annotations

from pathlib import Path

import pytest

from plait.train.cli import main
from plait.train.errors import UserError, report
from plait.train.recipes import load_recipe
from plait.train.trainer import run

SMALL = [
    "parallel.tp_size=1",
    "model.arch.hidden_size=64",
    "model.arch.intermediate_size=128",
    "model.arch.num_hidden_layers=2",
    "data.seq_len=32",
    "data.micro_batch_size=2",
    "data.max_bytes=100000",
    "train.val_batches=1",
    "train.steps=2",
]


def _sets(overrides: list[str]) -> list[str]:
    return [arg for o in overrides for arg in ("--set", o)]


def _one_line(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("plait-train: error: "), err
    return err[0]


@pytest.fixture
def solo(monkeypatch: pytest.MonkeyPatch) -> None:
    """Not under a launcher: failures before the launch are the launcher's one line."""
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)


def test_recipe_and_command_line_errors_are_one_line_before_anything_runs(
    solo: None, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "runs"
    deep = tmp_path / "deep.yaml"
    deep.write_text("a: " + "[" * 5000 + "]" * 5000 + "\n")
    latin1 = tmp_path / "latin1.yaml"
    latin1.write_bytes(b"name: caf\xe9\n")
    plan = ["plan", "--world-size", "8"]
    cases = [  # (command, arguments after the run directory, what the line must say)
        ([], _sets(["name=" + "n" * 300, f"out_dir={out}/{{name}}"]), "300-byte component"),
        ([], ["--recipe", str(latin1)], f"recipe '{latin1}': not UTF-8 text (byte 0xe9 at offset 9)"),
        ([], ["--recipe", str(deep)], f"'{deep}'"),
        ([], _sets([f"checkpoint.resume_from={tmp_path}/gone"]), f"resume_from '{tmp_path}/gone' is not"),
        ([], _sets(["launch.nproc_per_node=1000"]), "lower it, or set launch.oversubscribe: true"),
        ([], _sets(["parallel.options.tp_plan=os:system"]), "tp_plan 'os:system' is an import path"),
        (plan, _sets(["parallel.options.tp_plan=sys:exit"]), "pass --allow-imports if you trust"),
        ([], _sets(["parallel.options={unit_modules: [os.Exec]}"]), "unit_modules[0] 'os.Exec'"),
    ]
    for command, args, expected in cases:
        assert main([*command, *_sets([f"out_dir={out}"]), *args]) == 2, args
        line = _one_line(capsys)
        assert expected in line, line
    assert not out.exists()


def _fail_in_rank(overrides: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """Run the recipe on this process as a world of one; return the one line it fails with."""
    with pytest.raises(UserError) as caught:
        run(load_recipe(None, [*SMALL, *overrides]))
    assert report(caught.value) == 2
    return _one_line(capsys)


def test_set_up_errors_name_the_file_and_line(
    solo: None, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "run"
    weights = tmp_path / "weights"
    weights.mkdir()
    (weights / "model.safetensors").write_bytes(b"\x07" * 64)
    line = _fail_in_rank([f"out_dir={out}", f"model.pretrained_path={weights}"], capsys)
    assert f"model.pretrained_path '{weights}': not a valid .safetensors file" in line
    jsonl = tmp_path / "docs.jsonl"
    jsonl.write_text('{"text": "a\u2028b"}\n\n{"text": "ok"}\n{"text": broken\n', encoding="utf-8")
    data = ["data.source=files", f"data.paths=[{jsonl}]"]
    line = _fail_in_rank([f"out_dir={out}", *data], capsys)
    assert f"{jsonl}:4: not a JSON Lines record (Expecting value)" in line
    jsonl.write_bytes(b'{"text": "\xff"}\n')
    line = _fail_in_rank([f"out_dir={out}", *data], capsys)
    assert f"{jsonl}: not UTF-8 text (byte 0xff at offset 10)" in line
    assert not out.exists()
