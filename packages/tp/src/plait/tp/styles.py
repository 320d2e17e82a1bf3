"""Plan style strings: ``parse_style`` maps each one plait implements to a fresh style, or refuses it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

from plait.tp.embedding import VocabParallelEmbedding
from plait.tp.replicate import ReplicatedWithGradAllReduce, ReplicateParallel
from plait.tp.sequence import SequenceParallelNorm

__all__ = ["REFUSED_STYLES", "RowwiseLocalCopy", "loss_parallel_head", "parse_style"]


def loss_parallel_head(*, sequence_parallel: bool = False) -> ColwiseParallel:
    """The output head for loss parallel: vocab-sharded logits kept as a ``DTensor`` (``Shard(-1)``).

    Callers compute the loss under ``torch.distributed.tensor.parallel.loss_parallel()`` (or call
    ``logits.full_tensor()``). With sequence parallel the head's input arrives as ``Shard(1)``.
    """
    return ColwiseParallel(
        input_layouts=Shard(1) if sequence_parallel else Replicate(),
        output_layouts=Shard(-1),
        use_local_output=False,
    )


class RowwiseLocalCopy(RowwiseParallel):
    """``RowwiseParallel`` whose plain-tensor output is a tensor of its own, not a view of the DTensor's.

    torch's ``to_local`` hands back a view made inside a custom autograd function, which autograd
    forbids modifying in place; a model that updates a row-wise output in place (Llama4's
    ``out = self.shared_expert(x); out.add_(routed)``) would fail. One copy of the output per call.
    """

    @staticmethod
    def _prepare_output_fn(
        output_layouts: Any, use_local_output: bool, mod: nn.Module, outputs: Any, device_mesh: DeviceMesh
    ) -> Any:
        out = RowwiseParallel._prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh)
        return out.clone() if use_local_output and isinstance(out, torch.Tensor) else out


_STYLE_FACTORIES: dict[str, Callable[[], ParallelStyle]] = {
    "colwise": ColwiseParallel,
    "rowwise": RowwiseParallel,
    "colwise_rep": lambda: ColwiseParallel(output_layouts=Replicate()),
    "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate()),
    "rowwise_rep": lambda: RowwiseParallel(input_layouts=Replicate()),
    "rowwise_split_input": lambda: RowwiseParallel(input_layouts=Replicate()),
    "sequence_parallel": SequenceParallelNorm,
    "replicate": ReplicateParallel,
    "replicated_with_grad_allreduce": ReplicatedWithGradAllReduce,
    "embedding_rowwise": VocabParallelEmbedding,
}

REFUSED_STYLES: dict[str, str] = {
    "all_reduce": "an all-reduce of a module's output (a shared-experts block) that plait does not translate",
    "embedding_colwise": "a hidden-dim sharded embedding, which plait does not implement",
}
"""Style strings of Hugging Face plans that plait refuses, with the reason shown to the user."""


def parse_style(name: str) -> ParallelStyle:
    """Return a new style object for a plan string such as ``"colwise"`` or ``"embedding_rowwise"``.

    Strings that need the model to be translated (``packed_colwise`` on a parameter, ``moe_tp_experts``,
    ``mla_kv_a_proj``, ``local_params``) are handled by ``hf_tp_plan``, not here.

    Raises:
        ValueError: unknown or refused style name (the message lists the known ones).
    """
    factory = _STYLE_FACTORIES.get(name) if isinstance(name, str) else None
    if factory is None:
        reason = f" ({REFUSED_STYLES[name]})" if name in REFUSED_STYLES else ""
        raise ValueError(
            f"Unknown parallel style: {name!r}{reason}; known styles: {', '.join(sorted(_STYLE_FACTORIES))}"
        )
    return factory()
