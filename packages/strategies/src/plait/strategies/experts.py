"""Expert parallelism: shard an experts module on the ``ep`` mesh and all-to-all its tokens.

Two calling conventions of an experts module are understood, told apart by its forward's arity:

* *routed* (Hugging Face ``transformers`` >= 5: Mixtral, Qwen2/3-MoE, OLMoE, DeepSeek-V3, GPT-OSS, ...):
  ``experts(hidden_states [T, H], top_k_index [T, k], top_k_weights [T, k]) -> [T, H]``, the weighted sum
  of each token's experts;
* *grouped* (plait's reference ``GroupedExperts``, torchtitan-style): ``experts(tokens_grouped_by_expert
  [S, H], num_tokens_per_expert [E]) -> [S, H]`` in the same order.

Every parameter of the module has the expert index as dim 0 (the fused 3-D ``gate_up_proj`` /
``down_proj`` layout, biases included). Under :class:`ExpertParallel` each ep rank holds ``E / ep``
consecutive experts as a ``Shard(0)`` DTensor (global shape and state-dict keys unchanged). The
module's forward is wrapped (the instance attribute, never the class): every (token, expert) pair goes
to the rank owning the expert in one all-to-all (uneven splits, dropless), the module's own forward runs
on its local experts with local parameters, a second all-to-all brings the results back, and - for the
routed convention - the routing weights are applied on the sender, so the router's gradient stays local.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.distributed._functional_collectives import (
    all_to_all_single,
    all_to_all_single_autograd,
    wait_tensor,
)
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle

__all__ = ["ExpertParallel", "experts_convention", "num_experts_of"]

_ARITY = {2: "grouped", 3: "routed"}


def num_experts_of(experts: nn.Module) -> int:
    """The expert count of an experts module (the shared dim 0 of all its parameters).

    Raises:
        ValueError: the module has no parameters or its parameters disagree on dim 0.
    """
    sizes = {name: p.shape[0] if p.dim() > 0 else None for name, p in experts.named_parameters()}
    if not sizes:
        raise ValueError(f"{type(experts).__name__} has no parameters; expert parallel needs stacked experts")
    if None in sizes.values() or len(set(sizes.values())) != 1:
        raise ValueError(
            f"{type(experts).__name__} does not follow the experts contract (every parameter's dim 0 is the "
            f"expert index); dim-0 sizes: {sizes}"
        )
    return next(iter(sizes.values()))


def experts_convention(experts: nn.Module) -> str:
    """``"routed"`` (hidden, top_k_index, top_k_weights) or ``"grouped"`` (tokens, counts per expert).

    Raises:
        TypeError: the forward takes neither 2 nor 3 positional arguments.
    """
    params = inspect.signature(experts.forward).parameters.values()
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    convention = _ARITY.get(len(positional))
    if convention is None:
        raise TypeError(
            f"{type(experts).__name__}.forward takes {[p.name for p in positional]}; expert parallel needs "
            "forward(hidden_states, top_k_index, top_k_weights) (Hugging Face) or "
            "forward(tokens_grouped_by_expert, num_tokens_per_expert)"
        )
    return convention


class ExpertParallel(ParallelStyle):
    """Shard an experts module ``Shard(0)`` over a 1-D ``ep`` mesh and wrap its forward in all-to-alls.

    Apply with ``parallelize_module(experts, ep_mesh, ExpertParallel())``. Gradients flow back through
    both all-to-alls, so an expert's gradient on its owner rank sums the contributions of the tokens of
    every ep rank. A ``num_experts`` attribute of the module is set to the local count, as the module's
    own forward then only ever sees local expert ids.
    """

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if device_mesh.ndim != 1:
            raise ValueError(
                f"ExpertParallel needs a 1-D ep mesh, got a {device_mesh.ndim}-D mesh {device_mesh}"
            )
        num_experts = num_experts_of(module)
        ep = device_mesh.size()
        if num_experts % ep != 0:
            raise ValueError(
                f"num_experts ({num_experts}) of {type(module).__name__} must be divisible by ep_size ({ep}); "
                f"use an ep_size that divides {num_experts}"
            )
        convention = experts_convention(module)
        for owner in module.modules():
            for name, param in list(owner.named_parameters(recurse=False)):
                if not isinstance(param, DTensor):
                    sharded = distribute_tensor(param.detach(), device_mesh, [Shard(0)])
                    owner.register_parameter(name, nn.Parameter(sharded, requires_grad=param.requires_grad))
        if isinstance(getattr(module, "num_experts", None), int):
            module.num_experts = num_experts // ep
        exchange = _Exchange(device_mesh, num_experts // ep)
        wrap = _routed_forward if convention == "routed" else _grouped_forward
        module.forward = wrap(module, module.forward, exchange)
        return module


@contextlib.contextmanager
def _local_parameters(module: nn.Module) -> Iterator[None]:
    """Hand the module's own forward plain local tensors in place of its DTensor parameters."""
    swapped: list[tuple[nn.Module, str, nn.Parameter]] = []
    for owner in module.modules():
        for name, param in list(owner._parameters.items()):
            if isinstance(param, DTensor):
                swapped.append((owner, name, param))
                owner._parameters[name] = param.to_local()  # type: ignore[assignment]
    try:
        yield
    finally:
        for owner, name, param in swapped:
            owner._parameters[name] = param


class _Exchange:
    """The two all-to-alls of one experts module on its ep mesh."""

    def __init__(self, mesh: DeviceMesh, num_local_experts: int) -> None:
        self.mesh = mesh
        self.ep = mesh.size()
        self.num_local = num_local_experts

    def send(
        self, tokens: torch.Tensor, counts: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, tuple[list[int], list[int], torch.Tensor]]:
        """Send ``tokens`` (grouped by global expert, ``counts [E]`` each) to the experts' owners.

        Returns the received tokens grouped by local expert, their counts ``[E / ep]`` and the state
        :meth:`receive` needs.
        """
        group = self.mesh.get_group()
        counts = counts.detach().to(torch.int64)
        received_counts = wait_tensor(all_to_all_single(counts, None, None, group))
        # received_counts[src * L + e]: tokens rank ``src`` sends to local expert ``e``.
        input_splits = counts.view(self.ep, -1).sum(dim=1).tolist()
        output_splits = received_counts.view(self.ep, -1).sum(dim=1).tolist()
        received = all_to_all_single_autograd(tokens, output_splits, input_splits, group)
        local_expert = torch.arange(self.num_local, device=counts.device).repeat(self.ep)
        order = torch.argsort(torch.repeat_interleave(local_expert, received_counts), stable=True)
        per_local = received_counts.view(self.ep, self.num_local).sum(dim=0)
        return received[order], per_local, (input_splits, output_splits, order)

    def receive(
        self, outputs: torch.Tensor, state: tuple[list[int], list[int], torch.Tensor]
    ) -> torch.Tensor:
        """Undo the local grouping and send each result back to the rank its token came from."""
        input_splits, output_splits, order = state
        restored = torch.empty_like(outputs).index_copy(0, order, outputs)
        return all_to_all_single_autograd(restored, input_splits, output_splits, self.mesh.get_group())


Forward = Callable[..., torch.Tensor]


def _grouped_forward(module: nn.Module, forward: Forward, exchange: _Exchange) -> Forward:
    def ep_forward(tokens: torch.Tensor, num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
        received, per_local, state = exchange.send(tokens, num_tokens_per_expert)
        with _local_parameters(module):
            outputs = forward(received, per_local.to(num_tokens_per_expert.dtype))
        return exchange.receive(outputs, state)

    return ep_forward


def _routed_forward(module: nn.Module, forward: Forward, exchange: _Exchange) -> Forward:
    num_experts = exchange.ep * exchange.num_local

    def ep_forward(hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> Any:
        tokens, k = hidden.shape[0], top_k_index.shape[-1]
        expert_of_slot = top_k_index.reshape(-1)
        order = torch.argsort(expert_of_slot, stable=True)
        counts = torch.bincount(expert_of_slot, minlength=num_experts)
        received, per_local, state = exchange.send(hidden[order // k], counts)
        local_ids = torch.repeat_interleave(torch.arange(exchange.num_local, device=hidden.device), per_local)
        num_received = received.shape[0]
        if num_received == 0:
            # Keep this rank's experts in the graph with one zero row, so every rank runs both
            # all-to-alls' backward and every expert parameter gets a (zero) gradient.
            received, local_ids = received.sum(dim=0, keepdim=True), local_ids.new_zeros(1)
        unit = torch.ones(received.shape[0], 1, dtype=top_k_weights.dtype, device=hidden.device)
        with _local_parameters(module):
            outputs = forward(received, local_ids.unsqueeze(-1), unit)[:num_received]
        slots = exchange.receive(outputs, state)
        slots = torch.empty_like(slots).index_copy(0, order, slots).view(tokens, k, -1)
        return (slots * top_k_weights.unsqueeze(-1).to(slots.dtype)).sum(dim=1).to(hidden.dtype)

    return ep_forward
