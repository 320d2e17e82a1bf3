"""Sequence-parallel styles: norms on sequence shards, one all-gather per block, rotary on the whole sequence."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import ParallelStyle, SequenceParallel

from plait.tp.embedding import check_1d
from plait.tp.replicate import local_state, replicate_own_params

__all__ = [
    "GatherSequenceInput",
    "RotaryEmbeddingParallel",
    "SequenceParallelAllGather",
    "SequenceParallelBlock",
    "SequenceParallelNorm",
]


class SequenceParallelNorm(SequenceParallel):
    """``SequenceParallel`` (input and output ``Shard(sequence_dim)``) with summed parameter gradients.

    The replicated norm weights see a different slice of the sequence on each rank, so autograd gives
    them partial gradients; a gradient hook sums them over the TP group, so ``param.grad`` is a
    ``Replicate()`` DTensor and nothing is left to the optimizer or the training loop.
    """

    def _replicate_module_fn(self, name: str, module: nn.Module, device_mesh: DeviceMesh) -> None:
        replicate_own_params(name, module, device_mesh)


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
        check_1d(self, device_mesh)
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
        check_1d(self, device_mesh)
        module.register_forward_pre_hook(_rotary_pre_hook, with_kwargs=True)
        module.register_forward_hook(_rotary_post_hook)
        return module


def _rotary_pre_hook(
    module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    return _to_full(args), {k: _to_full(v) for k, v in kwargs.items()}


def _rotary_post_hook(module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
    return _to_full(output)


class SequenceParallelBlock(ParallelStyle):
    """Run a whole block (attention or MLP) on the full sequence inside a sequence-parallel model.

    For blocks whose inner styles cannot take a sequence-sharded input (fused experts, latent
    attention, a block that is itself ``local_params``, given as ``inner``): the ``Shard(1)`` hidden
    states (first positional argument, else ``hidden_states``) are all-gathered into a plain tensor,
    the block runs as under TP without SP (its output whole on every rank), and each output with the
    input's (batch, sequence) dims is handed back as a ``Shard(1)`` DTensor: this rank's sequence
    slice, all-gathered again in backward.

    With ``replicate_params`` (a block no plan entry reaches) the parameters and buffers of the block
    and its children become ``Replicate()`` DTensors, swapped for local tensors while the hooked
    forward runs on the gathered sequence (every rank computes the same, complete, gradient). A call
    that bypasses the hooks (Gemma3n's decoder calls AltUp's ``predict`` and ``correct`` methods,
    and its ``forward`` directly, on the ``Shard(1)`` stream) then runs through DTensor, whose rules
    give complete gradients, instead of mixing plain weights with DTensor activations.
    """

    def __init__(self, inner: ParallelStyle | None = None, *, replicate_params: bool = False) -> None:
        super().__init__()
        if inner is not None and replicate_params:
            raise ValueError(
                "SequenceParallelBlock(replicate_params=True) is for a block without an inner style"
            )
        self.inner = inner
        self.replicate_params = replicate_params

    @property
    def param_styles(self) -> dict[str, str]:
        """The inner style's own sharded parameters (a block that is itself ``local_params``)."""
        return dict(getattr(self.inner, "param_styles", {}))

    def validate(self, fqn: str, module: nn.Module, tp_size: int) -> None:
        """The inner style's own check, before any style communicates."""
        validate = getattr(self.inner, "validate", None)
        if callable(validate):
            validate(fqn, module, tp_size)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        check_1d(self, device_mesh)
        if self.inner is not None:  # e.g. attention sinks: the block's own style, run inside the hooks
            module = self.inner._apply(module, device_mesh)
        if self.replicate_params:
            distribute_module(module, device_mesh, replicate_own_params)
            module.forward = partial(_local_forward, module, module.forward)
        module.register_forward_pre_hook(partial(_block_pre_hook, device_mesh), with_kwargs=True)
        module.register_forward_hook(partial(_block_post_hook, device_mesh), with_kwargs=True)
        return module


def _local_forward(module: nn.Module, forward: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """The block's forward on local weights for the gathered (plain) sequence, through DTensor otherwise."""
    if any(isinstance(v, DTensor) for v in (*args, *kwargs.values())):
        return forward(*args, **kwargs)  # called past the hooks, on the Shard(1) stream
    with local_state(module, Replicate()):
        return forward(*args, **kwargs)


def _whole(value: Any, mesh: DeviceMesh) -> Any:
    if not isinstance(value, torch.Tensor):
        return value
    if not isinstance(value, DTensor):
        value = DTensor.from_local(value, mesh, (Shard(1),), run_check=False)
    return value.redistribute(mesh, (Replicate(),)).to_local()


def _block_pre_hook(
    mesh: DeviceMesh, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    # Every other DTensor argument (rotary tables computed from the sharded stream) is made whole too:
    # the block runs on plain full-sequence tensors, as without SP. The hidden states are gathered once.
    key = None if args else "hidden_states"
    rest = {k: _to_full(v) for k, v in kwargs.items() if k != key}
    if args:
        return (_whole(args[0], mesh), *_to_full(args[1:])), rest
    if key in kwargs:
        return args, {**rest, key: _whole(kwargs[key], mesh)}
    raise ValueError(
        f"{type(module).__name__} was called with neither a positional input nor `hidden_states`; "
        "SequenceParallelBlock cannot find the hidden states to gather"
    )


def _block_post_hook(
    mesh: DeviceMesh, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any
) -> Any:
    """Hand back this rank's ``Shard(1)`` slice of every output laid out like the gathered input.

    A tensor output, or each element of a tuple output whose leading (batch, sequence) dims are the
    input's: a hyper-connection returns its mixing weights beside the hidden states, an attention
    block its attention weights (left whole). A first output with the tokens flattened
    (``[batch * seq, hidden]``, Llama4's MoE) comes back as ``[batch, seq, hidden]``; the caller's
    ``view(residual.shape)`` then reads it as before.
    """
    hidden = args[0] if args else kwargs.get("hidden_states")
    lead = tuple(hidden.shape[:2]) if isinstance(hidden, torch.Tensor) else None

    def scatter(value: Any, first: bool) -> Any:
        if not isinstance(value, torch.Tensor) or isinstance(value, DTensor) or lead is None:
            return value
        if first and value.shape[0] == lead[0] * lead[1] and tuple(value.shape[:2]) != lead:
            value = value.unflatten(0, lead)  # tokens flattened by the block (Llama4's MoE): (batch, seq)
        if tuple(value.shape[:2]) != lead:
            return value
        return DTensor.from_local(value, mesh, (Replicate(),), run_check=False).redistribute(
            mesh, (Shard(1),)
        )

    if isinstance(output, torch.Tensor):
        return scatter(output, True)
    if isinstance(output, tuple) and output and isinstance(output[0], torch.Tensor):
        return tuple(scatter(value, i == 0) for i, value in enumerate(output))
    raise TypeError(f"SequenceParallelBlock expects {type(module).__name__} to return a tensor or a tuple")
