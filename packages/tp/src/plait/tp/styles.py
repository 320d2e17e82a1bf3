"""Parallel styles: the custom ones plait needs on top of torch's, and ``parse_style`` for plan strings."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    SequenceParallel,
)
from torch.distributed.tensor.placement_types import Placement

__all__ = [
    "GatherSequenceInput",
    "ReplicateParallel",
    "ReplicatedWithGradAllReduce",
    "RotaryEmbeddingParallel",
    "SequenceParallelAllGather",
    "SequenceParallelNorm",
    "VocabParallelEmbedding",
    "loss_parallel_head",
    "parse_style",
]


def _check_1d(style: ParallelStyle, device_mesh: DeviceMesh) -> None:
    if device_mesh.ndim != 1:
        raise ValueError(f"{type(style).__name__} needs a 1-D TP mesh, got a {device_mesh.ndim}-D mesh")


def _vocab_range(vocab_size: int, rank: int, world: int) -> tuple[int, int]:
    """Rows ``[start, end)`` of a ``Shard(0)`` split of ``vocab_size`` rows (``torch.chunk`` semantics)."""
    chunk = -(-vocab_size // world)
    start = min(rank * chunk, vocab_size)
    return start, min(start + chunk, vocab_size)


class VocabParallelEmbedding(ParallelStyle):
    """Shard an ``nn.Embedding`` on the vocabulary (``Shard(0)``), any vocab size.

    Each rank looks up the token ids that fall into its slice of the table (others give zero rows) and
    the partial results are summed over the TP group: all-reduced to ``Replicate()`` or reduce-scattered
    to ``Shard(1)`` (sequence parallel). ``vocab_size % tp != 0`` is fine: the slices follow
    ``torch.chunk``, like every other ``Shard(0)`` parameter. The weight's gradient stays ``Shard(0)``.

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
        _check_1d(self, device_mesh)
        sharded = distribute_tensor(module.weight, device_mesh, [Shard(0)], src_data_rank=self.src_data_rank)
        module.register_parameter("weight", nn.Parameter(sharded, requires_grad=module.weight.requires_grad))
        start, end = _vocab_range(module.num_embeddings, device_mesh.get_local_rank(), device_mesh.size())
        assert sharded.to_local().shape[0] == end - start, "vocab slice disagrees with DTensor's Shard(0)"
        module.forward = partial(_vocab_parallel_forward, module, device_mesh, (start, end), self)
        return module


def _vocab_parallel_forward(
    module: nn.Embedding,
    mesh: DeviceMesh,
    vocab_range: tuple[int, int],
    style: VocabParallelEmbedding,
    input_ids: torch.Tensor,
) -> torch.Tensor:
    if isinstance(input_ids, DTensor):
        ids = input_ids.redistribute(placements=[Replicate()]).to_local()
    elif isinstance(style.input_layouts, Replicate):
        ids = input_ids
    else:
        ids = DTensor.from_local(input_ids, mesh, [style.input_layouts], run_check=False).full_tensor()
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
    if style.use_local_output and isinstance(style.output_layouts, Replicate):
        # A fresh tensor, not DTensor.to_local()'s view: FSDP2 warns when a unit returns a view.
        return _SumOverGroup.apply(out, mesh.get_group())
    partial_out = DTensor.from_local(out, mesh, [Partial()], run_check=False)
    result = partial_out.redistribute(placements=[style.output_layouts])
    return result.to_local() if style.use_local_output else result


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


class SequenceParallelNorm(SequenceParallel):
    """``SequenceParallel`` (input and output ``Shard(sequence_dim)``) with summed parameter gradients.

    The replicated norm weights see a different slice of the sequence on each rank, so autograd gives
    them partial gradients; a gradient hook sums them over the TP group, so ``param.grad`` is a
    ``Replicate()`` DTensor and nothing is left to the optimizer or the training loop.
    """

    def _replicate_module_fn(self, name: str, module: nn.Module, device_mesh: DeviceMesh) -> None:
        super()._replicate_module_fn(name, module, device_mesh)
        for param in module.parameters():
            if param.requires_grad:
                param.register_hook(_sum_partial_grad)


class SequenceParallelAllGather(SequenceParallelNorm):
    """A sequence-parallel norm whose output is all-gathered on the sequence dim.

    Input arrives sharded on ``sequence_dim`` (as ``SequenceParallel``); the output is ``Replicate()``,
    for a norm followed by modules that expect the full sequence (e.g. a head that is not in the plan).
    """

    def __init__(self, *, sequence_dim: int = 1, use_local_output: bool = True) -> None:
        super().__init__(sequence_dim=sequence_dim, use_local_output=use_local_output)

    @staticmethod
    def _prepare_output_fn(
        use_local_output: bool, mod: nn.Module, outputs: Any, device_mesh: DeviceMesh
    ) -> Any:
        gathered = outputs.redistribute(placements=[Replicate()])
        return gathered.to_local() if use_local_output else gathered


def _to_full(value: Any) -> Any:
    if isinstance(value, DTensor):
        return value.full_tensor()
    if isinstance(value, tuple | list):
        return type(value)(_to_full(v) for v in value)
    return value


class GatherSequenceInput(ParallelStyle):
    """All-gather a block's sequence-sharded hidden states once, before its column-wise projections.

    Under sequence parallel an attention or MLP block receives ``Shard(1)`` hidden states; gathering
    them here (first positional argument, else the ``hidden_states`` keyword, so both plait's and
    Hugging Face's call conventions work) lets q/k/v or gate/up share one all-gather in forward and
    one reduce-scatter in backward instead of one each. The block receives a replicated ``DTensor``;
    its column-wise projections return plain local tensors.
    """

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        _check_1d(self, device_mesh)
        module.register_forward_pre_hook(partial(_gather_sequence_pre_hook, device_mesh), with_kwargs=True)
        return module


def _gather_sequence(value: Any, mesh: DeviceMesh) -> Any:
    if not isinstance(value, torch.Tensor):
        return value
    if not isinstance(value, DTensor):
        value = DTensor.from_local(value, mesh, (Shard(1),), run_check=False)
    # Stays a replicated DTensor: the projections' input-gradient partial sums then add up as one
    # Partial DTensor and leave through a single reduce-scatter; a plain tensor here would make each
    # projection all-reduce its own input gradient (torch's from_local backward).
    return value.redistribute(mesh, (Replicate(),))


def _gather_sequence_pre_hook(
    mesh: DeviceMesh, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    if args:
        return (_gather_sequence(args[0], mesh), *args[1:]), kwargs
    if "hidden_states" in kwargs:
        return args, {**kwargs, "hidden_states": _gather_sequence(kwargs["hidden_states"], mesh)}
    raise ValueError(
        f"{type(module).__name__} was called with neither a positional input nor `hidden_states`; "
        "GatherSequenceInput cannot find the hidden states to gather"
    )


class RotaryEmbeddingParallel(ParallelStyle):
    """Run a rotary-embedding module on whole-sequence plain tensors under sequence parallel.

    The cos/sin tables must cover the full sequence on every rank (attention runs on the gathered
    sequence). Inputs that arrive as ``DTensor`` (a sequence-sharded hidden state, replicated position
    ids) are gathered to full plain tensors before the module runs, and ``DTensor`` outputs are
    gathered too; plain tensors pass through untouched. The module has no parameters to shard.
    """

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        _check_1d(self, device_mesh)
        module.register_forward_pre_hook(_rotary_pre_hook, with_kwargs=True)
        module.register_forward_hook(_rotary_post_hook)
        return module


def _rotary_pre_hook(
    module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    return _to_full(args), {k: _to_full(v) for k, v in kwargs.items()}


def _rotary_post_hook(module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
    return _to_full(output)


class ReplicateParallel(ParallelStyle):
    """Keep a module whole on every TP rank, its parameters as ``Replicate()`` DTensors.

    For modules outside the sharded regions (e.g. norms without sequence parallel) so that every
    parameter of a TP model is a DTensor on the TP mesh: foreach optimizers and a plain
    ``clip_grad_norm_`` refuse parameters on different meshes. A plain first input is read as
    ``input_layouts`` (default ``Replicate()``: every rank holds the same activation) and the module
    runs on local tensors (the parameters enter through ``to_local``), so it costs no DTensor
    dispatch; a ``DTensor`` input runs through DTensor as is. Should the parameter gradients come out
    partial (a ``Shard`` input), a gradient hook sums them over the TP group. The output is a plain
    tensor unless ``use_local_output=False``.
    """

    def __init__(self, *, input_layouts: Placement | None = None, use_local_output: bool = True) -> None:
        super().__init__()
        self.input_layouts = input_layouts or Replicate()
        self.use_local_output = use_local_output

    def _replicate_params(self, name: str, module: nn.Module, device_mesh: DeviceMesh) -> None:
        for p_name, param in list(module.named_parameters(recurse=False)):
            replicated = nn.Parameter(
                DTensor.from_local(param, device_mesh, [Replicate()], run_check=False),
                requires_grad=param.requires_grad,
            )
            if replicated.requires_grad:
                replicated.register_hook(_sum_partial_grad)
            module.register_parameter(p_name, replicated)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        _check_1d(self, device_mesh)
        distribute_module(module, device_mesh, self._replicate_params)
        module.forward = partial(_replicated_forward, module, module.forward, self, device_mesh)
        return module


def _replicated_forward(
    module: nn.Module,
    forward: Callable[..., Any],
    style: ReplicateParallel,
    mesh: DeviceMesh,
    *args: Any,
    **kwargs: Any,
) -> Any:
    first = args[0] if args else None
    if isinstance(first, DTensor):
        out = forward(*args, **kwargs)
        return out.to_local() if style.use_local_output and isinstance(out, DTensor) else out
    layout = style.input_layouts
    # Replicated inputs give every rank the same parameter gradient; sharded ones give partial sums.
    grad_placement = Replicate() if isinstance(layout, Replicate) else Partial()
    params = dict(module._parameters)
    for name, param in params.items():
        if isinstance(param, DTensor):
            # Written to the registry directly, as FSDP2 does with its unsharded parameters; the
            # DTensor parameters are put back below, so state_dict and optimizers never see these.
            module._parameters[name] = param.to_local(grad_placements=[grad_placement])
    try:
        out = forward(*args, **kwargs)
    finally:
        module._parameters.update(params)
    if style.use_local_output or not isinstance(out, torch.Tensor) or not isinstance(first, torch.Tensor):
        return out
    if isinstance(layout, Shard):
        layout = Shard(layout.dim % first.ndim)
    return DTensor.from_local(out, mesh, [layout], run_check=False)


class ReplicatedWithGradAllReduce(ReplicateParallel):
    """Replicated parameters applied to activations that differ per TP rank; gradients summed over TP.

    For norms that run on sharded activations without reducing over the sharded dim, e.g. Qwen3's
    per-head ``q_norm``/``k_norm`` after a column-wise projection (each rank sees its own heads). The
    plain input is read as ``Shard(input_dim)`` (default: the heads dim, ``-2``), so autograd yields a
    partial gradient, and the gradient hook sums it over the TP group: ``param.grad`` is a
    ``Replicate()`` DTensor and nothing is left to the training loop. The output is a plain tensor.
    """

    def __init__(self, *, input_dim: int = -2, use_local_output: bool = True) -> None:
        super().__init__(input_layouts=Shard(input_dim), use_local_output=use_local_output)


def _sum_partial_grad(grad: torch.Tensor) -> torch.Tensor:
    if isinstance(grad, DTensor) and any(p.is_partial() for p in grad.placements):
        return grad.redistribute(placements=[Replicate()] * len(grad.placements))
    return grad


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


_STYLE_FACTORIES: dict[str, Callable[[], ParallelStyle]] = {
    "colwise": ColwiseParallel,
    "rowwise": RowwiseParallel,
    "colwise_rep": lambda: ColwiseParallel(output_layouts=Replicate()),
    "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate()),
    "rowwise_rep": lambda: RowwiseParallel(input_layouts=Replicate()),
    "sequence_parallel": SequenceParallelNorm,
    "replicate": ReplicateParallel,
    "replicated_with_grad_allreduce": ReplicatedWithGradAllReduce,
    "embedding_rowwise": VocabParallelEmbedding,
}


def parse_style(name: str) -> ParallelStyle:
    """Return a new style object for a plan string such as ``"colwise"`` or ``"embedding_rowwise"``.

    Raises:
        ValueError: unknown style name (the message lists the known ones).
    """
    factory = _STYLE_FACTORIES.get(name) if isinstance(name, str) else None
    if factory is None:
        raise ValueError(
            f"Unknown parallel style: {name!r}; known styles: {', '.join(sorted(_STYLE_FACTORIES))}"
        )
    return factory()
