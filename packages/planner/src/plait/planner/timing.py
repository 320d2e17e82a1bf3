"""Step time, tokens/s/GPU and MFU of a layout on a cluster (the overlap rules are in docs/planner.md).

Compute is the model's FLOPs (torchtitan's formula, plus the recompute of checkpointed layers) at
``Cluster.compute_efficiency`` of peak. Collectives the flow overlaps cost only what exceeds the compute
they hide behind (FSDP gathers and reductions: the whole step's; ring attention's K/V passes: the
attention's); TP, all-gather CP, all-to-all and pipeline sends are exposed; a pipeline adds its
bubble, ``(pp - 1) / (microbatches x stages_per_rank)`` of the compute.
"""

from __future__ import annotations

from dataclasses import dataclass

from plait.planner.cluster import Cluster
from plait.planner.layout import Layout
from plait.planner.params import param_sizes, stage_shares
from plait.planner.shape import ModelShape
from plait.planner.traffic import Collective

__all__ = ["StepTime", "estimate_time"]

_RECOMPUTE = {"none": 0.0, "selective": 0.1, "full": 1.0 / 3.0}
"""Extra compute per AC mode, as a share of forward + backward (full: one more forward of 2 of 6 units)."""

_F32 = 4
_ADAMW_HOST_BYTES = 28
"""Bytes an AdamW step moves per fp32 element: parameter, gradient and both moments read, three written."""
_AXIS_ORDER = ("tp", "cp", "dp_shard", "dp_replicate", "pp")
"""Mesh axes innermost first: a group over an axis spans the ranks of the axes inside it."""


@dataclass(frozen=True)
class StepTime:
    """Seconds per optimizer step by part, and the rates they give."""

    compute: float
    exposed_comm: float
    overlapped_comm: float
    bubble: float
    tokens_per_gpu: float
    model_flops_per_token: float
    peak_flops: float
    host: float = 0.0
    """CPU offload's optimizer step on the host (exposed); its copies run behind compute."""

    @property
    def step(self) -> float:
        """Seconds per optimizer step."""
        hidden = max(0.0, self.overlapped_comm - self.compute)
        return self.compute + self.exposed_comm + hidden + self.bubble + self.host

    @property
    def tokens_per_second_per_gpu(self) -> float:
        """Training tokens per second per GPU."""
        return self.tokens_per_gpu / self.step

    @property
    def mfu(self) -> float:
        """Model FLOPs utilisation (torchtitan's: model FLOPs per token x tokens/s / peak)."""
        return self.model_flops_per_token * self.tokens_per_second_per_gpu / self.peak_flops


def _span(layout: Layout, axis: str) -> int:
    """Consecutive ranks a group over ``axis`` spans (its size times the axes inside it)."""
    if axis == "ep":  # ep is carved from dp_shard x cp x tp, innermost
        return layout.ep
    if axis == "ep_shard":
        return layout.dp * layout.cp * layout.tp
    span = 1
    for name in _AXIS_ORDER:
        span *= getattr(layout, name)
        if name == axis:
            return span
    raise AssertionError(axis)


def _seconds(c: Collective, layout: Layout, cluster: Cluster) -> float:
    return c.sent() / cluster.bandwidth(_span(layout, c.axis)) + c.count * cluster.latency_us * 1e-6


def _offload_seconds(shape: ModelShape, layout: Layout, cluster: Cluster) -> tuple[float, float]:
    """CPU offload: the fp32 shards copied in per gather and their gradients out (behind compute), and
    the optimizer step on the host (exposed); (0, 0) without offload."""
    if not layout.offload:
        return 0.0, 0.0
    share = max(stage_shares(shape, layout), key=lambda s: s.dense_layers + s.moe_layers)
    local = param_sizes(shape, layout, share).local
    passes = layout.grad_accum if layout.pp == 1 else 1  # stages gather once per step (traffic.py)
    gathers = passes * (2 if layout.reshard is not False and layout.pp == 1 else 1)
    copies = _F32 * local * (gathers + 1) / (cluster.pcie_gbps * 1e9)
    return copies, local * _ADAMW_HOST_BYTES / (cluster.host_gbps * 1e9)


def _core_flops(shape: ModelShape, seq_len: int) -> float:
    """Attention's score and value matmuls per token, forward and backward (torchtitan's 12 L H D T)."""
    return 12.0 * shape.num_layers * shape.num_heads * shape.head_dim * seq_len


def estimate_time(
    shape: ModelShape, layout: Layout, cluster: Cluster, collectives: list[Collective]
) -> StepTime:
    """Price one optimizer step of ``layout`` on ``cluster`` (``collectives`` from estimate_traffic)."""
    tokens = layout.micro_batch * layout.grad_accum * layout.seq_len * layout.dp / layout.world
    model_flops = shape.flops_per_token(layout.seq_len)
    work = model_flops * tokens * (1 + _RECOMPUTE[layout.ac])
    if not shape.tp_attention:  # attention the TP plan leaves out: every tp rank computes it whole
        attention_block = 6.0 * shape.num_layers * shape.attention_params() + _core_flops(
            shape, layout.seq_len
        )
        work += (layout.tp - 1) * attention_block * tokens * (1 + _RECOMPUTE[layout.ac])
    compute = work / (cluster.peak_tflops * 1e12 * cluster.compute_efficiency)
    attention = compute * _core_flops(shape, layout.seq_len) / model_flops
    exposed = sum(_seconds(c, layout, cluster) for c in collectives if not c.overlapped)
    ring = sum(_seconds(c, layout, cluster) for c in collectives if c.overlapped == "attention")
    exposed += max(0.0, ring - attention)  # ring steps hide behind the attention of their chunk only
    hidden = sum(_seconds(c, layout, cluster) for c in collectives if c.overlapped == "compute")
    copies, host = _offload_seconds(shape, layout, cluster)
    hidden += copies
    bubble = 0.0
    if layout.pp > 1:
        bubble = compute * (layout.pp - 1) / (layout.pp_microbatches * layout.stages_per_rank)
    return StepTime(
        compute=compute,
        exposed_comm=exposed,
        overlapped_comm=hidden,
        bubble=bubble,
        tokens_per_gpu=tokens,
        model_flops_per_token=model_flops,
        peak_flops=cluster.peak_tflops * 1e12,
        host=host,
    )
