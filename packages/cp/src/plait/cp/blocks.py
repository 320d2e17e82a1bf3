"""Attention of query chunks against key/value chunks, merged by log-sum-exp, with a recomputing backward.

Shapes follow grouped-query attention without repeating K/V: queries ``[B, Hkv, G, Lq, D]``, keys and
values ``[B, Hkv, 1, Lk, D]`` (``G`` query heads per K/V head), so the broadcasting matmul serves every
group and K/V gradients are summed over groups by construction. Chunk indices are global, so which
keys a query sees follows the tokens' global positions whatever rank holds them: `Features` says
how (causal, a sliding window, logit soft-capping), and each (query chunk, key chunk) pair is
``FULL`` (every key visible), skipped (none visible) or masked by the global offset between the two
chunks. Only inputs, the output and the log-sum-exp are kept for backward, which recomputes the
scores chunk by chunk (as flash attention does): memory stays linear in the sequence length.
Learned sinks (one logit per head that takes softmax mass and gives no value) join the final
log-sum-exp once all chunks are merged (`add_sinks`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

FULL, SKIP = "full", "skip"

Mode = str | int
"""``FULL``, ``SKIP`` or the masked pair's offset: query chunk start minus key chunk start (tokens)."""


@dataclass(frozen=True)
class Features:
    """Which keys a query sees and how its scores are shaped (all in global token positions).

    Args:
        causal: key ``j`` visible to query ``i`` only when ``j <= i``.
        window: a sliding window (needs ``causal``): also ``i - j < window`` (transformers' rule).
        softcap: scores become ``softcap * tanh(scores / softcap)`` before the mask.
    """

    causal: bool
    window: int | None = None
    softcap: float | None = None

    def __post_init__(self) -> None:
        if self.window is not None and (not self.causal or self.window < 1):
            raise ValueError(
                f"a sliding window needs causal attention and window >= 1, got window={self.window}, "
                f"causal={self.causal}"
            )
        if self.softcap is not None and not (math.isfinite(self.softcap) and self.softcap > 0):
            raise ValueError(f"softcap must be a finite number > 0, got {self.softcap}")


def pair_mode(q_chunk: int, kv_chunk: int, chunk_len: int, features: Features) -> Mode:
    """How query chunk ``q_chunk`` sees key chunk ``kv_chunk`` (global chunk indices)."""
    offset = (q_chunk - kv_chunk) * chunk_len  # query position minus key position, at a = b = 0
    low, high = offset - (chunk_len - 1), offset + (chunk_len - 1)
    if features.causal and high < 0:
        return SKIP
    if features.window is not None and low >= features.window:
        return SKIP
    if (not features.causal or low >= 0) and (features.window is None or high < features.window):
        return FULL
    return offset


Documents = tuple[torch.Tensor, torch.Tensor] | None
"""The document ids (``[B, Lq]``, ``[B, Lk]``) of a pair's queries and keys, or None (one document)."""


def masked_scores(
    q: torch.Tensor, k: torch.Tensor, scale: float, mode: Mode, features: Features, docs: Documents = None
) -> torch.Tensor:
    """Scaled (and soft-capped) scores with hidden keys at ``-inf`` (another document's keys too)."""
    s = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if features.softcap is not None:
        s = torch.tanh(s / features.softcap) * features.softcap
    if docs is not None:
        other = docs[0][:, :, None] != docs[1][:, None, :]  # [B, Lq, Lk]
        s = s.masked_fill(other.view(other.shape[0], *([1] * (s.ndim - 3)), *other.shape[1:]), float("-inf"))
    if mode != FULL:
        rows = torch.arange(s.shape[-2], device=s.device)[:, None]
        cols = torch.arange(s.shape[-1], device=s.device)[None, :]
        delta = rows - cols + int(mode)
        hidden = delta < 0 if features.causal else torch.zeros_like(delta, dtype=torch.bool)
        if features.window is not None:
            hidden = hidden | (delta >= features.window)
        s = s.masked_fill(hidden, float("-inf"))
    return s


def forward_pair(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    mode: Mode,
    features: Features,
    docs: Documents = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Partial attention of ``q`` over one key chunk: ``(out float32, lse float32 [..., Lq])``.

    A query that sees no key of the chunk gets ``lse = -inf`` and a zero output.
    """
    s = masked_scores(q, k, scale, mode, features, docs)
    lse = torch.logsumexp(s, dim=-1)
    safe = torch.where(torch.isfinite(lse), lse, 0.0)
    out = torch.matmul(torch.exp(s - safe.unsqueeze(-1)), v.float())
    return out, lse


def _weights(lse: torch.Tensor, new_lse: torch.Tensor) -> torch.Tensor:
    return torch.where(torch.isfinite(lse), torch.exp(lse - new_lse), 0.0).unsqueeze(-1)


def merge(
    out: torch.Tensor | None, lse: torch.Tensor | None, part_out: torch.Tensor, part_lse: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine two softmax-normalised partial results over disjoint key sets (online softmax)."""
    if out is None or lse is None:
        return part_out, part_lse
    new_lse = torch.logaddexp(lse, part_lse)
    return out * _weights(lse, new_lse) + part_out * _weights(part_lse, new_lse), new_lse


def add_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The merged result once each head's sink logit (``[Hkv, G]``) takes its share of the softmax."""
    total = torch.logaddexp(lse, sinks.float()[None, :, :, None].expand_as(lse))
    return out * _weights(lse, total), total


def sinks_grad(sinks: torch.Tensor, lse: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """``d loss / d sinks`` of this rank's queries: ``-sum(p_sink * delta)`` over batch and tokens."""
    p_sink = torch.exp(sinks.float()[None, :, :, None] - lse)
    return -(p_sink * delta).sum(dim=(0, 3))


def backward_pair(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    grad_out: torch.Tensor,
    lse: torch.Tensor,
    delta: torch.Tensor,
    scale: float,
    mode: Mode,
    features: Features,
    docs: Documents = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients ``(dq, dk, dv)`` (float32) of one pair, given the final output's lse and
    ``delta = rowsum(grad_out * out)``; dk and dv are summed over the query groups."""
    s = masked_scores(q, k, scale, mode, features, docs)
    p = torch.exp(s - lse.unsqueeze(-1))
    g = grad_out.float()
    dv = torch.matmul(p.transpose(-1, -2), g).sum(dim=2, keepdim=True)
    ds = p * (torch.matmul(g, v.float().transpose(-1, -2)) - delta.unsqueeze(-1))
    if features.softcap is not None:  # d(c * tanh(x / c)) / dx = 1 - tanh^2; hidden keys have p = 0
        ds = ds * (1 - torch.nan_to_num(s / features.softcap, neginf=0.0).square())
    dq = torch.matmul(ds, k.float()) * scale
    dk = torch.matmul(ds.transpose(-1, -2), q.float()).sum(dim=2, keepdim=True) * scale
    return dq, dk, dv


def split_chunks(x: torch.Tensor, n: int) -> list[torch.Tensor]:
    """``n`` equal chunks of ``x`` along the sequence dim (-2)."""
    return list(x.chunk(n, dim=-2))
