"""Every shell command in README.md, apps/train/README.md and docs/*.md is run here, or listed with why not.

The fenced ``bash`` / ``sh`` / ``shell`` / ``console`` blocks are read (continuation lines joined,
comments dropped, ``console`` lines without ``$ `` taken as output). Each command must appear in
exactly one table below: ``RUN`` (run as written, in this process: ``uv run apps/train ARGS`` is
``plait.train.cli.main(ARGS)``), ``CHEAPER`` (it trains; its recipe and overrides are run through
``validate``, which makes every check a run makes at setup, instead), ``COVERED`` (run by another
test or by CI: the file that runs it must hold the given text) or ``SKIPPED`` (with the reason). A
command added to a doc and to no table fails :func:`test_every_doc_command_is_run_or_listed`; an
entry whose command left the docs fails it too.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Iterator
from pathlib import Path

import pytest

from plait.train.cli import main

REPO = Path(__file__).resolve().parents[2]
DOCS = [REPO / "README.md", REPO / "apps/train/README.md", *sorted((REPO / "docs").glob("*.md"))]
SHELL = {"bash", "sh", "shell", "console"}
APP = "uv run apps/train"

RUN: dict[str, str] = {
    # command -> text its output must hold (exit status 0)
    "uv run apps/train list": "llama3_8b ",
    "uv run apps/train show --recipe hsdp --set train.steps=50": "  steps: 50\n",
    "uv run apps/train validate --recipe hsdp --world-size 8": "recipe hsdp: ok on 8 rank(s)",
    "uv run apps/train plan --recipe llama3_8b --world-size 1024": "communication per step",
    "uv run apps/train validate --recipe llama3_8b --world-size 16": "recipe llama3_8b: ok on 16 rank(s)",
    "uv run apps/train plan --recipe llama3_8b --world-size 16": "memory per rank",
    "uv run apps/train plan --auto --recipe llama3_8b --nodes 1 --gpus-per-node 8 --gpu h100 --seq-len 8192 "
    "--global-tokens 131072 --consider dp_shard=8": "considered dp_shard=8",
    "uv run apps/train plan --auto --hf-config docs/examples/mixtral_8x22b_config.json --nodes 4 --seq-len 4096 "
    "--global-tokens 1048576 --consider pp=4,ep=8": "considered pp=4,ep=8",
}
CHEAPER: dict[str, tuple[str, list[str]]] = {
    # command -> (why it is not run as written, arguments added to `validate <its own arguments>`)
    "uv run apps/train": ("trains 200 steps on 4 ranks (minutes); test_cli.py trains it for 5 steps", []),
    "uv run apps/train --recipe hsdp --set train.steps=50": ("trains 50 steps on 4 ranks", []),
    "uv run apps/train --set train.steps=20 --set optim.lr=1e-3 --set model.arch.num_hidden_layers=2": (
        "trains 20 steps on 4 ranks, tokenizing the stdlib first",
        [],
    ),
    "uv run apps/train --set data.source=files --set 'data.paths=[notes/*.md, data.jsonl]'": (
        "trains 200 steps on the user's files (validated here with a notes/ and a data.jsonl of ours)",
        [],
    ),
    'torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint "$MASTER:29500" '
    "--rdzv-id run42 apps/train --recipe llama3_8b": ("needs 2 nodes of 8 GPUs", ["--world-size", "16"]),
    'torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint "$MASTER:29500" '
    "--rdzv-id my-run-42 apps/train --recipe llama3_8b": ("needs 2 nodes of 8 GPUs", ["--world-size", "16"]),
}
COVERED: dict[str, tuple[str, str]] = {
    # command -> (the file that runs it, text of that file that runs it)
    "uv run ruff check . && uv run ruff format --check .": (
        ".ci/run",
        "uv run --locked ruff format --check .",
    ),
    "uv run lint-imports": (".ci/run", "uv run --locked lint-imports"),
    "tools/test": (".ci/run", "tools/test || status=1"),
    "uv run --package plait-mesh --exact --group test pytest tests/mesh": (
        "tools/test",
        'uv run --locked --package "plait-$pkg" --exact --group test',
    ),
    "uv sync": (".ci/run", "uv sync --locked"),
    "uv venv && uv pip install torch dist/plait_mesh-*.whl dist/plait_sharding-*.whl dist/plait_tp-*.whl "
    "dist/plait_cp-*.whl dist/plait_float8-*.whl dist/plait_planner-*.whl dist/plait_strategies-*.whl "
    "dist/plait_sidecar-*.whl "
    "dist/plait_pipeline-*.whl dist/plait_models-*.whl dist/plait_train-*.whl": (
        "tests/train/test_docs.py",
        "def test_the_wheel_install_command_names_every_workspace_package_it_needs",
    ),
    ".venv/bin/plait-train list": (".ci/run", "venv/bin/plait-train list"),
    ".venv/bin/plait-train validate --recipe hsdp --world-size 8": (
        ".ci/run",
        "venv/bin/plait-train validate --recipe hsdp --world-size 8",
    ),
}
SKIPPED: dict[str, str] = {
    # command -> why it is not run here
    "uv run pytest": "the whole test suite (this file is part of it)",
    "uv run pytest tests/train": "the trainer's whole test suite (this file is part of it)",
    "bash .ci/run": "CI itself",
    "tools/slow_tests": "the slow-marked tests (torchrun restarts, inductor builds: minutes)",
    "pip install uv": "installs uv from the network",
    "pipx install uv": "installs uv from the network",
    "curl -LsSf https://astral.sh/uv/install.sh | sh": "installs uv from the network",
    "git clone <your plait remote> plait && cd plait": "a placeholder remote; needs the network",
}
_FENCE = re.compile(r"^\s*```(\S*)\s*$")
_COMMENT = re.compile(r"(?:^|\s+)#(?:\s.*)?$")
_LOOKS_LIKE_A_COMMAND = re.compile(
    r"^(\$ )?(uv|uvx|plait-train|torchrun|python3?|pip|pipx|git|bash|curl|tools/\S+|\.venv/bin/\S+) "
)


def _name(doc: Path) -> str:
    return str(doc.relative_to(REPO) if doc.is_relative_to(REPO) else doc)


def _blocks(text: str) -> Iterator[tuple[str, int, list[str]]]:
    """``(language, line number of the fence, lines)`` of every fenced block."""
    lang, start, lines = None, 0, []
    for number, line in enumerate(text.splitlines(), 1):
        fence = _FENCE.match(line)
        if fence is None:
            if lang is not None:
                lines.append(line)
        elif lang is None:
            lang, start, lines = fence.group(1), number, []
        else:
            yield lang, start, lines
            lang = None


def _commands(lang: str, lines: list[str]) -> list[str]:
    """The commands of one shell block: continuations joined, comments and output dropped."""
    if lang == "console":
        lines = [line[2:] for line in lines if line.startswith("$ ")]
    joined = "\n".join(lines).replace("\\\n", " ")
    found = []
    for line in joined.splitlines():
        command = " ".join(_COMMENT.sub("", line).split())
        if command:
            found.append(command)
    return found


def doc_commands() -> dict[str, list[str]]:
    """Every command of the docs' shell blocks -> where it is (``path:line`` of its block)."""
    found: dict[str, list[str]] = {}
    for doc in DOCS:
        for lang, start, lines in _blocks(doc.read_text()):
            if lang in SHELL:
                for command in _commands(lang, lines):
                    found.setdefault(command, []).append(f"{_name(doc)}:{start}")
    return found


def test_every_doc_command_is_run_or_listed() -> None:
    tables = [RUN, CHEAPER, COVERED, SKIPPED]
    listed = [c for table in tables for c in table]
    assert len(listed) == len(set(listed)), "a command is in two tables"
    commands = doc_commands()
    unlisted = {c: where for c, where in commands.items() if c not in listed}
    assert not unlisted, f"doc commands neither run nor listed in {Path(__file__).name}: {unlisted}"
    stale = sorted(set(listed) - set(commands))
    assert not stale, f"listed commands no doc holds any more: {stale}"


def test_no_untagged_block_holds_a_command() -> None:
    """A command in a block tagged otherwise (or not at all) would escape the check above."""
    hidden = [
        f"{_name(doc)}:{start}: {line.strip()}"
        for doc in DOCS
        for lang, start, lines in _blocks(doc.read_text())
        if lang not in SHELL | {"python"}
        for line in lines
        if _LOOKS_LIKE_A_COMMAND.match(line.strip())
    ]
    assert not hidden, f"tag these blocks ```bash: {hidden}"


def _run_cli(argv: list[str], cwd: Path, capsys: pytest.CaptureFixture[str], monkeypatch) -> str:
    """``plait-train ARGV`` in ``cwd`` (which holds a ``notes/``, a ``data.jsonl`` and the repo's ``docs/``)."""
    (cwd / "docs").symlink_to(REPO / "docs")  # commands name docs/examples/ files, run from the repo root
    (cwd / "notes").mkdir()
    (cwd / "notes" / "a.md").write_text("# notes\n")
    (cwd / "data.jsonl").write_text('{"text": "a document"}\n')
    monkeypatch.chdir(cwd)
    code = main(argv)
    out, err = capsys.readouterr()
    assert code == 0, f"plait-train {shlex.join(argv)}: exit {code}\n{out[-2000:]}\n{err[-2000:]}"
    return out


@pytest.mark.parametrize("command", sorted(RUN))
def test_a_cheap_doc_command_runs(command: str, tmp_path: Path, capsys, monkeypatch) -> None:
    assert command.startswith(APP + " "), command
    out = _run_cli(shlex.split(command.removeprefix(APP)), tmp_path, capsys, monkeypatch)
    assert RUN[command] in out, out[-3000:]


@pytest.mark.parametrize("command", sorted(CHEAPER), ids=lambda c: re.sub(r"[^\w.=/ -]", "", c))
def test_a_training_doc_command_passes_validate(command: str, tmp_path: Path, capsys, monkeypatch) -> None:
    own = shlex.split(command.split(" apps/train", 1)[1])
    out = _run_cli(["validate", *own, *CHEAPER[command][1]], tmp_path, capsys, monkeypatch)
    assert re.search(r"^recipe \w+: ok on \d+ rank\(s\)$", out, re.M), out


@pytest.mark.parametrize("command", sorted(COVERED))
def test_a_command_run_elsewhere_is_still_run_there(command: str) -> None:
    path, text = COVERED[command]
    assert text in (REPO / path).read_text(), f"{path} no longer runs {command!r} (looked for {text!r})"


def test_the_paths_the_commands_name_exist() -> None:
    tokens = {t for command in doc_commands() for t in shlex.split(command)}
    paths = [t for t in tokens if re.fullmatch(r"[\w.][\w.-]*(/[\w.-]+)+", t)]
    local = [p for p in paths if not p.startswith((".venv/", "dist/"))]
    assert "apps/train" in local
    missing = [p for p in local if not (REPO / p).exists()]
    assert not missing, missing
