"""The all-to-all ("Ulysses") context-parallel attention: the heads are split over cp, not the sequence.

Each cp rank holds its load-balanced part of the sequence (`plait.cp.layout`) for every head. One
all-to-all over the cp group sends head group ``j`` of q, k and v to rank ``j``, which then holds
every token of its ``heads / cp`` heads; the tokens arrive rank by rank (each rank's head and tail
chunk), so they are put back in sequence order before plain SDPA runs with the whole sequence's
causal mask. A second all-to-all returns each rank its own tokens for every head. Backward is the
same two all-to-alls of the gradients, in reverse order.

Key/value heads that do not divide by cp (GQA with fewer KV heads than cp ranks, say) are repeated,
each ``lcm(kv_heads, cp) / kv_heads`` times, so every rank receives the KV heads its query heads
read; autograd sums the repeats' gradients. The query heads must divide by cp.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from plait.cp.blocks import FULL, Features, masked_scores
from plait.cp.layout import rank_order


def all_to_all_refusal(heads: int, cp_size: int) -> str | None:
    """Why ``heads`` local query heads (after TP) cannot be split over cp, or None.

    Any number of KV heads works: they are repeated up to a multiple of cp (`kv_repeats`).
    """
    if heads % cp_size:
        return (
            f"cp_attention='all_to_all' splits the query heads over cp, but {heads} local query heads "
            f"(after TP) do not divide by cp_size={cp_size}; use cp_attention='all_gather' or 'ring', "
            "or a cp_size that divides them"
        )
    return None


def kv_repeats(kv_heads: int, cp_size: int) -> int:
    """How many times each KV head is repeated so the KV heads divide by cp (1 when they already do)."""
    return math.lcm(kv_heads, cp_size) // kv_heads


class _AllToAll(torch.autograd.Function):
    """Block ``j`` of dim 0 (``[cp, ...]``) goes to cp rank ``j``; block ``s`` of the result came from rank ``s``.

    The exchange is its own transpose, so backward is the same all-to-all of the gradient.
    """

    @staticmethod
    def forward(ctx: Any, blocks: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return _exchange(blocks, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _exchange(grad, ctx.group), None


def _exchange(blocks: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    blocks = blocks.contiguous()
    out = torch.empty_like(blocks)
    dist.all_to_all_single(out, blocks, group=group)
    return out


def _to_heads(
    tensors: list[torch.Tensor], group: dist.ProcessGroup, order: torch.Tensor
) -> list[torch.Tensor]:
    """``[B, H, L/cp, D]`` tensors (this rank's tokens, every head) -> ``[B, H/cp, L, D]`` (every token, in order).

    One all-to-all carries all of them; ``order`` is `plait.cp.layout.rank_order`.
    """
    cp_size = dist.get_world_size(group)
    blocks = [t.unflatten(1, (cp_size, -1)).movedim(1, 0) for t in tensors]  # [cp, B, H/cp, L/cp, D]
    received = _AllToAll.apply(torch.cat(blocks, dim=2), group)  # dim 0: the source rank
    gathered = received.movedim(0, 2).flatten(2, 3)  # [B, sum H/cp, L, D], rank by rank
    in_order = gathered.index_select(2, torch.argsort(order))
    return list(in_order.split([b.shape[2] for b in blocks], dim=1))


def _to_sequence(out: torch.Tensor, group: dist.ProcessGroup, order: torch.Tensor) -> torch.Tensor:
    """The inverse of `_to_heads` for one tensor: ``[B, H/cp, L, D]`` -> ``[B, H, L/cp, D]``."""
    cp_size = dist.get_world_size(group)
    blocks = out.index_select(2, order).unflatten(2, (cp_size, -1)).movedim(2, 0)  # dim 0: the owner
    received = _AllToAll.apply(blocks, group)  # dim 0: the head group
    return received.movedim(0, 1).flatten(1, 2)


def whole_sequence_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    features: Features,
    scale: float,
    sinks: torch.Tensor | None,
    documents: torch.Tensor | None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention over the whole sequence (``[B, H, L, D]``; ``sinks``: ``[H]``; ``documents``: ``[B, L]``).

    ``bias`` (broadcastable to the ``[B, H, L, L]`` scores): a boolean mask of the keys kept or an
    additive float bias, applied after the soft-cap, as transformers' eager attention applies masks.
    Plain causal / full attention goes to SDPA; a window, soft-capping, sinks, documents or a bias are
    computed by hand (scores materialised, as CPU SDPA does; autograd differentiates them).
    """
    plain = features.window is None and features.softcap is None
    if plain and sinks is None and documents is None and bias is None:
        return F.scaled_dot_product_attention(
            q, k, v, is_causal=features.causal, scale=scale, enable_gqa=q.shape[1] != k.shape[1]
        )
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    mode = 0 if features.causal else FULL  # one chunk: the whole sequence
    s = masked_scores(q, k, scale, mode, features, None if documents is None else (documents, documents))
    if bias is not None:
        s = s.masked_fill(~bias, float("-inf")) if bias.dtype == torch.bool else s + bias.float()
    if sinks is None:
        p = torch.softmax(s, dim=-1)
    else:
        sink = sinks.float()[None, :, None, None].expand(*s.shape[:-1], 1)
        p = torch.softmax(torch.cat([s, sink], dim=-1), dim=-1)[..., :-1]
    return torch.matmul(p, v.float()).to(q.dtype)


def all_to_all_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group: dist.ProcessGroup,
    features: Features,
    scale: float,
    sinks: torch.Tensor | None = None,
    documents: torch.Tensor | None = None,
) -> torch.Tensor:
    """Context-parallel attention by all-to-all (shapes as `plait.cp.variants.all_gather_attention`).

    Raises:
        ValueError: the query heads do not divide by the cp group's size (`all_to_all_refusal`).
    """
    cp_size = dist.get_world_size(group)
    kv_heads, per_kv = q.shape[1], q.shape[2]
    why = all_to_all_refusal(kv_heads * per_kv, cp_size)
    if why is not None:
        raise ValueError(why)
    repeat = kv_repeats(kv_heads, cp_size)
    k, v = (t.squeeze(2).repeat_interleave(repeat, dim=1) for t in (k, v))
    order = rank_order(q.shape[-2], cp_size, q.device)
    qh, kh, vh = _to_heads([q.flatten(1, 2), k, v], group, order)
    local_sinks = None if sinks is None else sinks.flatten().chunk(cp_size)[dist.get_rank(group)]
    out = whole_sequence_attention(qh, kh, vh, features, scale, local_sinks, documents)
    return _to_sequence(out, group, order).unflatten(1, (kv_heads, per_kv))
