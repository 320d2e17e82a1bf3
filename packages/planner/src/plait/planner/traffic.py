"""Collectives one rank issues per optimizer step, by kind and mesh axis (docs/planner.md).

Each is priced by its *buffer* — the bytes the rank hands to the call (all-gather: its shard;
reduce-scatter: the whole input; all-reduce and all-to-all: the tensor; send: the activation) —
which is what a dispatch-level counter sees; :meth:`Collective.sent` turns that into ring traffic.
"""

from __future__ import annotations

from dataclasses import dataclass

from plait.planner.layout import Layout
from plait.planner.params import StageShare, param_sizes, stage_shares
from plait.planner.shape import ModelShape

__all__ = ["Collective", "estimate_traffic", "traffic_by_kind"]

_F32 = 4


@dataclass(frozen=True)
class Collective:
    """``count`` calls of ``kind`` over ``group`` ranks of ``axis``, ``buffer`` bytes in all."""

    kind: str
    axis: str
    group: int
    buffer: float
    count: int
    overlapped: str
    """What the flow runs it behind: ``compute`` (FSDP prefetch), ``attention`` (ring CP), or ``""`` (exposed)."""

    def sent(self) -> float:
        """Bytes this rank sends (ring algorithms)."""
        n = self.group
        factor = {
            "all_gather": n - 1,
            "reduce_scatter": (n - 1) / n,
            "all_reduce": 2 * (n - 1) / n,
            "all_to_all": (n - 1) / n,
            "send": 1.0,
        }[self.kind]
        return factor * self.buffer


def _sharded(
    layout: Layout, local: float, units: int, regather: int, n: int, root: float, axis: str
) -> list[Collective]:
    """One FSDP mesh's gathers (forward; again in backward for the ``regather`` resharded units) and
    reductions, over ``units`` units (the root among them when ``root`` > 0)."""
    if n == 1 or local == 0:
        return []
    e = 2 if layout.bf16 else 4
    passes = layout.grad_accum if layout.pp == 1 else 1
    out = [Collective("all_gather", axis, n, e * local * passes, units * passes, "compute")]
    if regather and layout.pp == 1 and layout.reshard is not False:
        group = layout.reshard if not isinstance(layout.reshard, bool) else n
        per_unit = e * (local - root / n) / (units - (1 if root else 0))
        buffer = per_unit * regather * passes * n / group
        out.append(Collective("all_gather", axis, group, buffer, regather * passes, "compute"))
    out.append(Collective("reduce_scatter", axis, n, _F32 * local * n, units, "compute"))
    return out


def _fsdp(shape: ModelShape, layout: Layout, share: StageShare) -> list[Collective]:
    """Dense weights over dp_shard x cp; experts under ep over ep_shard (never gathered when it is 1).

    Layer units but the last reshard after forward (gathered again in backward); the root does not.
    Expert units reshard too, unless checkpointing replays the forward's ops (any AC mode of an MoE
    model, whose routers are saved), when they stay gathered.
    """
    sizes = param_sizes(shape, layout, share)
    layers = share.dense_layers + share.moe_layers
    if layout.ep > 1:
        out = _sharded(layout, sizes.dense_local, layers + 1, layers - 1, layout.fsdp, sizes.root, "dp_shard")
        expert_regather = share.moe_layers if layout.ac == "none" else 0
        out += _sharded(
            layout, sizes.expert_local, share.moe_layers, expert_regather, layout.ep_shard, 0.0, "ep_shard"
        )
    else:
        out = _sharded(layout, sizes.local, layers + 1, layers - 1, layout.fsdp, sizes.root, "dp_shard")
    if layout.dp_replicate > 1:  # replicas all-reduce the dense weights; experts span every replica
        dense_local = sizes.dense_local if layout.ep > 1 else sizes.local
        out.append(
            Collective(
                "all_reduce", "dp_replicate", layout.dp_replicate, _F32 * dense_local, layers + 1, "compute"
            )
        )
    return out


def _tp(shape: ModelShape, layout: Layout, share: StageShare, tokens: float) -> list[Collective]:
    """Per layer the attention's and the MLP's collectives, forward and backward (docs/planner.md).

    Under SP a sharded block gathers its input and reduce-scatters its output, and the backward does
    the converse; a whole-sequence block gathers its input (and its output's gradient) and hands
    back its slice: its row-wise outputs are all-reduced (forward: 1, backward: gate and up).
    Attention the TP plan leaves out runs replicated and reduces nothing.
    """
    t, e = layout.tp, 2 if layout.bf16 else 4
    if t == 1:
        return []
    layers = share.dense_layers + share.moe_layers
    attention = 1 if shape.tp_attention else 0
    act = tokens * shape.hidden_size * e
    ends = int(share.embedding) + int(share.head)  # the embedding's forward, the head's backward
    if not layout.sp:
        # Each projection's input gradient is reduced on its own: q, k, v and gate, up.
        calls = layers * (4 * attention + 3) + ends
        return [Collective("all_reduce", "tp", t, calls * act, calls, "")]
    # A full-AC recompute stops once backward has what it needs (torch's early stop): under SP it
    # gathers the attention and MLP inputs again, and reduces nothing again (measured).
    gathers = layers * 4 + ends + (2 * layers if layout.ac == "full" else 0)
    # An MoE block runs whole (gathered in, split out): per MoE layer 2 scatters, not 4 (measured).
    mlp_scatters = 0 if shape.sp_whole_mlp else 2 * share.dense_layers
    scatters = 2 * attention * layers + mlp_scatters + ends
    out = [
        Collective("all_gather", "tp", t, gathers * act / t, gathers, ""),
        Collective("reduce_scatter", "tp", t, scatters * act, scatters, ""),
    ]
    if shape.sp_whole_mlp:
        out.append(Collective("all_reduce", "tp", t, 3 * layers * act, 3 * layers, ""))
    return out


def _cp(shape: ModelShape, layout: Layout, share: StageShare, tokens: float) -> list[Collective]:
    cp, e = layout.cp, 2 if layout.bf16 else 4
    if cp == 1:
        return []
    layers = share.dense_layers + share.moe_layers
    heads = shape.head_split(layout.tp)
    kv = tokens * (shape.kv_width + shape.v_width) / heads * e
    forwards = 2 if layout.ac == "full" else 1
    if layout.cp_variant == "all_gather":  # K/V gathered per forward, dK/dV reduce-scattered
        return [
            Collective("all_gather", "cp", cp, layers * forwards * kv, layers * forwards, ""),
            Collective("reduce_scatter", "cp", cp, layers * kv * cp * _F32 / e, layers, ""),
        ]
    if layout.cp_variant == "ring":  # K/V passed cp-1 times per forward and backward, fp32 dK/dV too
        steps = layers * (cp - 1) * (forwards + 1)
        width = 2 * shape.q_width if layout.gqa_expanded else shape.kv_width + shape.v_width
        grads = layers * (cp - 1) * tokens * width / heads * _F32  # at the kernel's (repeated) heads
        return [Collective("send", "cp", cp, steps * kv + grads, steps, "attention")]
    qo = tokens * 2 * shape.q_width / heads * e
    calls = layers * (forwards + 1) * 4
    return [Collective("all_to_all", "cp", cp, layers * (forwards + 1) * (kv + qo), calls, "")]


def _ep(shape: ModelShape, layout: Layout, share: StageShare, tokens: float) -> list[Collective]:
    if layout.ep == 1 or not share.moe_layers:
        return []
    e = 2 if layout.bf16 else 4
    passes = 2 + (1 if layout.ac == "full" else 0)
    slots = tokens * shape.experts_per_token * shape.hidden_size * e
    calls = share.moe_layers * passes * 2
    return [Collective("all_to_all", "ep", layout.ep, calls * slots, calls, "")]


def _pp(shape: ModelShape, layout: Layout, tokens: float) -> list[Collective]:
    if layout.pp == 1:
        return []
    e = 2 if layout.bf16 else 4
    per = tokens * shape.hidden_size * e / (layout.tp if layout.sp else 1)
    # Per microbatch an end rank sends each stage's output and each stage's input gradient but stage 0's.
    sends = 2 * layout.stages_per_rank - (1 if layout.pp == 2 else 0)
    calls = sends * layout.pp_microbatches * layout.grad_accum
    return [Collective("send", "pp", 2, calls * per, calls, "")]


def estimate_traffic(shape: ModelShape, layout: Layout, *, pp_rank: int | None = None) -> list[Collective]:
    """Every collective one rank issues in one optimizer step: the worst-loaded, or pipeline rank ``pp_rank``."""
    if pp_rank is not None:
        share = stage_shares(shape, layout, every_rank=True)[pp_rank]
    else:
        share = max(stage_shares(shape, layout), key=lambda s: (s.dense_layers + s.moe_layers, s.embedding))
    tokens = layout.micro_batch / layout.pp_microbatches * layout.seq_len / layout.cp
    per_forward = tokens * layout.pp_microbatches * layout.grad_accum
    return [
        *_fsdp(shape, layout, share),
        *_tp(shape, layout, share, per_forward),
        *_cp(shape, layout, share, per_forward),
        *_ep(shape, layout, share, per_forward),
        *_pp(shape, layout, tokens),
    ]


def traffic_by_kind(collectives: list[Collective]) -> dict[str, float]:
    """Buffer bytes per collective kind (what a dispatch-level counter reports)."""
    totals: dict[str, float] = {}
    for c in collectives:
        totals[c.kind] = totals.get(c.kind, 0.0) + c.buffer
    return totals
