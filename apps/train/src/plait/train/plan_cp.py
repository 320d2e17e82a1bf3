"""The context-parallel part of ``plait-train plan``: cp bytes per layer and the cp lines (docs/cp.md)."""

from __future__ import annotations

from torch import nn

from plait.cp import cp_attention_choice, cp_gathered_modules, kv_repeats
from plait.mesh import MeshContext
from plait.train.config import Recipe
from plait.train.summary import format_bytes

__all__ = ["cp_bytes", "cp_text", "model_dims"]


def model_dims(model: nn.Module) -> tuple[int, int, int]:
    """``(hidden size, layers, experts per token)`` from the model's (text) config; 0 where unknown."""
    config = getattr(model, "config", None)
    text = getattr(config, "text_config", None) or config
    return (
        int(getattr(text, "hidden_size", 0)),
        int(getattr(text, "num_hidden_layers", 0)),
        int(getattr(text, "num_experts_per_tok", 0)),
    )


def _cp_kv_bytes(model: nn.Module, ctx: MeshContext, recipe: Recipe) -> tuple[int, int]:
    """``(bytes of this rank's K+V per layer, bytes per activation element)``."""
    config = getattr(model, "config", None)
    text = getattr(config, "text_config", None) or config
    heads = int(getattr(text, "num_attention_heads", 1))
    head_dim = int(getattr(text, "head_dim", None) or getattr(text, "hidden_size", 0) // heads)
    kv_heads = int(getattr(text, "num_key_value_heads", None) or heads) // ctx.tp_size
    act_bytes = 2 if recipe.parallel.mixed_precision == "bf16" else 4
    tokens = recipe.data.micro_batch_size * recipe.data.seq_len // ctx.cp_size
    return 2 * tokens * kv_heads * head_dim * act_bytes, act_bytes


def cp_bytes(model: nn.Module, ctx: MeshContext, recipe: Recipe) -> float:
    """Bytes one rank sends per layer and micro-batch for cp attention (see docs/cp.md)."""
    kv, act_bytes = _cp_kv_bytes(model, ctx, recipe)
    cp, forwards = ctx.cp_size, 2 if ctx.activation_checkpointing else 1
    variant = cp_attention_choice(model, ctx).variant
    if variant == "all_to_all":  # Q, O and r repeats of K, V each way: (cp-1)/cp of them, per pass
        group, repeats = _all_to_all_factors(model, ctx)
        return float((forwards + 1) * (cp - 1) / cp * kv * (repeats + group))
    sent = forwards * (cp - 1) * kv + (cp - 1) * kv  # K/V out (forward, recompute) + dK/dV or K/V again
    if variant == "ring":
        sent += cp * kv * 4 // act_bytes  # the fp32 dK/dV accumulators go round the ring too
    return float(sent)


def _all_to_all_factors(model: nn.Module, ctx: MeshContext) -> tuple[int, int]:
    """``(G query heads per KV head, r repeats of each local KV head)`` under ``all_to_all``."""
    config = getattr(model, "config", None)
    text = getattr(config, "text_config", None) or config
    heads = int(getattr(text, "num_attention_heads", 1))
    kv_heads = int(getattr(text, "num_key_value_heads", None) or heads)
    return heads // kv_heads, kv_repeats(max(kv_heads // ctx.tp_size, 1), ctx.cp_size)


def cp_text(model: nn.Module, ctx: MeshContext, recipe: Recipe) -> str:
    """The plan's context-parallel lines: the split, the variant and why, memory per layer, gathered mixers."""
    cp, seq = ctx.cp_size, recipe.data.seq_len
    chunk = seq // (2 * cp)
    kv, act_bytes = _cp_kv_bytes(model, ctx, recipe)
    choice = cp_attention_choice(model, ctx)
    variant = choice.variant
    kept = {"all_gather": kv * cp, "ring": kv, "all_to_all": kv * _all_to_all_factors(model, ctx)[1]}[variant]
    where = {
        "all_gather": " (gathered from all cp ranks)",
        "ring": " (local; re-sent in backward)",
        "all_to_all": " (every token of 1/cp of the heads)",
    }[variant]
    hidden = recipe.data.micro_batch_size * (seq // cp) * model_dims(model)[0] * act_bytes
    gathered = cp_gathered_modules(model, ctx)
    whole = (
        [
            f"  run on the whole sequence on every cp rank (cp_sequence_mixers=gather, nothing saved in them): "
            f"{len(gathered)} modules, {', '.join(gathered[:3])}{', ...' if len(gathered) > 3 else ''}"
        ]
        if gathered
        else []
    )
    return "\n".join(
        [
            f"context parallel: cp={cp}, cp_attention={variant} ({choice.reason}): each sequence of {seq} "
            f"tokens in {2 * cp} chunks of {chunk}; cp rank r holds chunks r and {2 * cp - 1}-r = {seq // cp} "
            "tokens per rank",
            f"  per rank and layer (micro-batch {recipe.data.micro_batch_size}): hidden state "
            f"{format_bytes(hidden)}, K/V kept for backward {format_bytes(kept)}{where}",
            *whole,
        ]
    )
