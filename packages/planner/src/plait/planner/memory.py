"""Peak tensor memory of one rank over a training step (AdamW, FSDP2 flow); docs/planner.md states it.

The worst rank is priced: under pipeline parallel the first and the last pipeline rank (the embedding
and the most microbatches in flight; the head and the loss), the larger of the two.
"""

from __future__ import annotations

from dataclasses import dataclass

from plait.planner.activations import (
    layer_saved_bytes,
    layer_work_bytes,
    model_saved_bytes,
    region_work_bytes,
)
from plait.planner.layout import Layout
from plait.planner.params import StageShare, param_sizes, stage_shares
from plait.planner.shape import ModelShape

__all__ = ["MemoryEstimate", "estimate_memory", "estimate_memory_by_rank"]

_F32 = 4


@dataclass
class MemoryEstimate:
    """Bytes on one rank: resident state, what the step adds, and the step's peak."""

    parameters: float
    gradients: float
    optimizer: float
    gathered: float
    """FSDP unsharded parameters held at the peak (units kept after forward, current + prefetched)."""
    activations: float
    """Saved for backward at the peak: every layer's saves for the microbatches in flight."""
    loss: float
    """Logits and the cross-entropy's saved and gradient buffers."""
    transient: float
    """One layer's backward: its recompute (checkpointed) or its activation gradients, its weight gradients."""
    pp_rank: int = 0
    accumulating: bool = False
    """Gradients live through the forward (``grad_accum`` > 1): FSDP holds them unsharded until the last."""
    host: float = 0.0
    """Host memory of CPU offload: the sharded fp32 parameters, their gradients and AdamW state."""

    @property
    def peak(self) -> float:
        """Peak bytes over the step: the start of backward, mid-backward, or the optimizer step."""
        resident = self.parameters + self.optimizer + (self.gradients if self.accumulating else 0.0)
        start = resident + self.gathered + self.activations + max(self.loss, self.transient)
        # A checkpointed backward peaks mid-way: half the saved inputs are left, half the gradients made.
        middle = resident + self.gathered + (self.activations + self.gradients) / 2 + self.transient
        step = self.parameters + self.optimizer + self.gradients + self.parameters / 4
        return max(start, middle, step)

    def breakdown(self) -> dict[str, float]:
        """Every term and the peak, in bytes."""
        terms = (
            "parameters",
            "gradients",
            "optimizer",
            "gathered",
            "activations",
            "loss",
            "transient",
            "host",
        )
        return {**{t: getattr(self, t) for t in terms}, "peak": self.peak}


def _in_flight(layout: Layout, pp_rank: int) -> float:
    """Microbatches whose activations one local stage holds at the peak (per stage of ``stages_per_rank``)."""
    m, p, v = layout.pp_microbatches, layout.pp, layout.stages_per_rank
    if p == 1:
        return 1.0
    if layout.pp_schedule == "gpipe":
        return float(m)
    if layout.pp_schedule == "looped_bfs":
        return float(m)
    if v == 1:
        return float(min(m, p - pp_rank))
    warmup = (v - 1) * p + 2 * (p - 1 - pp_rank) + 1  # torch's interleaved warm-up forwards, plus one
    return min(warmup, m * v) / v


def _gathered(layout: Layout, units: int, largest: float, root: float) -> float:
    """Unsharded parameters held at the start of backward (compute dtype)."""
    e = 2 if layout.bf16 else 4
    if layout.fsdp == 1:
        return 0.0
    if layout.pp > 1 or layout.reshard is False:
        kept = units * largest  # stages (and reshard=False) keep every unit after forward
    elif layout.reshard is True:
        kept = largest  # the last unit, kept after forward; the rest resharded
    else:
        kept = largest + (units - 1) * largest / layout.reshard
    return e * (kept + root)


def _loss_bytes(shape: ModelShape, layout: Layout, tokens: float) -> float:
    """Logits (compute dtype, kept by the caller), fp32 log-softmax saved, its two gradient buffers."""
    vocab = shape.vocab_size / layout.tp
    e = 2 if layout.bf16 else 4
    upcast = _F32 if layout.bf16 else 0
    return tokens * vocab * (e + upcast + 3 * _F32)


def _estimate_share(shape: ModelShape, layout: Layout, share: StageShare) -> MemoryEstimate:
    e = 2 if layout.bf16 else 4
    sizes = param_sizes(shape, layout, share)
    local, largest, root = sizes.local, sizes.largest_unit, sizes.root
    tokens = layout.micro_batch / layout.pp_microbatches * layout.seq_len / layout.cp
    flight = _in_flight(layout, share.pp_rank) * layout.stages_per_rank
    layer_saves = share.dense_layers * layer_saved_bytes(shape, layout, False)
    layer_saves += share.moe_layers * layer_saved_bytes(shape, layout, True)
    layer_saves /= layout.stages_per_rank
    activations = tokens * flight * (layer_saves + model_saved_bytes(shape, layout))
    first_moe = share.moe_layers > 0
    # A layer's backward: without checkpointing two activation gradients as wide as its MLP and two
    # of the hidden size; full AC adds the larger region's recompute, selective what it did not save
    # and half as much again in activation gradients (measured); then its weight gradients in compute
    # dtype and the fp32 reduce-scatter input.
    width = shape.experts_per_token * shape.moe_intermediate_size if first_moe else shape.intermediate_size
    work = 2 * e * (width / (1 if first_moe else layout.tp) + shape.hidden_size)
    if layout.ac == "full":
        work += region_work_bytes(shape, layout, first_moe)
    elif layout.ac == "selective":
        saved = layer_saved_bytes(shape, layout, first_moe)
        work = 1.5 * (layer_work_bytes(shape, layout, first_moe) - saved)
    grads_in_compute = e * largest + (_F32 * largest if layout.bf16 or layout.fsdp > 1 else 0.0)
    if layout.sp:  # the gradients of a gathered input and of an output before its reduce-scatter: whole
        work += 2 * e * shape.hidden_size
    units = share.dense_layers + share.moe_layers
    # FSDP skips the reduction until the last micro-batch (or pipeline microbatch): unsharded fp32 gradients.
    accumulating = layout.grad_accum > 1 or layout.pp_microbatches > 1
    # CPU offload keeps the sharded state in host memory: a unit's fp32 shard is copied in before its
    # gather; accumulated (unsharded) gradients stay on the GPU until the last microbatch reduces them.
    device = 0.0 if layout.offload else 1.0
    return MemoryEstimate(
        parameters=_F32 * local * device,
        gradients=_F32 * (sizes.unsharded if accumulating else local * device),
        optimizer=2 * _F32 * local * device,
        gathered=_gathered(layout, units, largest, root),
        activations=activations,
        loss=_loss_bytes(shape, layout, tokens) if share.head else 0.0,
        transient=tokens * work
        + grads_in_compute
        + (_F32 * largest / layout.fsdp if layout.offload else 0.0),
        pp_rank=share.pp_rank,
        accumulating=accumulating,
        host=4 * _F32 * local if layout.offload else 0.0,
    )


def estimate_memory(shape: ModelShape, layout: Layout) -> MemoryEstimate:
    """The worst pipeline rank's memory over one step of ``layout`` for ``shape``."""
    return max((_estimate_share(shape, layout, s) for s in stage_shares(shape, layout)), key=lambda m: m.peak)


def estimate_memory_by_rank(shape: ModelShape, layout: Layout) -> list[MemoryEstimate]:
    """Every pipeline rank's memory (index = pp rank; one entry without pipeline parallel)."""
    return [_estimate_share(shape, layout, s) for s in stage_shares(shape, layout, every_rank=True)]
