"""``cp_attention: auto``: which variant a model's attention gets, and why (the rule is in docs/cp.md).

Per KV head and local token, ``all_gather`` sends ``(cp-1) * 2`` (its K and V to every other rank),
``all_to_all`` sends ``(cp-1)/cp * (2G + 2r)`` (Q and O of its ``G`` query heads, K and V repeated
``r`` times), forward and backward alike. So ``auto`` picks ``all_to_all`` when it can split the
heads (the local query heads divide by cp) and sends less (``G + r < cp``); otherwise
``all_gather``. ``ring`` is never chosen: it trades traffic for memory, a choice the user makes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from torch import nn

from plait.cp.all_to_all import kv_repeats

if TYPE_CHECKING:
    from plait.mesh import MeshContext

__all__ = ["CPAttentionChoice", "choose_cp_attention", "heads_of"]

AUTO = "auto"


@dataclass(frozen=True)
class CPAttentionChoice:
    """The variant the cp step uses and the reason (``plan`` prints both)."""

    variant: str
    reason: str


def heads_of(module: nn.Module) -> tuple[int | None, int | None]:
    """``(query heads, KV heads)`` of an attention module (plait.models or transformers), None when unknown."""
    config = getattr(module, "config", None)
    heads = getattr(module, "num_heads", None) or getattr(config, "num_attention_heads", None)
    kv = getattr(module, "num_key_value_heads", None) or getattr(config, "num_key_value_heads", None)
    heads = heads if isinstance(heads, int) else None
    kv = kv if isinstance(kv, int) else heads
    return heads, kv


def choose_cp_attention(modules: list[nn.Module], mesh_context: MeshContext) -> CPAttentionChoice:
    """The config's ``cp_attention``, or for ``auto`` the variant the rule above picks for ``modules``."""
    configured = mesh_context.strategy_config.cp_attention
    if configured != AUTO:
        return CPAttentionChoice(configured, "set by cp_attention")
    tp, cp = mesh_context.tp_size, mesh_context.cp_size
    counts = {heads_of(m) for m in modules}
    if len(counts) != 1 or None in next(iter(counts)):
        return CPAttentionChoice(
            "all_gather", f"auto: head counts unknown or mixed ({sorted(map(str, counts))})"
        )
    heads, kv = next(iter(counts))
    if heads % tp or kv % tp or (heads // tp) % cp:
        return CPAttentionChoice(
            "all_gather",
            f"auto: {heads} query heads / tp {tp} do not divide by cp {cp} (all_to_all cannot split them)",
        )
    group, repeats = heads // kv, kv_repeats(kv // tp, cp)
    if group + repeats < cp:
        why = f"auto: G {group} + r {repeats} < cp {cp}: all_to_all sends less than all_gather"
        return CPAttentionChoice("all_to_all", why)
    why = f"auto: G {group} + r {repeats} >= cp {cp}: all_gather sends no more than all_to_all"
    return CPAttentionChoice("all_gather", why)
