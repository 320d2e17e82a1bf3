"""Attention of query chunks against key/value chunks, merged by log-sum-exp, with a recomputing backward.

Shapes follow grouped-query attention without repeating K/V: queries ``[B, Hkv, G, Lq, D]``, keys and
values ``[B, Hkv, 1, Lk, D]`` (``G`` query heads per K/V head), so the broadcasting matmul serves every
group and K/V gradients are summed over groups by construction. Each (query chunk, key chunk) pair is
``full`` (every key visible), ``diagonal`` (the same chunk under a causal mask: key j visible to query
i when j <= i) or skipped (a later chunk under a causal mask); chunk indices are global, so the mask
follows the tokens' global positions whatever rank holds them. Only inputs, the output and the
log-sum-exp are kept for backward, which recomputes the scores chunk by chunk (as flash attention
does): memory stays linear in the sequence length.
"""

from __future__ import annotations

import torch

FULL, DIAGONAL, SKIP = "full", "diagonal", "skip"


def pair_mode(q_chunk: int, kv_chunk: int, causal: bool) -> str:
    """How query chunk ``q_chunk`` sees key chunk ``kv_chunk`` (global chunk indices)."""
    if not causal or kv_chunk < q_chunk:
        return FULL
    return DIAGONAL if kv_chunk == q_chunk else SKIP


def _scores(q: torch.Tensor, k: torch.Tensor, scale: float, mode: str) -> torch.Tensor:
    s = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if mode == DIAGONAL:
        n = s.shape[-1]
        above = torch.ones(n, n, dtype=torch.bool, device=s.device).triu(1)
        s = s.masked_fill(above, float("-inf"))
    return s


def forward_pair(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, mode: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """Partial attention of ``q`` over one key chunk: ``(out float32, lse float32 [..., Lq])``."""
    s = _scores(q, k, scale, mode)
    lse = torch.logsumexp(s, dim=-1)
    out = torch.matmul(torch.exp(s - lse.unsqueeze(-1)), v.float())
    return out, lse


def merge(
    out: torch.Tensor | None, lse: torch.Tensor | None, part_out: torch.Tensor, part_lse: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine two softmax-normalised partial results over disjoint key sets (online softmax)."""
    if out is None or lse is None:
        return part_out, part_lse
    new_lse = torch.logaddexp(lse, part_lse)
    new_out = out * torch.exp(lse - new_lse).unsqueeze(-1) + part_out * torch.exp(
        part_lse - new_lse
    ).unsqueeze(-1)
    return new_out, new_lse


def backward_pair(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    grad_out: torch.Tensor,
    lse: torch.Tensor,
    delta: torch.Tensor,
    scale: float,
    mode: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients ``(dq, dk, dv)`` (float32) of one pair, given the final output's lse and
    ``delta = rowsum(grad_out * out)``; dk and dv are summed over the query groups."""
    p = torch.exp(_scores(q, k, scale, mode) - lse.unsqueeze(-1))
    g = grad_out.float()
    dv = torch.matmul(p.transpose(-1, -2), g).sum(dim=2, keepdim=True)
    ds = p * (torch.matmul(g, v.float().transpose(-1, -2)) - delta.unsqueeze(-1))
    dq = torch.matmul(ds, k.float()) * scale
    dk = torch.matmul(ds.transpose(-1, -2), q.float()).sum(dim=2, keepdim=True) * scale
    return dq, dk, dv


def split_chunks(x: torch.Tensor, n: int) -> list[torch.Tensor]:
    """``n`` equal chunks of ``x`` along the sequence dim (-2)."""
    return list(x.chunk(n, dim=-2))
