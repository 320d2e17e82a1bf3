"""The local launcher's reports on real ranks: one line per error, the ranks named, tracebacks kept."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np

from plait.train.data import corpus_fingerprint
from plait.train.recipes import load_recipe
from plait.train.tokenizer import load_tokenizer
from tests.train._ranks import run_killing_a_rank
from tests.train.test_reliability_ranks import LONG, REPO, SMALL


def _args(overrides: list[str]) -> list[str]:
    return [sys.executable, "-m", "plait.train", *[a for o in overrides for a in ("--set", o)]]


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    return {**env, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def _run(overrides: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(_args(overrides), cwd=REPO, env=_env(), capture_output=True, text=True, timeout=400)


def _errors(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("plait-train: error: ")]


def test_an_error_of_every_rank_is_one_line_naming_them_and_a_refused_resume_writes_nothing(
    tmp_path: Path,
) -> None:
    run_dir, empty = tmp_path / "run", tmp_path / "empty"
    empty.mkdir()
    run_dir.mkdir()
    before = {
        "recipe.yaml": "name: an earlier run\n",
        "metrics.jsonl": '{"kind": "run_start", "attempt": 0}\n',
    }
    for name, text in before.items():
        (run_dir / name).write_text(text)
    # Every rank refuses the checkpoint to resume from, after the launch: the same line on each.
    proc = _run([*SMALL, f"out_dir={run_dir}", f"checkpoint.resume_from={empty}"])
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = _errors(proc.stderr)
    assert len(lines) == 1 and lines[0].endswith("(on ranks 0-1)"), proc.stderr[-3000:]
    assert f"checkpoint.resume_from '{empty}' cannot be used" in lines[0]
    assert "plait-train: 2 of 2 ranks failed (ranks 0-1: exit code 2); 0 restart(s) made" in proc.stderr
    assert {name: (run_dir / name).read_text() for name in before} == before


def test_a_killed_rank_is_named_with_its_signal(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = run_killing_a_rank(
        _args([*LONG, f"out_dir={run_dir}"]), cwd=REPO, env=_env(), run_dir=run_dir, step=2
    )
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "plait-train: rank 1 was killed by SIGKILL" in proc.stderr, proc.stderr[-3000:]
    assert "1 of 2 ranks failed (rank 1: SIGKILL); rank 0 stopped after it" in proc.stderr
    assert _errors(proc.stderr) == [] and "Traceback" not in proc.stderr, proc.stderr[-3000:]


def test_an_internal_error_on_one_rank_prints_its_traceback_once_and_keeps_it(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    overrides = [*SMALL, f"out_dir={run_dir}"]
    recipe = load_recipe(None, overrides)
    tokenizer = load_tokenizer(recipe.data.tokenizer, recipe.data.eos_token)
    # A token cache whose meta.json lacks its "extent": local rank 0, which reads the cache first
    # (the others wait for it in a collective), fails with a KeyError, an internal error.
    cache = run_dir / "token_cache" / corpus_fingerprint(recipe.data, tokenizer)
    cache.mkdir(parents=True)
    for split in ("train", "val"):
        np.save(cache / f"{split}.npy", np.zeros(256, np.int32))
    (cache / "meta.json").write_text("{}")
    proc = _run(overrides)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert proc.stderr.count("Traceback (most recent call last)") == 1, proc.stderr[-3000:]
    assert "KeyError: 'extent'" in proc.stderr
    kept = run_dir / "errors" / "rank_0.txt"
    assert "KeyError: 'extent'" in kept.read_text() and not (run_dir / "errors" / "rank_1.txt").exists()
    lines = _errors(proc.stderr)
    assert lines == [
        f"plait-train: error: internal error (KeyError), traceback above; kept in {kept}",
        "plait-train: error: internal error (KeyError), traceback above (on rank 0)",
    ], proc.stderr[-3000:]
    assert "1 of 2 ranks failed (rank 0: exit code 1); rank 1 stopped after it" in proc.stderr
