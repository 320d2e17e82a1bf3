"""Sequence mixers cp cannot split, run on the whole sequence: ``FSDP2Config.cp_sequence_mixers="gather"``.

A convolution over time, a state-space (Mamba) or linear-attention (gated delta net, lightning) layer,
or an attention whose keys pass through such a convolution, reads its neighbours along the sequence
in its own forward, where cp attention cannot step in. Such a module (the child of a decoder layer
that holds it) can run *gathered*: before it, its sequence-shaped inputs are all-gathered over cp and
put back in sequence order; after it, each rank keeps its own tokens of the output. It is then the
unsharded module on the unsharded sequence, so the result is exact:

- the gradient of a gathered input is reduce-scattered (summed over ranks), so each rank's tokens get
  every rank's contribution;
- gradients of the module's parameters are, as for every parameter under cp, each rank's share of the
  sum, which the FSDP reduction over ``dp_shard x cp`` adds up.

Inside a gathered module nothing is saved: it holds and computes the whole sequence on every cp rank.
Attention inside one runs over the whole sequence on one rank (`WholeSequenceAttention`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from plait.cp.all_to_all import whole_sequence_attention
from plait.cp.blocks import Features
from plait.cp.layout import global_positions, rank_order

__all__ = ["GatheredSequence", "WholeSequenceAttention", "gather_ranks", "gather_target"]


class _GatherRanks(torch.autograd.Function):
    """All-gather a tensor over the group to ``[cp, ...]``; backward reduce-scatters (sums) the gradient."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        out = tensor.new_empty((dist.get_world_size(group), *tensor.shape))
        dist.all_gather_into_tensor(out, tensor.contiguous().unsqueeze(0), group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        out = grad.new_empty((1, *grad.shape[1:]))
        dist.reduce_scatter_tensor(out, grad.contiguous(), group=ctx.group)
        return out.squeeze(0), None


def gather_ranks(tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Every rank's ``tensor`` stacked in rank order, ``[cp, *tensor.shape]``; its gradient is summed back."""
    return _GatherRanks.apply(tensor, group)


def gather_target(model: nn.Module, name: str) -> str | None:
    """The module to gather for a sequence mixer at ``name``: the child of the decoder layer holding it.

    A decoder layer is an element of an ``nn.ModuleList``; a mixer directly in a layer is its own
    target. None when no ``ModuleList`` holds ``name`` (nothing to anchor the gather to).
    """
    parts = name.split(".")
    modules = dict(model.named_modules())
    for depth in range(len(parts) - 1, 0, -1):
        parent = ".".join(parts[: depth - 1])
        if isinstance(modules.get(parent), nn.ModuleList):
            return ".".join(parts[: depth + 1])
    return None


class GatheredSequence:
    """The forward pre-hook and forward hook that run one module on the whole cp-sharded sequence.

    The hidden states (first positional argument or ``hidden_states=``) set the batch and the local
    length; every tensor argument shaped ``[batch, local, ...]`` (positions, rotary tables) is gathered,
    a 1-D ``cache_position`` becomes the whole sequence's, and an output shaped ``[batch, whole, ...]``
    is cut back to this rank's tokens. A tensor that holds the local length in another dim (a 4-D mask)
    or a DTensor is refused: it cannot be gathered as a sequence.
    """

    def __init__(self, mesh: DeviceMesh, name: str, *, causal_mask: bool = False) -> None:
        self.group, self.cp_size, self.cp_rank = mesh.get_group(), mesh.size(), mesh.get_local_rank()
        self.name = name
        self.causal_mask = causal_mask  # hand the module the whole sequence's causal mask (sparse attention)

    def attach(self, module: nn.Module) -> None:
        """Register both hooks on ``module``."""
        module.register_forward_pre_hook(self.before, with_kwargs=True)
        module.register_forward_hook(self.after, with_kwargs=True)

    def before(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """Gather the sequence-shaped inputs (checked first, so every rank refuses before any collective)."""
        hidden = args[0] if args else kwargs.get("hidden_states")
        if not isinstance(hidden, torch.Tensor) or hidden.ndim < 2:
            raise ValueError(
                f"{self.name} ({type(module).__name__}) runs gathered under cp but its hidden states are not "
                "a [batch, seq, ...] tensor (first argument or hidden_states=); set cp_sequence_mixers='refuse'"
            )
        shape = (hidden.shape[0], hidden.shape[1])
        named = [(f"argument {i}", a) for i, a in enumerate(args)] + list(kwargs.items())
        for key, value in named:
            self._check(module, key, value, shape)
        mask = self._whole_causal_mask(module, kwargs, shape, hidden.device) if self.causal_mask else None
        new_args = tuple(self._convert(f"argument {i}", a, shape) for i, a in enumerate(args))
        new_kwargs = {k: self._convert(k, v, shape) for k, v in kwargs.items()}
        if mask is not None:
            new_kwargs["attention_mask"] = mask
        return new_args, new_kwargs

    def _whole_causal_mask(
        self, module: nn.Module, kwargs: dict[str, Any], shape: tuple[int, int], device: torch.device
    ) -> torch.Tensor:
        """``[B, 1, L, L]`` keys kept (causal, within the module's ``sliding_window`` if it has one): cp
        attention's models build no mask, a sparse indexer needs one."""
        if "attention_mask" not in kwargs or kwargs["attention_mask"] is not None:
            raise ValueError(
                f"{self.name} ({type(module).__name__}) runs gathered under cp and needs the causal mask as "
                f"attention_mask=None (got {'none passed' if 'attention_mask' not in kwargs else 'a mask'}); "
                "set cp_sequence_mixers='refuse'"
            )
        whole = shape[1] * self.cp_size
        offset = torch.arange(whole, device=device)[:, None] - torch.arange(whole, device=device)[None, :]
        keep = offset >= 0
        window = getattr(module, "sliding_window", None)
        if isinstance(window, int):  # transformers' rule: key j is seen by query i when i - j < window
            keep = keep & (offset < window)
        return keep[None, None].expand(shape[0], 1, whole, whole)

    def after(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> Any:
        """This rank's tokens of every ``[batch, whole, ...]`` output."""
        hidden = args[0] if args else kwargs["hidden_states"]
        return self._cut(output, hidden.shape[0], hidden.shape[1])

    def _check(self, module: nn.Module, key: str, value: Any, shape: tuple[int, int]) -> None:
        if isinstance(value, tuple | list):
            for item in value:
                self._check(module, key, item, shape)
            return
        if not isinstance(value, torch.Tensor) or key == "cache_position":
            return
        if isinstance(value, DTensor):
            raise ValueError(
                f"{self.name} ({type(module).__name__}) runs gathered under cp but its input {key} is a "
                "DTensor (sequence parallel); turn sequence_parallel off or set cp_sequence_mixers='refuse'"
            )
        sequence = value.ndim >= 2 and (value.shape[0], value.shape[1]) == shape
        if not sequence and shape[1] in value.shape:
            raise ValueError(
                f"{self.name} ({type(module).__name__}) runs gathered under cp but its input {key} "
                f"{tuple(value.shape)} holds the local sequence ({shape[1]}) otherwise than as [batch, seq, ...] "
                "(a mask?); it cannot be gathered: train without it or set cp_sequence_mixers='refuse'"
            )

    def _convert(self, key: str, value: Any, shape: tuple[int, int]) -> Any:
        if isinstance(value, tuple | list):
            return type(value)(self._convert(key, item, shape) for item in value)
        if not isinstance(value, torch.Tensor):
            return value
        if key == "cache_position" and value.ndim == 1:
            return torch.arange(shape[1] * self.cp_size, device=value.device, dtype=value.dtype)
        if value.ndim >= 2 and (value.shape[0], value.shape[1]) == shape:
            return self._gather(value)
        return value

    @torch.compiler.disable  # a collective inside an autograd function
    def _gather(self, local: torch.Tensor) -> torch.Tensor:
        blocks = gather_ranks(local, self.group)  # [cp, B, L/cp, ...], rank by rank
        by_rank = blocks.movedim(0, 1).flatten(1, 2)
        order = rank_order(local.shape[1], self.cp_size, local.device)
        return by_rank.index_select(1, torch.argsort(order))

    def _cut(self, value: Any, batch: int, whole: int) -> Any:
        if isinstance(value, tuple | list):
            return type(value)(self._cut(item, batch, whole) for item in value)
        if (
            isinstance(value, torch.Tensor)
            and value.ndim >= 2
            and (value.shape[0], value.shape[1]) == (batch, whole)
        ):
            index = global_positions(whole, self.cp_rank, self.cp_size, device=value.device)
            return value.index_select(1, index)
        return value


class WholeSequenceAttention:
    """`ContextParallelAttention`'s call signature for an attention inside a gathered module.

    Its queries, keys and values already hold the whole sequence (in order), so it is plain attention
    with the same features (causal, window, soft-cap, sinks) on one rank, without a collective. It
    also takes what sparse and biased attention modules hand their attention function: a mask
    (boolean keys kept, or additive), DSA's top-k ``indices`` (``[B, L, k]``: only those keys) and an
    additive ``position_bias`` (Inkling).
    """

    extra_kwargs = ("indices", "position_bias")
    """The attention-function keywords taken beyond `ContextParallelAttention`'s."""

    def __repr__(self) -> str:
        return "WholeSequenceAttention()"

    def __call__(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        dropout_p: float = 0.0,
        *,
        is_causal: bool = False,
        scale: float | None = None,
        enable_gqa: bool = False,
        window: int | None = None,
        softcap: float | None = None,
        sinks: torch.Tensor | None = None,
        documents: torch.Tensor | None = None,
        indices: torch.Tensor | None = None,
        position_bias: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if dropout_p or documents is not None:
            raise ValueError(
                "attention inside a module cp runs gathered takes no dropout or packed documents; run this "
                "model with cp_size 1"
            )
        if isinstance(sinks, DTensor):
            sinks = sinks.to_local()
        scale = query.shape[-1] ** -0.5 if scale is None else float(scale)
        features = Features(bool(is_causal), window, softcap)
        bias = _bias(attn_mask, indices, position_bias, key.shape[-2])
        return whole_sequence_attention(query, key, value, features, scale, sinks, None, bias)


def _bias(
    mask: torch.Tensor | None, indices: torch.Tensor | None, position_bias: torch.Tensor | None, keys: int
) -> torch.Tensor | None:
    """One boolean keep-mask or additive bias from an attention mask, top-k key indices and a position bias."""
    if indices is not None:
        chosen = torch.zeros((*indices.shape[:-1], keys), dtype=torch.bool, device=indices.device)
        chosen = chosen.scatter(-1, indices.long(), True).unsqueeze(1)  # [B, 1, L, keys]
        mask = chosen if mask is None else _and(mask, chosen)
    if position_bias is None:
        return mask
    if mask is None:
        return position_bias
    return position_bias.float() + (_additive(mask) if mask.dtype == torch.bool else mask.float())


def _and(mask: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    if mask.dtype == torch.bool:
        return mask & keep
    return mask.float().masked_fill(~keep, float("-inf"))


def _additive(keep: torch.Tensor) -> torch.Tensor:
    return torch.zeros(keep.shape, device=keep.device).masked_fill(~keep, float("-inf"))
