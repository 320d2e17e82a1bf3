"""Bytes a decoder layer keeps for backward per local token, by AC mode and technique (docs/planner.md).

The counts follow the tensors autograd saves in a Llama-style block as plait's reference decoder and
Hugging Face's Llama implement it: RMSNorm in fp32 (its fp32 input, the normalised value, the scaled
output the projections save), rotary embeddings (q and k before and after, and the rotated half),
fused attention (its inputs, output and fp32 log-sum-exp; rotary multiplies by constant tables,
so it saves only the tables), and SwiGLU (gate, its SiLU, up and their product). Under tensor parallel the head and MLP terms
divide by tp; under sequence parallel the norm terms do too, but each projection's gathered input
is whole.
"""

from __future__ import annotations

from plait.planner.layout import Layout
from plait.planner.shape import ModelShape

__all__ = ["layer_saved_bytes", "layer_work_bytes", "model_saved_bytes", "region_work_bytes"]

_F32 = 4


def _act(layout: Layout) -> int:
    return 2 if layout.bf16 else 4


def _norm_block(shape: ModelShape, layout: Layout) -> float:
    """One RMSNorm and the projections' saved input (the gathered sequence under SP)."""
    e, h = _act(layout), shape.hidden_size
    split = layout.tp if layout.sp else 1
    return (_F32 * h + e * h + _F32) / split + e * h


def _attention(shape: ModelShape, layout: Layout) -> float:
    """Projections, rotary, fused attention and the output copy (local heads), K/V per cp variant."""
    e, t, cp = _act(layout), shape.head_split(layout.tp), layout.cp
    q, kv, v = shape.q_width / t, shape.kv_width / t, shape.v_width / t
    if layout.gqa_expanded:
        kv = v = q
    saved = e * (2 * q + kv + v) + _F32 * shape.num_heads / t
    if shape.kv_lora_rank:  # MLA: the low-rank projections and their norms, the expanded K/V, the q/k concat
        low = shape.q_lora_rank + shape.kv_lora_rank
        saved += (3 * e + _F32) * low + e * shape.rope_head_dim
        saved += e * (shape.num_heads * (shape.head_dim - shape.rope_head_dim) + shape.v_width) / t
        saved += 2 * e * q
    if cp > 1 and layout.cp_variant == "all_gather":
        saved += e * (kv + v) * (cp - 1)  # every cp rank's K and V, gathered
    elif cp > 1 and layout.cp_variant == "ring":
        saved += e * q + 2 * _F32 * shape.num_heads / t  # per-chunk outputs and fp32 merge statistics
    elif cp > 1:
        saved += e * (2 * q + kv + v)  # the all-to-all'd Q, K, V and output (1/cp of the heads)
    return saved


def _dense_mlp(shape: ModelShape, layout: Layout) -> float:
    return 4 * _act(layout) * shape.intermediate_size / layout.tp


def _moe_mlp(shape: ModelShape, layout: Layout) -> float:
    """Router, dispatched copies, grouped SwiGLU per routed slot, shared expert; whole under tp.

    Router: fp32 scores, top-k weights and their sum; three int64 indices per slot (top-k, the
    dispatch gather, the combine); per slot the dispatched token, the expert's SwiGLU, its output
    and its weight.
    """
    e, h, k = _act(layout), shape.hidden_size, shape.experts_per_token
    router = _F32 * (shape.num_experts + k + 1)
    # 3 e h: the dispatched token, the expert's output and the weighted output (a copy the combine keeps).
    slots = k * (3 * e * h + 4 * e * shape.moe_intermediate_size + _F32 + 3 * 8)
    if layout.ep > 1:
        slots += k * e * h  # the all-to-all's returned outputs, kept for the combine
    shared = 4 * e * shape.shared_intermediate_size
    return router + slots + shared


def layer_work_bytes(shape: ModelShape, layout: Layout, moe: bool) -> float:
    """Bytes per local token one layer saves with no checkpointing (also what a recompute rebuilds)."""
    mlp = _moe_mlp(shape, layout) if moe else _dense_mlp(shape, layout)
    return 2 * _norm_block(shape, layout) + _attention(shape, layout) + mlp


def _selective(shape: ModelShape, layout: Layout, moe: bool) -> float:
    """Every other matmul's output (q, v, gate, down) and attention's outputs, plus the layer input."""
    e, t = _act(layout), layout.tp
    split = t if layout.sp else 1
    saved = e * shape.hidden_size / split  # the checkpointed layer input
    heads = shape.head_split(layout.tp)
    saved += e * (shape.q_width + shape.v_width) / heads  # q_proj, v_proj outputs
    saved += e * shape.q_width / heads + _F32 * shape.num_heads / heads  # attention output, log-sum-exp
    if moe:
        saved += _moe_mlp(shape, layout) / 2
    else:
        saved += e * shape.intermediate_size / t + e * shape.hidden_size  # gate_proj, down_proj (partial)
    if t > 1:
        saved += 2 * e * shape.hidden_size / split  # the two reductions' outputs (collectives are saved)
    return saved


def _router(shape: ModelShape) -> float:
    """An MoE router's saves: fp32 scores, top-k weights and their sum, the top-k indices."""
    k = shape.experts_per_token
    return _F32 * (shape.num_experts + k + 1) + 8 * k


def region_work_bytes(shape: ModelShape, layout: Layout, moe: bool) -> float:
    """Bytes per local token the larger checkpointed region of a layer rebuilds (full AC).

    Full AC checkpoints a layer's attention, MLP and both norms as four regions; backward recomputes
    one at a time: its saves, with its input gathered again under SP. An MoE block keeps its
    router's ops (so routing cannot change) and rebuilds the rest, its all-to-alls included.
    """
    gathered = _act(layout) * shape.hidden_size if layout.sp else 0.0
    mlp = _moe_mlp(shape, layout) - _router(shape) if moe else _dense_mlp(shape, layout)
    return max(_attention(shape, layout), mlp) + gathered


def layer_saved_bytes(shape: ModelShape, layout: Layout, moe: bool) -> float:
    """Bytes per local token a layer keeps between its forward and backward under ``layout.ac``."""
    if layout.ac == "full":  # the inputs of its four regions: both norms, attention, MLP
        inputs = 4 * _act(layout) * shape.hidden_size / (layout.tp if layout.sp else 1)
        return inputs + (_router(shape) if moe else 0.0)
    if layout.ac == "selective":
        return _selective(shape, layout, moe)
    return layer_work_bytes(shape, layout, moe)


def model_saved_bytes(shape: ModelShape, layout: Layout) -> float:
    """Bytes per local token the model keeps outside its layers: token ids, rotary tables, final norm."""
    e, h = _act(layout), shape.hidden_size
    return 8 + 2 * e * shape.head_dim + (_F32 * h + 2 * e * h + _F32) / (layout.tp if layout.sp else 1)
