"""Replicated parameters on the TP mesh whose gradients come out complete wherever the module runs."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import ParallelStyle
from torch.distributed.tensor.placement_types import Placement

from plait.tp.embedding import check_1d

__all__ = [
    "ReplicateOwnParams",
    "ReplicateParallel",
    "ReplicatedWithGradAllReduce",
    "ShardedRegion",
    "local_state",
    "replicate_own_params",
    "sum_partial_grad",
]


class ShardedRegion:
    """Tells whether an activation inside a block is sharded over TP, from where it was computed.

    A block (an attention or MLP module) whose column-wise projections return sharded outputs
    records, per forward call, the autograd nodes of those outputs (``mark``) and of its own inputs
    (``enter``). A parameterised module called inside the block sees sharded activations exactly
    when its input was computed from a sharded projection output, found by walking the autograd
    graph back from the input and stopping at the block's inputs. Such a module's parameter
    gradient is partial (this rank's heads or features only); one fed from the block's whole input
    (a latent-attention norm before its projection) gets a complete gradient. Per call, so it also
    holds under activation checkpointing.
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self._sharded: set[Any] = set()
        self._stops: set[Any] = set()
        self._whole: list[tuple[Any, list[torch.Tensor], dist.ProcessGroup]] = []

    def enter(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Forward pre-hook of the block: a new call, whose inputs bound the graph walk."""
        self._sharded, self._whole = set(), []
        values = [*args, *kwargs.values()]
        self._stops = {v.grad_fn for v in values if isinstance(v, torch.Tensor) and v.grad_fn is not None}

    def mark(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        """Forward hook of a column-wise projection: its output is sharded."""
        if isinstance(output, torch.Tensor) and output.grad_fn is not None:
            self._sharded.add(output.grad_fn)

    def sees_shards(self, value: Any) -> bool:
        """Whether ``value`` was computed (in this call of the block) from a sharded projection output."""
        if not isinstance(value, torch.Tensor) or value.grad_fn is None or not self._sharded:
            return False
        stack, seen = [value.grad_fn], set()
        while stack:
            node = stack.pop()
            if node is None or node in seen or node in self._stops:
                continue
            if node in self._sharded:
                return True
            seen.add(node)
            stack.extend(next_node for next_node, _ in node.next_functions)
        return False

    def watch(self, output: Any, params: list[torch.Tensor], group: dist.ProcessGroup) -> None:
        """A module on a whole input ran: ``leave`` decides whether its output reached the shards."""
        if isinstance(output, torch.Tensor) and output.grad_fn is not None and params:
            self._whole.append((output.grad_fn, params, group))

    def leave(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        """Forward hook of the block: sum the gradients of whole-input modules whose output met shards.

        Such an output used directly with sharded activations (DeepSeek-style latent attention's
        shared RoPE key broadcast to this rank's heads, Dots3's ``k_rope_only_layernorm``) gets a
        partial gradient; one that reaches them only through a column-wise projection gets a
        complete one (the projection sums its input gradient). Found by walking back from the
        block's outputs, stopping at projection outputs and at the block's inputs.
        """
        outputs = output if isinstance(output, (tuple, list)) else (output,)
        stack = [o.grad_fn for o in outputs if isinstance(o, torch.Tensor) and self.sees_shards(o)]
        watched, seen = {node: i for i, (node, _, _) in enumerate(self._whole)}, set()
        while stack and watched:
            node = stack.pop()
            if node is None or node in seen or node in self._stops or node in self._sharded:
                continue
            seen.add(node)
            if node in watched:
                _, params, group = self._whole[watched.pop(node)]
                for param in params:
                    param.register_hook(partial(_all_reduce_grad, group))
            stack.extend(next_node for next_node, _ in node.next_functions)
        self._whole = []


def _all_reduce_grad(group: dist.ProcessGroup, grad: torch.Tensor) -> torch.Tensor:
    grad = grad.clone()
    dist.all_reduce(grad, group=group)
    return grad


def sum_partial_grad(grad: torch.Tensor) -> torch.Tensor:
    """Gradient hook: sum a ``Partial`` DTensor gradient over the mesh; a complete one passes through."""
    if isinstance(grad, DTensor) and any(p.is_partial() for p in grad.placements):
        return grad.redistribute(placements=[Replicate()] * len(grad.placements))
    return grad


def replicate_own_params(name: str, module: nn.Module, device_mesh: DeviceMesh) -> None:
    """`distribute_module` partition function: the module's own parameters become ``Replicate()``.

    Own parameters only: ``distribute_module`` calls it for every submodule, and torch's default
    registers nested names (AXK2's gated norm), which nn.Module refuses. Each gets
    :func:`sum_partial_grad`, so its gradient is complete over the TP group.
    """
    for p_name, param in list(module.named_parameters(recurse=False)):
        if isinstance(param, DTensor):
            continue
        replicated = nn.Parameter(
            DTensor.from_local(param, device_mesh, [Replicate()], run_check=False),
            requires_grad=param.requires_grad,
        )
        if replicated.requires_grad:
            replicated.register_hook(sum_partial_grad)
        module.register_parameter(p_name, replicated)


class ReplicateOwnParams(ParallelStyle):
    """Make a module's own parameters ``Replicate()`` DTensors (complete gradients), nothing else.

    For a module whose children carry their own styles but which also holds a parameter of its own
    that meets DTensor activations (a decoder's learned initial state under sequence parallel).
    """

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        check_1d(self, device_mesh)
        replicate_own_params("", module, device_mesh)
        return module


class ReplicateParallel(ParallelStyle):
    """Keep a module whole on every TP rank, its parameters as ``Replicate()`` DTensors.

    For modules outside the sharded regions (e.g. norms without sequence parallel) so that every
    parameter of a TP model is a DTensor on the TP mesh: foreach optimizers and a plain
    ``clip_grad_norm_`` refuse parameters on different meshes. A plain first input is read as
    ``input_layouts`` (default ``Replicate()``: every rank holds the same activation) and the module
    runs on local tensors (the parameters enter through ``to_local``), so it costs no DTensor
    dispatch; a ``DTensor`` input runs through DTensor as is. When ``region`` is set (``apply_tp``
    sets it for modules inside a block with sharded projections), the region decides instead, per
    call: an input computed from sharded projection outputs gives partial gradients, a whole one
    complete gradients.
    Partial gradients are summed over the TP group by a gradient hook, exactly once. The output is a
    plain tensor unless ``use_local_output=False``; ``output_layouts`` then redistributes it (a whole
    embedding handing a sequence-parallel model its ``Shard(1)`` slice).
    """

    def __init__(
        self,
        *,
        input_layouts: Placement | None = None,
        output_layouts: Placement | None = None,
        use_local_output: bool = True,
    ) -> None:
        super().__init__()
        if output_layouts is not None and use_local_output:
            raise ValueError(
                f"ReplicateParallel(output_layouts={output_layouts!r}) returns a DTensor in that layout; "
                "pass use_local_output=False with it, or drop output_layouts for a plain tensor"
            )
        self.input_layouts = input_layouts or Replicate()
        self.output_layouts = output_layouts
        self.use_local_output = use_local_output
        self.region: ShardedRegion | None = None

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        check_1d(self, device_mesh)
        distribute_module(module, device_mesh, replicate_own_params)
        module.forward = partial(_replicated_forward, module, module.forward, self, device_mesh)
        return module


def _grad_placement(style: ReplicateParallel, first: Any) -> Placement:
    if style.region is not None:
        return Partial() if style.region.sees_shards(first) else Replicate()
    # Replicated inputs give every rank the same parameter gradient; sharded ones give partial sums.
    return Replicate() if isinstance(style.input_layouts, Replicate) else Partial()


@contextmanager
def local_state(module: nn.Module, grad_placement: Placement) -> Iterator[list[torch.Tensor]]:
    """Swap the replicated DTensor parameters and buffers of ``module`` and its children for local tensors.

    Written to the registries directly, as FSDP2 does with its unsharded parameters, and put back on
    exit, so state_dict and optimizers never see the local ones. Children too: ``distribute_module``
    replicates a nested norm's or gate's parameters as well (AXK2's gated norm).
    """
    saved, local = [], []
    for sub in module.modules():
        params, buffers = dict(sub._parameters), dict(sub._buffers)
        saved.append((sub, params, buffers))
        for name, param in params.items():
            if _replicated(param):
                sub._parameters[name] = param.to_local(grad_placements=[grad_placement])
                local.append(sub._parameters[name])
        for name, buffer in buffers.items():
            if _replicated(buffer):  # distribute_module replicates buffers too (XIELU's beta)
                sub._buffers[name] = buffer.to_local()
    try:
        yield local
    finally:
        for sub, params, buffers in saved:
            sub._parameters.update(params)
            sub._buffers.update(buffers)


def _replicated(value: Any) -> bool:
    return isinstance(value, DTensor) and all(p.is_replicate() for p in value.placements)


def _replicated_forward(
    module: nn.Module,
    forward: Callable[..., Any],
    style: ReplicateParallel,
    mesh: DeviceMesh,
    *args: Any,
    **kwargs: Any,
) -> Any:
    first = args[0] if args else next(iter(kwargs.values()), None)
    if isinstance(first, DTensor):
        out = forward(*args, **kwargs)
        if isinstance(out, DTensor) and style.output_layouts is not None:
            return out.redistribute(mesh, [style.output_layouts])
        return out.to_local() if style.use_local_output and isinstance(out, DTensor) else out
    placement = _grad_placement(style, first)
    with local_state(module, placement) as local:
        out = forward(*args, **kwargs)
    if style.region is not None and isinstance(placement, Replicate):
        style.region.watch(out, [p for p in local if p.requires_grad], mesh.get_group())
    if style.use_local_output or not isinstance(out, torch.Tensor) or not isinstance(first, torch.Tensor):
        return out
    layout = style.input_layouts
    if isinstance(layout, Shard):
        layout = Shard(layout.dim % first.ndim)
    out = DTensor.from_local(out, mesh, [layout], run_check=False)
    # e.g. a whole embedding starting a sequence-parallel stream: this rank keeps its Shard(1) slice,
    # and backward all-gathers the slices' gradients, so the replicated weight's gradient is complete.
    return out if style.output_layouts is None else out.redistribute(mesh, [style.output_layouts])


class ReplicatedWithGradAllReduce(ReplicateParallel):
    """Replicated parameters applied to activations that differ per TP rank; gradients summed over TP.

    For norms that run on sharded activations without reducing over the sharded dim, e.g. Qwen3's
    per-head ``q_norm``/``k_norm`` after a column-wise projection (each rank sees its own heads). The
    plain input is read as ``Shard(input_dim)`` (default: the heads dim, ``-2``), so autograd yields a
    partial gradient, and the gradient hook sums it over the TP group: ``param.grad`` is a
    ``Replicate()`` DTensor and nothing is left to the training loop. Inside a block with sharded
    projections ``apply_tp`` lets the block's region decide (see ``ReplicateParallel``), so a norm
    on a whole activation is not reduced. The output is a plain tensor.
    """

    def __init__(self, *, input_dim: int = -2, use_local_output: bool = True) -> None:
        super().__init__(input_layouts=Shard(input_dim), use_local_output=use_local_output)
