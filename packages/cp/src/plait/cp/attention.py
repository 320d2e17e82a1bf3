"""`ContextParallelAttention`: a drop-in for ``F.scaled_dot_product_attention`` over a cp-sharded sequence."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from plait.cp.all_to_all import all_to_all_attention
from plait.cp.blocks import Features
from plait.cp.variants import all_gather_attention, ring_attention

__all__ = ["ContextParallelAttention"]

_Variant = Callable[..., torch.Tensor]
_VARIANTS: dict[str, _Variant] = {
    "all_gather": all_gather_attention,
    "ring": ring_attention,
    "all_to_all": all_to_all_attention,
}
"""Each `FSDP2Config.cp_attention` value and its function (grouped ``[B, Hkv, G, L, D]`` queries)."""


class ContextParallelAttention:
    """SDPA semantics for queries/keys/values that hold this cp rank's part of the sequence.

    Call it like ``F.scaled_dot_product_attention(q, k, v, is_causal=..., scale=..., enable_gqa=...)``
    with ``[batch, heads, local_seq, head_dim]`` tensors laid out by `plait.cp.shard_sequence` (a head
    and a tail chunk per rank); the result is this rank's part of the attention over the whole
    sequence. Masks come from the chunks' global positions. Values may have another head_dim than
    queries and keys (latent attention): they are zero-padded to one width. An explicit ``attn_mask``
    or dropout is refused: neither is implemented across ranks.

    Args:
        mesh: the 1-D ``cp`` mesh.
        variant: ``"all_gather"``, ``"ring"`` (see `plait.cp.variants`) or ``"all_to_all"`` (see
            `plait.cp.all_to_all`).
    """

    def __init__(self, mesh: DeviceMesh, variant: str = "all_gather") -> None:
        if mesh.ndim != 1:
            raise ValueError(
                f"ContextParallelAttention needs the 1-D cp mesh, got dims {mesh.mesh_dim_names}"
            )
        if variant not in _VARIANTS:
            raise ValueError(f"cp attention variant must be one of {list(_VARIANTS)}, got {variant!r}")
        self.mesh = mesh
        self.variant = variant

    def __repr__(self) -> str:
        return f"ContextParallelAttention(cp={self.mesh.size()}, variant={self.variant!r})"

    @torch.compiler.disable  # point-to-point and gather collectives inside autograd functions
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
    ) -> torch.Tensor:
        if attn_mask is not None:
            raise ValueError(
                "context-parallel attention cannot honour an explicit attn_mask (it spans ranks); "
                "use is_causal, or run this model with cp_size 1"
            )
        if dropout_p:
            raise ValueError(
                f"context-parallel attention does not implement dropout, got dropout_p={dropout_p}"
            )
        scale = query.shape[-1] ** -0.5 if scale is None else float(scale)
        value_dim = value.shape[-1]
        query, key, value = _same_head_dim(query, key, value)
        q, k, v = _grouped(query, key, value, enable_gqa)
        if not math.isfinite(scale):
            raise ValueError(f"attention scale must be finite, got {scale}")
        features = Features(bool(is_causal), window, softcap)
        grouped_sinks = _grouped_sinks(sinks, q.shape[1], q.shape[2])
        _check_documents(documents, query.shape[0], query.shape[2] * self.mesh.size())
        variant = _VARIANTS[self.variant]
        out = variant(q, k, v, self.mesh.get_group(), features, scale, grouped_sinks, documents)
        return out.flatten(1, 2)[..., :value_dim]


def _check_documents(documents: torch.Tensor | None, batch: int, seq: int) -> None:
    if documents is not None and (
        documents.shape != (batch, seq) or documents.dtype.is_floating_point or documents.is_complex()
    ):
        raise ValueError(
            f"document_ids must be integer ids of the whole sequence, [batch, seq] = [{batch}, {seq}], got "
            f"{documents.dtype} {tuple(documents.shape)}; take them from plait.cp.shard_sequence"
        )


def _grouped_sinks(sinks: torch.Tensor | None, kv_heads: int, per_kv: int) -> torch.Tensor | None:
    """``[Hkv, G]`` sinks from one logit per (local) query head."""
    if sinks is None:
        return None
    if isinstance(sinks, DTensor):
        sinks = sinks.to_local()  # TP shards the heads: this rank's
    if sinks.shape != (kv_heads * per_kv,):
        raise ValueError(
            f"attention sinks must hold one logit per query head ({kv_heads * per_kv}), got shape "
            f"{tuple(sinks.shape)}"
        )
    return sinks.view(kv_heads, per_kv)


def _same_head_dim(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Values of another head_dim than the queries/keys (latent attention, MLA) zero-padded to one width.

    Zero columns of q and k leave every score unchanged and zero columns of v give zero output columns
    (sliced off by the caller), so the chunked variants run on one head_dim; the scale is the caller's.
    """
    qk_dim, v_dim = query.shape[-1], value.shape[-1]
    if qk_dim == v_dim or key.shape[-1] != qk_dim or key.shape[:-1] != value.shape[:-1]:
        return query, key, value  # equal, or a shape _grouped refuses
    width = max(qk_dim, v_dim)

    def pad(t: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.pad(t, (0, width - t.shape[-1]))

    return pad(query), pad(key), pad(value)


def _grouped(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, enable_gqa: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``[B, Hkv, G, L, D]`` queries and ``[B, Hkv, 1, L, D]`` keys/values, validated."""
    if query.ndim != 4 or key.ndim != 4 or value.ndim != 4:
        raise ValueError(
            "context-parallel attention takes [batch, heads, seq, head_dim] tensors, got shapes "
            f"{tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)}"
        )
    heads, kv_heads, seq = query.shape[1], key.shape[1], query.shape[2]
    if key.shape != value.shape or key.shape[2] != seq or key.shape[-1] != query.shape[-1]:
        raise ValueError(
            "context-parallel attention needs keys and values shaped like the queries (self-attention, "
            f"same head_dim), got q {tuple(query.shape)}, k {tuple(key.shape)}, v {tuple(value.shape)}"
        )
    if heads != kv_heads and (not enable_gqa or heads % kv_heads):
        raise ValueError(
            f"{heads} query heads and {kv_heads} key/value heads need enable_gqa=True and heads % kv_heads == 0"
        )
    if seq % 2:
        raise ValueError(
            f"the local sequence ({seq}) must hold two equal chunks; shard it with plait.cp.shard_sequence"
        )
    return query.unflatten(1, (kv_heads, heads // kv_heads)), key.unsqueeze(2), value.unsqueeze(2)
