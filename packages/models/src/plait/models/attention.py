"""The attention call every reference model makes, swappable per attention module.

Each attention module holds ``self.attention_fn``; the default, :func:`sdpa_attention`, has the
semantics of ``torch.nn.functional.scaled_dot_product_attention``. A context-parallel or other
kernel replaces it on an instance (``module.attention_fn = ring_attention``) without subclassing.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F

__all__ = ["AttentionFn", "sdpa_attention"]


class AttentionFn(Protocol):
    """``(q, k, v, *, is_causal, scale, enable_gqa) -> out``.

    ``q`` is ``(batch, heads, seq_q, head_dim)``, ``k``/``v`` are ``(batch, kv_heads, seq_k, head_dim)``
    with ``heads`` a multiple of ``kv_heads`` when ``enable_gqa``; ``out`` has ``q``'s shape.
    ``scale=None`` means ``1/sqrt(head_dim)``.
    """

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        is_causal: bool,
        scale: float | None,
        enable_gqa: bool,
    ) -> torch.Tensor: ...


def sdpa_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    is_causal: bool,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """Scaled dot-product attention; grouped-query heads are expanded with ``repeat_interleave``.

    The expansion (rather than SDPA's own ``enable_gqa``) keeps every backend, DTensor included,
    on the same math path.
    """
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        if not enable_gqa:
            raise ValueError(
                f"q has {q.shape[1]} heads and k {k.shape[1]}: pass enable_gqa=True for grouped-query attention"
            )
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    return F.scaled_dot_product_attention(q, k, v, is_causal=is_causal, scale=scale)
