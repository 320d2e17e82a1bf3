"""Expert parallelism: shard grouped experts on the ``ep`` mesh and all-to-all their tokens.

The experts contract: a module whose parameters all have the expert index as dim 0, called as
``experts(tokens_grouped_by_expert [T, H], num_tokens_per_expert [E])`` and returning ``[T, H]`` in the
same order. Under :class:`ExpertParallel` each ep rank holds ``E / ep`` consecutive experts; the wrapped
forward sends every token to the rank that owns its expert (uneven splits), runs the local experts on the
tokens grouped by local expert, and sends the results back.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed._functional_collectives import (
    all_to_all_single,
    all_to_all_single_autograd,
    wait_tensor,
)
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle

__all__ = ["ExpertParallel", "num_experts_of"]


def num_experts_of(experts: nn.Module) -> int:
    """The expert count of a module following the experts contract (the shared dim 0 of its parameters).

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


class ExpertParallel(ParallelStyle):
    """Shard an experts module ``Shard(0)`` over a 1-D ``ep`` mesh and wrap its forward in all-to-alls.

    Apply with ``parallelize_module(experts, ep_mesh, ExpertParallel())``. Gradients flow back through
    both all-to-alls, so an expert's gradient on its owner rank sums the contributions of the tokens of
    every ep rank.
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
        dispatcher = _TokenDispatcher(ep, num_experts // ep)
        return distribute_module(
            module,
            device_mesh,
            partition_fn=_shard_dim0,
            input_fn=dispatcher.dispatch,
            output_fn=dispatcher.combine,
        )


def _shard_dim0(name: str, module: nn.Module, mesh: DeviceMesh) -> None:
    for pname, param in list(module.named_parameters(recurse=False)):
        if isinstance(param, DTensor):
            continue
        sharded = nn.Parameter(distribute_tensor(param, mesh, [Shard(0)]), requires_grad=param.requires_grad)
        module.register_parameter(pname, sharded)


class _TokenDispatcher:
    """Forward pre-hook / hook pair of one experts module; keeps the splits between the two."""

    def __init__(self, ep: int, num_local_experts: int) -> None:
        self.ep = ep
        self.num_local_experts = num_local_experts
        self._pending: list[tuple[list[int], list[int], torch.Tensor]] = []

    def dispatch(
        self, module: nn.Module, inputs: tuple[torch.Tensor, ...], mesh: DeviceMesh
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Send tokens to the ranks owning their experts; return them grouped by local expert."""
        tokens, num_tokens_per_expert = inputs
        group = mesh.get_group()
        counts = num_tokens_per_expert.detach().to(torch.int64)
        received_counts = wait_tensor(all_to_all_single(counts, None, None, group))
        # received_counts[src * L + e]: tokens rank ``src`` sends to local expert ``e``.
        input_splits = counts.view(self.ep, -1).sum(dim=1).tolist()
        output_splits = received_counts.view(self.ep, -1).sum(dim=1).tolist()
        received = all_to_all_single_autograd(tokens, output_splits, input_splits, group)
        local_expert = torch.arange(self.num_local_experts, device=counts.device).repeat(self.ep)
        slot_expert = torch.repeat_interleave(local_expert, received_counts)
        order = torch.argsort(slot_expert, stable=True)
        self._pending.append((input_splits, output_splits, order))
        per_local_expert = received_counts.view(self.ep, self.num_local_experts).sum(dim=0)
        return received[order], per_local_expert.to(num_tokens_per_expert.dtype)

    def combine(self, module: nn.Module, outputs: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
        """Undo the local grouping and send each result back to the rank its token came from."""
        input_splits, output_splits, order = self._pending.pop()
        restored = torch.empty_like(outputs).index_copy(0, order, outputs)
        return all_to_all_single_autograd(restored, input_splits, output_splits, mesh.get_group())
