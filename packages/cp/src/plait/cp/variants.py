"""The two context-parallel attention algorithms as autograd functions over the cp process group.

``all_gather``: every rank gathers all K/V (one all-gather forward, one reduce-scatter of their
gradients backward) and attends its two query chunks to every visible key chunk.
``ring``: K/V travel round the ring, one neighbour hop per step, while each rank merges the partial
results (log-sum-exp); backward sends K/V round again with their gradient accumulators, which land
back at their owner after the last hop. Both work with any backend that has the collectives (gloo,
NCCL); inputs are laid out as `plait.cp.layout` describes.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from plait.cp.blocks import (
    SKIP,
    Documents,
    Features,
    Mode,
    add_sinks,
    backward_pair,
    forward_pair,
    merge,
    pair_mode,
    sinks_grad,
    split_chunks,
)
from plait.cp.gather import gather_ranks
from plait.cp.layout import chunk_ids

Pairs = list[tuple[int, int, Mode, Documents]]
"""(local query chunk 0/1, key chunk 0/1 of the source rank, mode, their documents), none skipped."""


def _pairs(
    rank: int, source: int, cp_size: int, chunk_len: int, features: Features, documents: torch.Tensor | None
) -> Pairs:
    out = []
    for qi, q_chunk in enumerate(chunk_ids(rank, cp_size)):
        for ki, kv_chunk in enumerate(chunk_ids(source, cp_size)):
            mode = pair_mode(q_chunk, kv_chunk, chunk_len, features)
            if mode != SKIP:
                docs = (
                    None
                    if documents is None
                    else (_chunk(documents, q_chunk, chunk_len), _chunk(documents, kv_chunk, chunk_len))
                )
                out.append((qi, ki, mode, docs))
    return out


def _chunk(documents: torch.Tensor, chunk: int, chunk_len: int) -> torch.Tensor:
    return documents[:, chunk * chunk_len : (chunk + 1) * chunk_len]


def _accumulate_forward(
    acc: list[Any],
    q: list[torch.Tensor],
    k: torch.Tensor,
    v: torch.Tensor,
    pairs: Pairs,
    scale: float,
    features: Features,
) -> None:
    ks, vs = split_chunks(k, 2), split_chunks(v, 2)
    for qi, ki, mode, docs in pairs:
        acc[qi] = merge(*acc[qi], *forward_pair(q[qi], ks[ki], vs[ki], scale, mode, features, docs))


def _accumulate_backward(
    saved: tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]],
    k: torch.Tensor,
    v: torch.Tensor,
    dq: list[torch.Tensor],
    dk: torch.Tensor,
    dv: torch.Tensor,
    pairs: Pairs,
    scale: float,
    features: Features,
) -> None:
    q, grad_out, lse, delta = saved
    ks, vs, dks, dvs = split_chunks(k, 2), split_chunks(v, 2), split_chunks(dk, 2), split_chunks(dv, 2)
    for qi, ki, mode, docs in pairs:
        gq, gk, gv = backward_pair(
            q[qi], ks[ki], vs[ki], grad_out[qi], lse[qi], delta[qi], scale, mode, features, docs
        )
        dq[qi] += gq
        dks[ki] += gk
        dvs[ki] += gv


def _finish(
    acc: list[Any], dtype: torch.dtype, sinks: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    out = torch.cat([a[0] for a in acc], dim=-2)
    lse = torch.cat([a[1] for a in acc], dim=-1)
    if sinks is not None:
        out, lse = add_sinks(out, lse, sinks)
    return out.to(dtype), lse


def _sinks_grad(
    sinks: torch.Tensor | None, lse: torch.Tensor, out: torch.Tensor, grad_out: torch.Tensor
) -> torch.Tensor | None:
    if sinks is None:
        return None
    delta = (grad_out.float() * out.float()).sum(dim=-1)
    return sinks_grad(sinks, lse, delta).to(sinks.dtype)


def _saved_chunks(
    q: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, grad_out: torch.Tensor
) -> tuple[list[torch.Tensor], ...]:
    delta = (grad_out.float() * out.float()).sum(dim=-1)
    return (
        split_chunks(q, 2),
        split_chunks(grad_out, 2),
        list(lse.chunk(2, dim=-1)),
        list(delta.chunk(2, dim=-1)),
    )


class _GatheredAttention(torch.autograd.Function):
    """Local queries against the gathered K/V of every rank (``kv_all``: ``[cp, 2, B, Hkv, 1, L, D]``)."""

    @staticmethod
    def forward(
        ctx: Any,
        q: torch.Tensor,
        kv_all: torch.Tensor,
        sinks: torch.Tensor | None,
        rank: int,
        features: Features,
        scale: float,
        documents: torch.Tensor | None,
    ) -> torch.Tensor:
        cp_size, chunk_len = kv_all.shape[0], q.shape[-2] // 2
        qs, acc = split_chunks(q, 2), [(None, None), (None, None)]
        for source in range(cp_size):
            pairs = _pairs(rank, source, cp_size, chunk_len, features, documents)
            _accumulate_forward(acc, qs, kv_all[source, 0], kv_all[source, 1], pairs, scale, features)
        out, lse = _finish(acc, q.dtype, sinks)
        ctx.save_for_backward(q, kv_all, out, lse, sinks)
        ctx.rank, ctx.features, ctx.scale, ctx.documents = rank, features, scale, documents
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, kv_all, out, lse, sinks = ctx.saved_tensors
        saved = _saved_chunks(q, out, lse, grad_out)
        cp_size, chunk_len = kv_all.shape[0], q.shape[-2] // 2
        dq = [torch.zeros_like(c, dtype=torch.float32) for c in saved[0]]
        dkv = torch.zeros_like(kv_all, dtype=torch.float32)
        for source in range(cp_size):
            pairs = _pairs(ctx.rank, source, cp_size, chunk_len, ctx.features, ctx.documents)
            k, v = kv_all[source, 0], kv_all[source, 1]
            _accumulate_backward(
                saved, k, v, dq, dkv[source, 0], dkv[source, 1], pairs, ctx.scale, ctx.features
            )
        d_sinks = _sinks_grad(sinks, lse, out, grad_out)
        return torch.cat(dq, dim=-2).to(q.dtype), dkv.to(kv_all.dtype), d_sinks, None, None, None, None


class _Shift:
    """Send tensors to the next rank of the ring and receive the previous rank's (asynchronous)."""

    def __init__(self, tensors: tuple[torch.Tensor, ...], group: dist.ProcessGroup, tag: int) -> None:
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        nxt = dist.get_global_rank(group, (rank + 1) % size)
        prev = dist.get_global_rank(group, (rank - 1) % size)
        self.sent = tuple(t.contiguous() for t in tensors)  # alive until the sends complete
        self.received = tuple(torch.empty_like(t) for t in self.sent)
        ops = [dist.P2POp(dist.isend, t, nxt, group, tag) for t in self.sent]
        ops += [dist.P2POp(dist.irecv, t, prev, group, tag) for t in self.received]
        self.works = dist.batch_isend_irecv(ops)

    def wait(self) -> tuple[torch.Tensor, ...]:
        for work in self.works:
            work.wait()
        return self.received


class _RingAttention(torch.autograd.Function):
    """Local queries against K/V passed round the ring; the next hop overlaps the current chunk's math."""

    @staticmethod
    def forward(
        ctx: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        sinks: torch.Tensor | None,
        group: dist.ProcessGroup,
        features: Features,
        scale: float,
        documents: torch.Tensor | None,
    ) -> torch.Tensor:
        cp_size, rank, chunk_len = dist.get_world_size(group), dist.get_rank(group), q.shape[-2] // 2
        qs, acc, kv = split_chunks(q, 2), [(None, None), (None, None)], (k, v)
        for step in range(cp_size):
            hop = _Shift(kv, group, tag=0) if step < cp_size - 1 else None
            pairs = _pairs(rank, (rank - step) % cp_size, cp_size, chunk_len, features, documents)
            _accumulate_forward(acc, qs, kv[0], kv[1], pairs, scale, features)
            if hop is not None:
                kv = hop.wait()
        out, lse = _finish(acc, q.dtype, sinks)
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        ctx.group, ctx.features, ctx.scale, ctx.documents = group, features, scale, documents
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        group = ctx.group
        cp_size, rank = dist.get_world_size(group), dist.get_rank(group)
        q, k, v, out, lse, sinks = ctx.saved_tensors
        chunk_len = q.shape[-2] // 2
        saved, kv = _saved_chunks(q, out, lse, grad_out), (k, v)
        dq = [torch.zeros_like(c, dtype=torch.float32) for c in saved[0]]
        dkv = (torch.zeros_like(k, dtype=torch.float32), torch.zeros_like(v, dtype=torch.float32))
        for step in range(cp_size):
            hop = _Shift(kv, group, tag=0) if step < cp_size - 1 else None
            pairs = _pairs(rank, (rank - step) % cp_size, cp_size, chunk_len, ctx.features, ctx.documents)
            _accumulate_backward(saved, kv[0], kv[1], dq, dkv[0], dkv[1], pairs, ctx.scale, ctx.features)
            # The accumulators follow their K/V; after the last hop each is back at its owner.
            dkv = _Shift(dkv, group, tag=1).wait()
            if hop is not None:
                kv = hop.wait()
        d_sinks = _sinks_grad(sinks, lse, out, grad_out)
        dq_out = torch.cat(dq, dim=-2).to(q.dtype)
        return dq_out, dkv[0].to(k.dtype), dkv[1].to(v.dtype), d_sinks, None, None, None, None


def all_gather_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group: dist.ProcessGroup,
    features: Features,
    scale: float,
    sinks: torch.Tensor | None = None,
    documents: torch.Tensor | None = None,
) -> torch.Tensor:
    """Context-parallel attention by all-gathering K/V.

    ``q``: ``[B, Hkv, G, L, D]``, ``k``/``v``: ``[B, Hkv, 1, L, D]``, ``sinks``: ``[Hkv, G]`` or None,
    ``documents``: the whole sequence's document ids ``[B, L * cp]`` or None (one document).
    """
    kv_all = gather_ranks(torch.stack([k, v]), group)  # [cp, 2, ...]; backward reduce-scatters
    return _GatheredAttention.apply(q, kv_all, sinks, dist.get_rank(group), features, scale, documents)


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group: dist.ProcessGroup,
    features: Features,
    scale: float,
    sinks: torch.Tensor | None = None,
    documents: torch.Tensor | None = None,
) -> torch.Tensor:
    """Context-parallel attention by passing K/V round the ring (arguments as `all_gather_attention`)."""
    return _RingAttention.apply(q, k, v, sinks, group, features, scale, documents)
