"""A crafted checkpoint pickle is refused by name: nothing it names is imported or called."""

from __future__ import annotations

import io
import pickle
import shutil
from pathlib import Path

import pytest
import torch

from plait.testing import run_on_ranks
from plait.train.errors import UserError
from plait.train.integrity import file_digest, read_manifest, write_manifest
from plait.train.safe_reader import SafeLoadPlanner, UnsafeCheckpointError, read_metadata
from tests.train._ckpt_jobs import train

_UNIMPORTED = "xmlrpc.server"
"""A standard-library module nothing in a training job imports: the crafted pickle names it."""


def _crafted(module: str, name: str, argument: str) -> bytes:
    """A protocol-2 pickle that calls ``module.name(argument)`` when loaded."""
    return b"\x80\x02c" + f"{module}\n{name}\n".encode() + pickle.dumps((argument,), protocol=2)[2:-1] + b"R."


def _tamper(step_dir: Path, payload: bytes) -> None:
    """Replace ``.metadata`` and re-record it in the manifest, as an attacker who can write the directory."""
    (step_dir / ".metadata").write_bytes(payload)
    manifest = read_manifest(step_dir)
    assert manifest is not None
    manifest["files"][".metadata"] = file_digest(step_dir / ".metadata")
    write_manifest(step_dir, manifest["step"], manifest["files"], manifest["meta"])


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-rank run with one checkpoint, at step 2."""
    run_dir = tmp_path_factory.mktemp("pickle") / "run"
    (result, _) = run_on_ranks(train, 2, str(run_dir), ["train.steps=2", "checkpoint.every=2"])
    assert result["error"] is None, result["error"]
    return run_dir


def test_a_crafted_metadata_pickle_is_refused_in_one_line_on_every_rank(saved: Path, tmp_path: Path):
    run_dir = tmp_path / "run"
    shutil.copytree(saved, run_dir)
    marker = tmp_path / "code-ran"
    _tamper(run_dir / "checkpoints" / "step_00000002", _crafted("posix", "system", f"touch {marker}"))
    for result in run_on_ranks(train, 2, str(run_dir), ["train.steps=3"]):
        error = result["error"]
        assert error is not None and "\n" not in error, error
        assert "names posix.system, which DCP's metadata never holds; it was not loaded" in error, error
    assert not marker.exists()


def test_a_refused_global_is_never_imported(saved: Path, tmp_path: Path):
    run_dir = tmp_path / "run"
    shutil.copytree(saved, run_dir)
    _tamper(run_dir / "checkpoints" / "step_00000002", _crafted(_UNIMPORTED, "SimpleXMLRPCServer", "x"))
    for result in run_on_ranks(train, 2, str(run_dir), ["train.steps=3"]):
        assert f"names {_UNIMPORTED}.SimpleXMLRPCServer" in result["error"], result["error"]
        assert _UNIMPORTED not in result["modules"]


def test_the_saved_metadata_reads_back_and_a_resume_continues(saved: Path, tmp_path: Path):
    step_dir = saved / "checkpoints" / "step_00000002"
    assert set(read_metadata(step_dir).state_dict_metadata) >= {"model.lm_head.weight"}
    run_dir = tmp_path / "run"
    shutil.copytree(saved, run_dir)
    rank0, _ = run_on_ranks(train, 2, str(run_dir), ["train.steps=3"])
    assert rank0["error"] is None and sorted(rank0["samples"]) == [3]


def test_garbage_metadata_is_a_one_line_error(tmp_path: Path):
    (tmp_path / ".metadata").write_bytes(b"\x80\x04not a pickle")
    with pytest.raises(UserError, match="is not DCP metadata"):
        read_metadata(tmp_path)


def test_byte_entries_load_only_plain_data():
    planner = SafeLoadPlanner()
    planner.set_up_planner({"groups": None}, None, True)
    plain = io.BytesIO()
    torch.save([{"lr": 0.1, "betas": (0.9, 0.95), "params": ["w"]}], plain)
    plain.seek(0)
    item = _read_item("groups")
    planner.load_bytes(item, plain)
    assert planner.original_state_dict["groups"] == [{"lr": 0.1, "betas": (0.9, 0.95), "params": ["w"]}]
    with pytest.raises(UnsafeCheckpointError, match="holds an object outside plain data"):
        planner.load_bytes(item, io.BytesIO(_crafted("posix", "system", "true")))


def _read_item(fqn: str) -> object:
    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.planner import LoadItemType, ReadItem

    index = MetadataIndex(fqn)
    return ReadItem(LoadItemType.BYTE_IO, index, torch.Size([0]), index, torch.Size([0]), torch.Size([0]))
