"""Rank bodies for the checkpoint tests: a whole trainer job in-process on run_on_ranks' gloo ranks."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

SMALL = [
    "model.arch.hidden_size=32",
    "model.arch.intermediate_size=64",
    "model.arch.num_hidden_layers=2",
    "model.arch.num_attention_heads=4",
    "model.arch.num_key_value_heads=2",
    "parallel.activation_checkpointing=false",
    "data.seq_len=16",
    "data.max_bytes=40000",
    "train.val_every=0",
    "train.val_batches=1",
    "train.log_every=100",
    "optim.warmup_steps=1",
    "checkpoint.export=false",
]


def losses(run_dir: str | Path) -> dict[int, float]:
    """``step -> loss`` of the last attempt's train records in ``metrics.jsonl``."""
    records = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if r.get("kind") == "train"}


def train(run_dir: str, overrides: list[str], nan_at: int = 0, kill_in_save: int = 0) -> dict[str, Any]:
    """Run one trainer job on this rank; return the samples of each step, its error and stderr.

    Args:
        nan_at: from this step on, the logits are NaN (a diverged run).
        kill_in_save: rank 0 kills itself with SIGKILL when the save of this step has written all
            shards and is about to write the manifest.

    Returns:
        ``{"samples": {step: sorted global sample indices}, "error": str | None, "stderr": str}``;
        the error is the one-line message of a checkpoint, lock or non-finite failure.
    """
    import contextlib
    import io
    import os
    import signal
    import sys

    import torch.distributed as dist

    import plait.train.checkpoint as checkpoint_module
    from plait.train.checkpoint import CheckpointError
    from plait.train.errors import UserError
    from plait.train.integrity import NonFiniteError
    from plait.train.recipes import load_recipe

    recipe = load_recipe(None, [*SMALL, f"out_dir={run_dir}", *overrides])
    seen: list[tuple[int, int, int, tuple[int, ...]]] = []
    error = None
    stderr = io.StringIO()
    write_manifest = checkpoint_module.write_manifest

    def killing_write_manifest(directory: Path, step: int, *args: Any) -> None:
        if step == kill_in_save:
            os.kill(os.getpid(), signal.SIGKILL)
        write_manifest(directory, step, *args)

    checkpoint_module.write_manifest = killing_write_manifest
    try:
        with contextlib.redirect_stderr(stderr):
            _fit(recipe, seen, nan_at)
    except (CheckpointError, NonFiniteError, UserError, ValueError) as err:
        error = str(err)
    finally:
        checkpoint_module.write_manifest = write_manifest
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, seen)
    samples: dict[int, list[int]] = {}
    for step, _, _, indices in {item for part in everyone for item in part}:
        samples.setdefault(step, []).extend(indices)
    return {
        "samples": {s: sorted(v) for s, v in samples.items()},
        "error": error,
        "stderr": stderr.getvalue(),
        "modules": sorted(sys.modules),
    }


def _fit(recipe: Any, seen: list[Any], nan_at: int) -> None:
    import torch.distributed as dist

    from plait.mesh import init_distributed
    from plait.train.setup import check_recipe
    from plait.train.trainer import Trainer

    trainer = None
    try:
        trainer = Trainer(recipe, check_recipe(recipe, dist.get_world_size()), init_distributed())
        sampler, counter = trainer.sampler, iter(range(10**9))
        original = sampler.next_indices

        def recording() -> list[int]:
            indices = original()
            seen.append((trainer.step, trainer.dp_rank, next(counter), tuple(indices)))
            return indices

        sampler.next_indices = recording
        logits = trainer._logits
        trainer._logits = lambda batch: (
            logits(batch) * (float("nan") if nan_at and trainer.step >= nan_at else 1.0)
        )
        trainer.fit()
    finally:
        if trainer is not None and trainer.run_lock is not None:
            trainer.run_lock.release()
