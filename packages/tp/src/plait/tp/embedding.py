"""Vocabulary-parallel input embedding that keeps whatever the module's own forward adds to the lookup."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle
from torch.distributed.tensor.placement_types import Placement

__all__ = ["VocabParallelEmbedding"]


def check_1d(style: ParallelStyle, device_mesh: DeviceMesh) -> None:
    """Raise ``ValueError`` unless ``device_mesh`` is 1-D (every plait style works on the TP mesh alone)."""
    if device_mesh.ndim != 1:
        raise ValueError(f"{type(style).__name__} needs a 1-D TP mesh, got a {device_mesh.ndim}-D mesh")


def _vocab_range(vocab_size: int, rank: int, world: int) -> tuple[int, int]:
    """Rows ``[start, end)`` of a ``Shard(0)`` split of ``vocab_size`` rows (``torch.chunk`` semantics)."""
    chunk = -(-vocab_size // world)
    start = min(rank * chunk, vocab_size)
    return start, min(start + chunk, vocab_size)


class VocabParallelEmbedding(ParallelStyle):
    """Shard an ``nn.Embedding`` (or a subclass) on the vocabulary (``Shard(0)``), any vocab size.

    Only the table lookup is replaced: each rank looks up the ids in its slice of the table (others give
    zero rows) and the partial rows are summed over the TP group, all-reduced to ``Replicate()`` or
    reduce-scattered to ``Shard(1)`` (sequence parallel). The module's own forward still runs around the
    lookup, so a subclass that post-processes it (Gemma's ``* sqrt(hidden)`` scale) keeps doing so, on
    the summed rows (this rank's sequence shard under SP). The module's class is swapped for a
    subclass whose ``nn.Embedding.forward`` is the parallel lookup (as FSDP2 swaps classes).
    ``vocab_size % tp != 0`` is fine: the slices follow ``torch.chunk``. The weight's gradient stays
    ``Shard(0)``.

    Args:
        input_layouts: layout of the token ids (default ``Replicate()``; every TP rank holds the same ids).
        output_layouts: ``Replicate()`` (default) or ``Shard(1)`` for sequence parallel.
        use_local_output: return a plain tensor (default) instead of a ``DTensor``.
    """

    def __init__(
        self,
        *,
        input_layouts: Placement | None = None,
        output_layouts: Placement | None = None,
        use_local_output: bool = True,
    ) -> None:
        super().__init__()
        self.input_layouts = input_layouts or Replicate()
        self.output_layouts = output_layouts or Replicate()
        self.use_local_output = use_local_output

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not isinstance(module, nn.Embedding):
            raise TypeError(f"VocabParallelEmbedding applies to nn.Embedding, got {type(module).__name__}")
        check_1d(self, device_mesh)
        sharded = distribute_tensor(module.weight, device_mesh, [Shard(0)], src_data_rank=self.src_data_rank)
        module.register_parameter("weight", nn.Parameter(sharded, requires_grad=module.weight.requires_grad))
        start, end = _vocab_range(module.num_embeddings, device_mesh.get_local_rank(), device_mesh.size())
        assert sharded.to_local().shape[0] == end - start, "vocab slice disagrees with DTensor's Shard(0)"
        module._plait_vocab_parallel = (device_mesh, (start, end), self)
        module.__class__ = _vocab_parallel_class(type(module))
        module.register_forward_pre_hook(_ids_pre_hook)
        if not self.use_local_output:
            module.register_forward_hook(_to_dtensor_hook)
        return module


class _VocabParallelLookup(nn.Embedding):
    """``nn.Embedding.forward`` replaced by the vocab-parallel lookup; never instantiated directly."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        mesh, vocab_range, style = self._plait_vocab_parallel
        return _vocab_parallel_lookup(self, mesh, vocab_range, style, input)


_CLASSES: dict[type, type] = {}
"""Cache of the generated classes, one per embedding class (deepcopy and isinstance keep working)."""


def _vocab_parallel_class(cls: type) -> type:
    if issubclass(cls, _VocabParallelLookup):
        return cls
    if cls not in _CLASSES:
        # The subclass's forward (if any) runs first; its super().forward() reaches the parallel lookup.
        bases = (_VocabParallelLookup,) if cls is nn.Embedding else (cls, _VocabParallelLookup)
        _CLASSES[cls] = type(f"VocabParallel{cls.__name__}", bases, {"__module__": cls.__module__})
    return _CLASSES[cls]


def _ids_pre_hook(module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
    """Give the module's forward the whole token ids as a plain tensor."""
    if not args:
        return None
    mesh, _, style = module._plait_vocab_parallel
    ids = args[0]
    if isinstance(ids, DTensor):
        ids = ids.redistribute(placements=[Replicate()]).to_local()
    elif not isinstance(style.input_layouts, Replicate):
        ids = DTensor.from_local(ids, mesh, [style.input_layouts], run_check=False).full_tensor()
    _check_sequence_divides(module, ids, style, mesh.size())
    return (ids, *args[1:])


def _check_sequence_divides(
    module: nn.Module, ids: torch.Tensor, style: VocabParallelEmbedding, tp: int
) -> None:
    """Refuse a sequence-sharded output whose length the TP size does not divide (uneven shards hang gloo and NCCL).

    Every rank of the TP group holds the same ids, so each raises here, before the reduce-scatter.
    """
    layout = style.output_layouts
    if not isinstance(layout, Shard) or layout.dim >= ids.dim() or ids.shape[layout.dim] % tp == 0:
        return
    length = ids.shape[layout.dim]
    raise ValueError(
        f"sequence parallel shards the {length} tokens of dim {layout.dim} given to {type(module).__name__} "
        f"over tp_size={tp}, which does not divide {length}; pad or cut the sequence to a multiple of "
        f"{tp} (per context-parallel rank), or turn sequence_parallel off"
    )


def _to_dtensor_hook(module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
    mesh, _, style = module._plait_vocab_parallel
    if isinstance(output, torch.Tensor) and not isinstance(output, DTensor):
        return DTensor.from_local(output, mesh, [style.output_layouts], run_check=False)
    return output


def _vocab_parallel_lookup(
    module: nn.Embedding,
    mesh: DeviceMesh,
    vocab_range: tuple[int, int],
    style: VocabParallelEmbedding,
    ids: torch.Tensor,
) -> torch.Tensor:
    """This rank's partial lookup summed over the TP group, as a plain tensor in ``output_layouts``."""
    start, end = vocab_range
    local_weight = module.weight.to_local()
    outside = (ids < start) | (ids >= end)
    if end > start:
        pad = module.padding_idx
        local_pad = pad - start if pad is not None and start <= pad < end else None
        local_ids = (ids - start).masked_fill(outside, 0)
        out = F.embedding(
            local_ids,
            local_weight,
            local_pad,
            module.max_norm,
            module.norm_type,
            module.scale_grad_by_freq,
            module.sparse,
        )
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
    else:
        # An empty slice (more ranks than rows): zeros, still attached to the weight so that every rank
        # records the same backward collectives.
        out = local_weight.new_zeros((*ids.shape, module.embedding_dim)) + local_weight.sum()
    if isinstance(style.output_layouts, Replicate):
        # A fresh tensor, not DTensor.to_local()'s view: FSDP2 warns when a unit returns a view.
        return _SumOverGroup.apply(out, mesh.get_group())
    partial_out = DTensor.from_local(out, mesh, [Partial()], run_check=False)
    return partial_out.redistribute(placements=[style.output_layouts]).to_local()


class _SumOverGroup(torch.autograd.Function):
    """Sum per-rank partial results over the TP group; the (replicated) output gradient passes through."""

    @staticmethod
    def forward(ctx: Any, partial: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        total = partial.clone()
        dist.all_reduce(total, group=group)
        return total

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None
