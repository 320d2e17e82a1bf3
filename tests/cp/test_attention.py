"""`ContextParallelAttention` against ``F.scaled_dot_product_attention`` on the whole sequence (2 gloo ranks)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

from plait.cp import ContextParallelAttention, global_positions
from plait.mesh import CP_ATTENTION_VARIANTS
from plait.testing import run_on_ranks

CASES = [(True, 4, 2), (False, 4, 4), (True, 6, 1), (False, 2, 1)]
"""(is_causal, query heads, key/value heads)."""


def _attention_diffs(variant: str, cases: list[tuple[bool, int, int]] = CASES, v_dim: int = 8) -> list[float]:
    cp, rank = dist.get_world_size(), dist.get_rank()
    attention = ContextParallelAttention(init_device_mesh("cpu", (cp,), mesh_dim_names=("cp",)), variant)
    diffs = []
    for causal, heads, kv_heads in cases:
        torch.manual_seed(1)
        batch, seq, dim = 2, 8 * cp, 8
        q = torch.randn(batch, heads, seq, dim, requires_grad=True)
        k = torch.randn(batch, kv_heads, seq, dim, requires_grad=True)
        v = torch.randn(batch, kv_heads, seq, v_dim, requires_grad=True)
        grad = torch.randn(batch, heads, seq, v_dim)
        ref = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=0.3, enable_gqa=True)
        ref.backward(grad)
        idx = global_positions(seq, rank, cp)
        local = [t.detach()[:, :, idx].clone().requires_grad_() for t in (q, k, v)]
        out = attention(*local, is_causal=causal, scale=0.3, enable_gqa=True)
        out.backward(grad[:, :, idx])
        pairs = [(out, ref)] + [(t.grad, full.grad) for t, full in zip(local, (q, k, v), strict=True)]
        diffs.append(max(float((a.detach() - b[:, :, idx]).abs().max() / b.abs().max()) for a, b in pairs))
    return diffs


def _every_variant() -> dict[str, list[float]]:
    return {variant: _attention_diffs(variant) for variant in CP_ATTENTION_VARIANTS}


def test_matches_sdpa_on_the_whole_sequence() -> None:
    """Output and q/k/v gradients within 1e-5 (relative) for causal/non-causal, MHA/GQA/MQA, every variant.

    Under ``all_to_all`` the single KV head of the MQA cases is repeated to one per cp rank.
    """
    for rank_result in run_on_ranks(_every_variant, 2):
        assert sorted(rank_result) == sorted(CP_ATTENTION_VARIANTS)
        for variant, diffs in rank_result.items():
            assert max(diffs) <= 1e-5, (variant, diffs)


def _other_value_dims() -> dict[str, list[float]]:
    return {
        f"{variant} v_dim {v_dim}": _attention_diffs(variant, [(True, 4, 4), (False, 4, 2)], v_dim)
        for variant in CP_ATTENTION_VARIANTS
        for v_dim in (4, 12)
    }


def test_values_of_another_head_dim() -> None:
    """Latent attention (MLA): values narrower or wider than q/k (8) give SDPA's output and gradients."""
    for rank_result in run_on_ranks(_other_value_dims, 2):
        assert len(rank_result) == 2 * len(CP_ATTENTION_VARIANTS)
        for case, diffs in rank_result.items():
            assert max(diffs) <= 1e-5, (case, diffs)


def _all_to_all_cp4() -> list[float]:
    return _attention_diffs("all_to_all", cases=[(True, 4, 2), (True, 8, 8), (False, 4, 1)])


def test_all_to_all_on_four_ranks() -> None:
    """cp=4: the gathered chunks come back in sequence order (0, 7, 1, 6, ... -> 0..7); 2 and 1 KV heads repeated."""
    for diffs in run_on_ranks(_all_to_all_cp4, 4):
        assert max(diffs) <= 1e-5, diffs


def test_refuses_what_it_cannot_honour() -> None:
    class _Mesh:
        ndim, mesh_dim_names = 1, ("cp",)

    attention = ContextParallelAttention(_Mesh(), "ring")  # type: ignore[arg-type]
    q = torch.zeros(1, 4, 8, 8)
    with pytest.raises(ValueError, match="explicit attn_mask"):
        attention(q, q, q, torch.ones(8, 8, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"dropout_p=0\.1"):
        attention(q, q, q, dropout_p=0.1)
    with pytest.raises(ValueError, match="need enable_gqa=True"):
        attention(q, q[:, :2], q[:, :2])
    with pytest.raises(ValueError, match="must be one of"):
        ContextParallelAttention(_Mesh(), "ulysses")  # type: ignore[arg-type]
