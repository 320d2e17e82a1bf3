"""Styles that shard a module's own parameters: fused 3-D MoE experts, local-parameter owners, MLA ``kv_a``."""

from __future__ import annotations

from collections.abc import Mapping
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle
from torch.distributed.tensor.placement_types import Placement, _StridedShard

from plait.tp.embedding import check_1d
from plait.tp.replicate import ReplicateParallel

__all__ = [
    "PARAM_STYLES",
    "AllReduceParallel",
    "ExpertsTensorParallel",
    "IdentityExpertParallel",
    "LocalParamsParallel",
    "MlaKvAProjParallel",
    "param_placement",
]

PARAM_STYLES = frozenset({"colwise", "rowwise", "packed_colwise", "packed_rowwise"})
"""Plan styles that can name a parameter (``experts.gate_up_proj``) instead of a module."""


def param_placement(style: str, name: str, ndim: int) -> Placement:
    """The TP placement of a parameter that a plan names directly, by its style and shape.

    Weights are ``[..., out, in]`` (2-D linear or 3-D ``[experts, out, in]``): column-wise shards
    ``out``, row-wise ``in``; ``packed_*`` shards each of the two fused halves (gate and up) alike,
    so every rank keeps matching gate/up columns. A bias or a 1-D parameter (attention sinks) is
    sharded on its last dim column-wise and replicated row-wise.

    Raises:
        ValueError: ``style`` is not one of ``PARAM_STYLES``.
    """
    if style not in PARAM_STYLES:
        raise ValueError(
            f"style {style!r} cannot shard a parameter ({name!r}); use one of {sorted(PARAM_STYLES)}"
        )
    vector = ndim == 1 or name.endswith("bias")
    rowwise = style.endswith("rowwise")
    if vector and rowwise:
        return Replicate()
    dim = ndim - 1 if vector or rowwise else ndim - 2
    return _StridedShard(dim, split_factor=2) if style.startswith("packed") else Shard(dim)


class _ShardOwnParams(ParallelStyle):
    """Shard the parameters of ``param_styles`` and run the module's forward on their local shards."""

    all_optional = False
    """Whether a matched module may hold none of the named parameters (then it runs as it is)."""

    def __init__(self, param_styles: Mapping[str, str]) -> None:
        super().__init__()
        self.param_styles = dict(param_styles)

    def validate(self, fqn: str, module: nn.Module, tp_size: int) -> None:
        """Refuse parameters the plan leaves whole but that the sharded forward would mix with shards."""
        params = dict(module.named_parameters(recurse=False))
        missing = [name for name in self.param_styles if name not in params]
        if missing and not (self.all_optional and len(missing) == len(self.param_styles)):
            raise ValueError(
                f"the tp_plan shards {missing} of {fqn!r}, which has parameters {sorted(params)}"
            )
        for name in self.param_styles:
            if name in params:
                param_placement(self.param_styles[name], name, params[name].ndim)

    def _shard(self, module: nn.Module, mesh: DeviceMesh) -> None:
        for name, style in self.param_styles.items():
            param = module._parameters.get(name)
            if param is None:  # a layer without them (validated: only when all_optional)
                continue
            placement = param_placement(style, name, param.ndim)
            sharded = distribute_tensor(param.data, mesh, [placement], src_data_rank=self.src_data_rank)
            module.register_parameter(name, nn.Parameter(sharded, requires_grad=param.requires_grad))

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        check_1d(self, device_mesh)
        self._shard(module, device_mesh)
        module.forward = partial(_local_forward, module, module.forward, self, device_mesh)
        return module

    def prepare(self, args: tuple[Any, ...], kwargs: dict[str, Any], mesh: DeviceMesh) -> tuple[Any, Any]:
        """Inputs as the local forward needs them (default: unchanged)."""
        return args, kwargs

    def finish(self, output: Any, mesh: DeviceMesh) -> Any:
        """The local forward's output as the caller needs it (default: unchanged)."""
        return output


def _local_forward(
    module: nn.Module, forward: Any, style: _ShardOwnParams, mesh: DeviceMesh, *args: Any, **kwargs: Any
) -> Any:
    args, kwargs = style.prepare(args, kwargs, mesh)
    params = dict(module._parameters)
    for name, param in params.items():
        if isinstance(param, DTensor):
            module._parameters[name] = param.to_local()  # a shard's gradient is complete: same placements
    try:
        out = forward(*args, **kwargs)
    finally:
        module._parameters.update(params)
    return style.finish(out, mesh)


class LocalParamsParallel(_ShardOwnParams):
    """A module whose own parameters the plan shards (e.g. per-head attention sinks, ``colwise``).

    Its forward runs on the local shards; for an attention module whose projections are sharded by
    head, a per-head parameter sharded column-wise lines up with the local heads. A matched module
    holding none of the parameters runs as it is (MiMo-V2-Flash has sinks on some layers only); one
    holding some but not all is refused.
    """

    all_optional = True


class ExpertsTensorParallel(_ShardOwnParams):
    """Tensor parallel over fused 3-D expert weights (``[experts, out, in]``): every rank holds every expert.

    ``gate_up_proj`` is sharded on its output features (``packed_colwise`` keeps gate and up halves
    aligned), ``down_proj`` on its input features (``rowwise``): each rank computes a partial sum of
    every expert's output, summed over the TP group after the forward. The hidden states and the
    routing weights enter whole; their gradients, partial on each rank, are summed in backward. A
    bias on the row-wise side would be added once per rank and is refused. Public so that expert
    parallelism can reuse it inside an expert-parallel group.
    """

    def validate(self, fqn: str, module: nn.Module, tp_size: int) -> None:
        super().validate(fqn, module, tp_size)
        params = dict(module.named_parameters(recurse=False))
        whole = sorted(set(params) - set(self.param_styles))
        if whole:
            raise ValueError(
                f"experts module {fqn!r} has parameters {whole} that the tp_plan does not shard; with its "
                f"other weights sharded they would not line up; add them to the plan (e.g. "
                f"'{fqn}.{whole[0]}': 'colwise') or pass a tp_plan without the experts"
            )
        for name, style in self.param_styles.items():
            if isinstance(param_placement(style, name, params[name].ndim), Replicate):
                raise ValueError(
                    f"experts parameter '{fqn}.{name}' is row-wise replicated: it would be added once per TP "
                    "rank to the summed expert output; plait does not split such a bias; use expert "
                    "parallelism or tp_size 1 for this model"
                )

    def prepare(self, args: tuple[Any, ...], kwargs: dict[str, Any], mesh: DeviceMesh) -> tuple[Any, Any]:
        group = mesh.get_group()
        args = tuple(_whole_with_summed_grad(a, group) if i in (0, 2) else a for i, a in enumerate(args))
        for key in ("hidden_states", "top_k_weights", "routing_weights"):
            if key in kwargs:
                kwargs = {**kwargs, key: _whole_with_summed_grad(kwargs[key], group)}
        return args, kwargs

    def finish(self, output: Any, mesh: DeviceMesh) -> Any:
        if not isinstance(output, torch.Tensor):
            raise TypeError(
                f"ExpertsTensorParallel expects the experts to return a tensor, got {type(output)}"
            )
        return _SumForward.apply(output, mesh.get_group())


class AllReduceParallel(ExpertsTensorParallel):
    """A module whose own weights the plan shards, column- then row-wise, with its output summed over TP.

    Hugging Face's ``all_reduce`` owner style (Inkling's shared experts: 3-D ``gate_proj`` /
    ``up_proj`` column-wise, ``down_proj`` row-wise): like :class:`ExpertsTensorParallel`, but every
    floating-point input enters whole with its gradient summed (the owner's own argument order,
    e.g. ``(hidden_states, gammas)``), not only the experts' hidden states and routing weights.
    """

    def prepare(self, args: tuple[Any, ...], kwargs: dict[str, Any], mesh: DeviceMesh) -> tuple[Any, Any]:
        group = mesh.get_group()
        return (
            tuple(_whole_with_summed_grad(a, group) for a in args),
            {k: _whole_with_summed_grad(v, group) for k, v in kwargs.items()},
        )


def _whole_with_summed_grad(value: Any, group: dist.ProcessGroup) -> Any:
    if not isinstance(value, torch.Tensor) or not value.is_floating_point():
        return value
    if isinstance(value, DTensor):
        value = value.redistribute(placements=[Replicate()]).to_local()
    return _SumBackward.apply(value, group) if value.requires_grad else value


class _SumBackward(torch.autograd.Function):
    """Identity forward; sums the (partial) gradient over the group in backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _SumForward(torch.autograd.Function):
    """Sums partial outputs over the group; the (whole) output gradient passes through."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        total = x.contiguous().clone()
        dist.all_reduce(total, group=group)
        return total

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class IdentityExpertParallel(ParallelStyle):
    """An identity ("zero-computation") expert inside :class:`ExpertsTensorParallel` experts.

    The experts' output is summed over the TP group, so an expert that passes its tokens through
    would be counted once per rank: it returns ``1 / tp`` of its input instead (LongCat-Flash's
    ``identity_expert``). Its gradient needs nothing more: the experts' inputs and routing weights
    have their gradients summed over the group.
    """

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        check_1d(self, device_mesh)
        if any(True for _ in module.parameters()):
            raise ValueError(
                f"moe_identity_expert expects a parameter-free identity module, got {type(module).__name__} "
                "with parameters; pass a tp_plan without it"
            )
        module.register_forward_hook(partial(_divide_output, device_mesh.size()))
        return module


def _divide_output(tp: int, module: nn.Module, args: Any, output: Any) -> Any:
    return output / tp


class MlaKvAProjParallel(ParallelStyle):
    """DeepSeek-style latent attention's ``kv_a_proj_with_mqa``: replicated, with the RoPE key part's gradient summed.

    Its output splits into the latent part (into ``kv_b_proj``, column-wise: its gradient arrives
    complete) and a shared RoPE key broadcast to this rank's heads (its gradient is partial). The
    weights are ``Replicate()`` DTensors; the last ``rope_dim`` output features get their gradient
    summed over the TP group, so the weight gradient is complete.
    """

    def __init__(self, rope_dim: int) -> None:
        super().__init__()
        if isinstance(rope_dim, bool) or not isinstance(rope_dim, int) or rope_dim <= 0:
            raise ValueError(
                f"MlaKvAProjParallel needs a positive rope_dim (qk_rope_head_dim), got {rope_dim!r}"
            )
        self.rope_dim = rope_dim

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        ReplicateParallel()._apply(module, device_mesh)
        module.register_forward_hook(partial(_sum_rope_grad, self.rope_dim, device_mesh.get_group()))
        return module


def _sum_rope_grad(rope_dim: int, group: dist.ProcessGroup, module: nn.Module, args: Any, out: Any) -> Any:
    latent, rope = out.split([out.shape[-1] - rope_dim, rope_dim], dim=-1)
    return torch.cat([latent, _SumBackward.apply(rope, group) if rope.requires_grad else rope], dim=-1)
