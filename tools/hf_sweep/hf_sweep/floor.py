"""The rounding floor of a family: what float32 alone changes, next to what the parallel copy changes.

For one mesh configuration, from the same weights and with the sweep's batches and 2 SGD steps:

- ``ref-f64``: the float32 reference against its float64 copy (fused experts on the eager loop:
  grouped_mm has no float64 kernel), i.e. float32's own error;
- ``par-f64``: the float32 parallel copy against the same float64 copy;
- ``par-ref``: the parallel copy against the float32 reference (what the sweep reports);
- ``micro``: the float32 reference against itself run on the global batch as two micro-batches,
  gradients averaged (the same math, summed in another order).

A parallel copy that is as close to the float64 copy as the float32 reference is, with ``par-ref``
no larger than ``micro`` or ``ref-f64``, differs by float32 rounding that the family amplifies; a
layout error would leave ``par-f64`` well above ``ref-f64``.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from hf_sweep.family import CASES, Case
from hf_sweep.rank import (
    LR,
    build_model,
    global_batch,
    lm_loss,
    local_batch,
    next_tokens,
    parallel_copy,
    relative_diff,
)

__all__ = ["run_floor", "sweep_floor"]


def _float64_copy(model: nn.Module) -> nn.Module:
    """The same weights in float64, fused experts on the eager per-expert loop."""
    wide = copy.deepcopy(model).double()
    for module in wide.modules():
        config = getattr(module, "config", None)
        if config is not None and hasattr(config, "_experts_implementation"):
            config._experts_implementation = "eager"
    return wide


def _micro_step(model: nn.Module, ids: torch.Tensor) -> None:
    """The gradients of the mean loss over ``ids`` from two micro-batches (each loss halved)."""
    for chunk in ids.chunk(2):
        logits = model(input_ids=chunk[:, :-1]).logits
        loss = nn.functional.cross_entropy(logits.flatten(0, 1).float(), chunk[:, 1:].flatten())
        (loss / 2).backward()


def run_floor(model_type: str, tp: int, sp: bool, cp: int = 1) -> dict[str, Any]:
    """Distances (gradients at step 0, parameters after 2 SGD steps) between the four copies, on every rank."""
    ref = build_model(model_type, tp, torch.float32, cp)
    wide, micro = _float64_copy(ref), copy.deepcopy(ref)
    par, ctx = parallel_copy(ref, tp, sp, cp)
    models = (ref, wide, micro, par)
    opts = [torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=LR) for m in models]
    pairs = {"ref-f64": (wide, ref), "par-f64": (wide, par), "par-ref": (ref, par), "micro": (ref, micro)}
    out: dict[str, Any] = {}
    for step in range(2):
        ids = global_batch(ctx, step)
        lm_loss(ref, next_tokens(ids))
        lm_loss(wide, next_tokens(ids))
        _micro_step(micro, ids)
        lm_loss(par, local_batch(ctx, ids))
        if step == 0:
            out["grad"] = {name: relative_diff(a, b, grads=True) for name, (a, b) in pairs.items()}
        for opt in opts:
            opt.step()
            opt.zero_grad()
    out["param"] = {name: relative_diff(a, b, grads=False) for name, (a, b) in pairs.items()}
    return out


def _format(family: str, case: str, record: dict[str, Any]) -> str:
    cells = [
        f"{kind} " + " ".join(f"{name} {value:.1e}" for name, (value, _) in record[kind].items())
        for kind in ("grad", "param")
    ]
    return f"{family:<24} {case:<7} " + " | ".join(cells)


def sweep_floor(families: list[str], out: Path, timeout: float, cases: Sequence[Case] = CASES) -> None:
    """Each case of each family on 4 gloo ranks: one line on stdout, one JSON record in ``out/floor.jsonl``."""
    from plait.testing import run_on_ranks

    with (out / "floor.jsonl").open("a") as f:
        for family in families:
            for case in cases:
                try:
                    record = run_on_ranks(run_floor, 4, family, case.tp, case.sp, case.cp, timeout=timeout)[0]
                except Exception as exc:  # a refusal, a crash or a hang: the sweep's own table says which
                    print(f"{family:<24} {case.name:<7} {type(exc).__name__}: {str(exc)[:160]}", flush=True)
                    continue
                f.write(json.dumps({"family": family, "case": case.name, **record}) + "\n")
                print(_format(family, case.name, record), flush=True)
