"""Sliding windows, soft-capping, sinks and packed documents under every cp variant, against eager attention.

The reference is written the way transformers' eager attention computes it, on the whole sequence in
one process: scores, soft-cap, the causal and window mask (key j visible to query i when
``j <= i``, ``i - j < window`` and both in one document), the sink logit appended to each row's softmax and dropped after.
Output and the q, k, v and sink gradients must agree within 1e-5 (relative, fp32).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from plait.cp import ContextParallelAttention, global_positions
from plait.mesh import CP_ATTENTION_VARIANTS
from plait.testing import run_on_ranks

CASES = [
    {"window": 3},  # inside a chunk (chunks of 4 tokens at cp 2)
    {"window": 6},  # reaches into the previous chunk, partly
    {"window": 64},  # wider than the sequence: plain causal
    {"softcap": 1.5},
    {"sinks": True},
    {"window": 5, "softcap": 2.0, "sinks": True},
    {"documents": True},
    {"documents": True, "window": 3, "sinks": True},
]


def _documents(batch: int, seq: int) -> torch.Tensor:
    """Document ids: row 0 cut at 3 and seq/2 + 1 (not at chunk edges), row 1 at seq - 5."""
    ids = torch.zeros(batch, seq, dtype=torch.long)
    ids[0, 3:] += 1
    ids[0, seq // 2 + 1 :] += 1
    ids[1, seq - 5 :] += 1
    return ids


def _reference(q, k, v, sinks, window, softcap, scale, documents=None):
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    s = q @ k.transpose(-1, -2) * scale
    if softcap is not None:
        s = torch.tanh(s / softcap) * softcap
    i = torch.arange(q.shape[2])[:, None]
    j = torch.arange(q.shape[2])[None, :]
    visible = j <= i
    if window is not None:
        visible = visible & (i - j < window)
    if documents is not None:
        visible = visible & (documents[:, None, None, :, None] == documents[:, None, None, None, :]).squeeze(
            2
        )
    s = s.masked_fill(~visible, float("-inf"))
    if sinks is not None:
        s = torch.cat([s, sinks[None, :, None, None].expand(*s.shape[:-1], 1)], dim=-1)
        return torch.softmax(s, dim=-1)[..., :-1] @ v
    return torch.softmax(s, dim=-1) @ v


def _diffs(variant: str, case: dict, heads: int = 4, kv_heads: int = 2) -> float:
    cp, rank = dist.get_world_size(), dist.get_rank()
    attention = ContextParallelAttention(init_device_mesh("cpu", (cp,), mesh_dim_names=("cp",)), variant)
    torch.manual_seed(3)
    batch, seq, dim, scale = 2, 8 * cp, 8, 0.9
    q, k, v = (torch.randn(batch, h, seq, dim, requires_grad=True) for h in (heads, kv_heads, kv_heads))
    sinks = torch.randn(heads, requires_grad=True) if case.get("sinks") else None
    window, softcap = case.get("window"), case.get("softcap")
    documents = _documents(batch, seq) if case.get("documents") else None
    grad = torch.randn(batch, heads, seq, dim)
    ref = _reference(q, k, v, sinks, window, softcap, scale, documents)
    ref.backward(grad)
    idx = global_positions(seq, rank, cp)
    local = [t.detach()[:, :, idx].clone().requires_grad_() for t in (q, k, v)]
    local_sinks = None if sinks is None else sinks.detach().clone().requires_grad_()
    out = attention(
        *local,
        is_causal=True,
        scale=scale,
        enable_gqa=True,
        window=window,
        softcap=softcap,
        sinks=local_sinks,
        documents=documents,
    )
    out.backward(grad[:, :, idx])
    pairs = [(out, ref[:, :, idx])] + [
        (t.grad, f.grad[:, :, idx]) for t, f in zip(local, (q, k, v), strict=True)
    ]
    if sinks is not None:  # each rank holds its queries' share of the sinks' gradient
        total = local_sinks.grad.clone()
        dist.all_reduce(total)
        pairs.append((total, sinks.grad))
    return max(
        float((a - b).abs().max() / b.abs().max()) for a, b in ((x.detach(), y.detach()) for x, y in pairs)
    )


def _every_case() -> dict[str, list[float]]:
    return {variant: [_diffs(variant, case) for case in CASES] for variant in CP_ATTENTION_VARIANTS}


def test_every_feature_matches_eager_attention_at_cp2() -> None:
    for result in run_on_ranks(_every_case, 2):
        for variant, diffs in result.items():
            assert max(diffs) <= 1e-5, (variant, list(zip(CASES, diffs, strict=True)))


def _combined_cp4() -> dict[str, float]:
    case = {"window": 5, "softcap": 2.0, "sinks": True, "documents": True}
    return {variant: _diffs(variant, case, heads=4, kv_heads=1) for variant in CP_ATTENTION_VARIANTS}


def test_window_softcap_and_sinks_at_cp4() -> None:
    """cp 4: windows and documents cross rank boundaries; MQA (one KV head, repeated under all_to_all)."""
    for result in run_on_ranks(_combined_cp4, 4):
        assert max(result.values()) <= 1e-5, result


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"window": 4, "is_causal": False}, "a sliding window needs causal attention"),
        ({"window": 0, "is_causal": True}, "window >= 1"),
        ({"softcap": -1.0, "is_causal": True}, "softcap must be a finite number > 0"),
        ({"sinks": torch.zeros(3), "is_causal": True}, "one logit per query head"),
        (
            {"documents": torch.zeros(1, 8, dtype=torch.long), "is_causal": True},
            r"\[batch, seq\] = \[1, 16\]",
        ),
    ],
)
def test_bad_features_are_refused(fake_pg, kwargs: dict, match: str) -> None:
    with fake_pg(2):
        attention = ContextParallelAttention(init_device_mesh("cpu", (2,), mesh_dim_names=("cp",)))
        q = torch.zeros(1, 4, 8, 8)
        with pytest.raises(ValueError, match=match):
            attention(q, q, q, enable_gqa=True, **kwargs)
