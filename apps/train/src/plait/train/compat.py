"""What a checkpoint must share with the job that resumes it — and nothing more.

The mesh, the world size, the strategy, the micro-batch size and the learning-rate settings may
all change between jobs: DCP reshards the tensors, and the data position is a global sample
index. What cannot change is recorded at save and compared before anything is loaded:

- the model's parameter names and global shapes (a 4-layer checkpoint never loads into 2 layers);
- the optimizer class (its state tensors differ);
- the recipe keys that define the global sample order (data source, files, sequence length,
  shuffling, seed): with another order, "continue at sample N" would repeat or skip samples.
"""

from __future__ import annotations

import json
from typing import Any

from plait.train.config import Recipe, to_dict

__all__ = ["data_order_keys", "fingerprint", "mismatch"]

_LOADER_KNOBS = frozenset({"micro_batch_size", "num_workers", "prefetch_factor", "pin_memory", "streaming"})
"""``data.*`` keys that change how samples are fetched, not which sample comes next (``streaming``
reads the same rows in the same order)."""
_SHOWN = 3


def data_order_keys(recipe: Recipe) -> dict[str, Any]:
    """The recipe values that fix the global sample order."""
    data = {f"data.{k}": v for k, v in to_dict(recipe.data).items() if k not in _LOADER_KNOBS}
    return {**data, "train.seed": recipe.train.seed}


def fingerprint(recipe: Recipe, model_state: dict[str, Any], optimizer: object) -> dict[str, Any]:
    """What :func:`mismatch` compares: model shapes, optimizer class, data order.

    ``model_state`` is the model's DCP state dict (``get_model_state_dict``): clean names and,
    for DTensors, global shapes.
    """
    return {
        "model": {key: list(value.shape) for key, value in model_state.items()},
        "optimizer": type(optimizer).__name__,
        "data_order": json.loads(json.dumps(data_order_keys(recipe))),  # as the manifest will hold it
    }


def _listed(names: list[str]) -> str:
    more = f" (+{len(names) - _SHOWN} more)" if len(names) > _SHOWN else ""
    return ", ".join(names[:_SHOWN]) + more


def _model_mismatch(saved: dict[str, list[int]], current: dict[str, list[int]]) -> list[str]:
    parts = []
    missing = sorted(set(current) - set(saved))
    extra = sorted(set(saved) - set(current))
    reshaped = [k for k in sorted(set(saved) & set(current)) if list(saved[k]) != list(current[k])]
    if missing:
        parts.append(f"not in the checkpoint: {_listed(missing)}")
    if extra:
        parts.append(f"not in the model: {_listed(extra)}")
    if reshaped:
        shown = [f"{k} {tuple(saved[k])} saved vs {tuple(current[k])} now" for k in reshaped]
        parts.append(f"shape differs: {_listed(shown)}")
    return parts


def mismatch(saved: dict[str, Any], current: dict[str, Any]) -> str | None:
    """A one-line description of why a checkpoint with ``saved`` cannot resume ``current``, or None."""
    parts = _model_mismatch(saved.get("model", {}), current["model"])
    if saved.get("optimizer") != current["optimizer"]:
        parts.append(f"optimizer {saved.get('optimizer')} saved vs {current['optimizer']} now")
    old, new = saved.get("data_order", {}), current["data_order"]
    changed = [k for k in sorted(set(old) | set(new)) if old.get(k) != new.get(k)]
    if changed:
        shown = [f"{k} {old.get(k)!r} saved vs {new.get(k)!r} now" for k in changed]
        parts.append(f"the sample order changed: {_listed(shown)}")
    return "; ".join(parts) if parts else None
