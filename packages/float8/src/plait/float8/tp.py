"""The TP plan for float8 linears: torchao's float8 twins of ``ColwiseParallel`` / ``RowwiseParallel``.

torchao's ``Float8ColwiseParallel`` and ``Float8RowwiseParallel`` shard the weight as torch's styles do
and cast each converted linear's input (before any redistribution) and its output gradient to float8
with one tensorwise scale taken over the whole DTensor, so every TP rank scales as the unsharded model.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from fnmatch import fnmatchcase

from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

from plait.float8.plan import Float8Plan
from plait.float8.torchao_api import require_torchao

__all__ = ["float8_tp_plan"]


def float8_tp_plan(
    model: nn.Module, tp_plan: Mapping[str, ParallelStyle], float8: Float8Plan
) -> dict[str, ParallelStyle]:
    """``tp_plan`` with each converted linear's style replaced by its float8 twin, in plan order.

    A pattern whose modules are all converted keeps its pattern; one that matches converted and
    unconverted modules is split into one entry per module. Other styles are kept as they are.

    Raises:
        ImportError: torchao is not installed (names the extra to install).
    """
    tensor_parallel = require_torchao("float8_tensor_parallel")
    twins = {
        ColwiseParallel: tensor_parallel.Float8ColwiseParallel,
        RowwiseParallel: tensor_parallel.Float8RowwiseParallel,
    }
    converted = set(float8.modules)
    fqns = [fqn for fqn, _ in model.named_modules() if fqn]
    out: dict[str, ParallelStyle] = {}
    for pattern, style in tp_plan.items():
        twin = twins.get(type(style))
        matched = [fqn for fqn in fqns if fnmatchcase(fqn, pattern)]
        hits = [fqn for fqn in matched if fqn in converted]
        if twin is None or not hits:
            out[pattern] = style
        elif len(hits) == len(matched):
            out[pattern] = _twin(twin, style)
        else:
            for fqn in matched:
                out[fqn] = _twin(twin, style) if fqn in converted else copy.deepcopy(style)
    return out


def _twin(twin: type[ParallelStyle], style: ParallelStyle) -> ParallelStyle:
    """The float8 style with ``style``'s layouts (torch's constructor arguments)."""
    return twin(
        input_layouts=style.input_layouts[0],
        output_layouts=style.output_layouts[0],
        use_local_output=style.use_local_output,
    )
