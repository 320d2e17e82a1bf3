"""The guide's loop (docs/examples/loop.py) runs as the guide says on each of its contexts, on 4 ranks."""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch
import torch.nn.functional as F

from plait.mesh import materialize

LOOP = Path(__file__).resolve().parents[2] / "docs" / "examples" / "loop.py"
CONTEXTS = ["fsdp2_tp", "fsdp2", "hsdp", "ddp"]
FAST = ["fsdp2_tp", "ddp"]
"""In CI: the sharded-and-TP context and DDP (the two flows); every context in tools/slow_tests."""


def _example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("guide_loop", LOOP)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _reference_first_loss(example: ModuleType) -> float:
    """The unsharded model's loss on the loop's first global batch (one process, no mesh)."""
    model = materialize(example.LlamaForCausalLM(example.CONFIG), seed=0)
    batch = torch.randint(0, example.CONFIG.vocab_size, (8, 65), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = model(batch[:, :-1]).logits
    return F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten()).item()


def _run_torchrun(command: list[str], *, timeout: float) -> subprocess.CompletedProcess[str]:
    """``command`` to its end; past ``timeout``, SIGTERM first, so that torchrun stops its ranks too
    (a SIGKILLed torchrun leaves them waiting on its store for ever), then the test fails."""
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as proc:
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.terminate()
            try:
                stdout, stderr = proc.communicate(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                stdout, stderr = proc.communicate()
            raise AssertionError(f"torchrun ran past {timeout} s\n{stderr[-3000:]}") from None
    return subprocess.CompletedProcess(command, proc.returncode, stdout, stderr)


@pytest.mark.parametrize(
    "contexts", [FAST, pytest.param(CONTEXTS, marks=pytest.mark.slow)], ids=["fast", "all"]
)
def test_the_guide_loop_trains_on_every_context_from_the_same_start(
    tmp_path: Path, contexts: list[str]
) -> None:
    out = tmp_path / "losses.json"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4"]
    command += [str(LOOP), "--context", *contexts, "--steps", "3", "--save", str(tmp_path / "ckpt")]
    done = _run_torchrun([*command, "--out", str(out)], timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    losses = json.loads(out.read_text())
    reference = _reference_first_loss(_example())
    for context in contexts:
        assert len(losses[context]) == 3 and all(math.isfinite(x) for x in losses[context]), losses
        # Step 1 is before any update: the same weights on every mesh and the same global batch.
        assert abs(losses[context][0] - reference) <= 1e-5 * abs(reference), (
            context,
            losses[context],
            reference,
        )
        assert (tmp_path / "ckpt" / context / ".metadata").is_file()
    for line in (f"{c} step 3 loss" for c in contexts):
        assert line in done.stdout, done.stdout
