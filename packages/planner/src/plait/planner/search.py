"""Search every legal layout of a model on a cluster; rank those that fit by estimated throughput."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

from plait.planner.cluster import Cluster
from plait.planner.layout import Layout, refusal
from plait.planner.memory import MemoryEstimate, estimate_memory
from plait.planner.shape import ModelShape
from plait.planner.timing import StepTime, estimate_time
from plait.planner.traffic import Collective, estimate_traffic

__all__ = ["MAX_EP", "MIN_CP_TOKENS", "Candidate", "SearchResult", "evaluate", "search"]

MIN_CP_TOKENS = 1024
"""The search splits a sequence over at most ``seq_len // 1024`` cp ranks (shorter chunks starve attention)."""
MAX_EP = 64
"""The search's largest expert-parallel group (pin ``ep`` to go beyond)."""


@dataclass(frozen=True)
class Candidate:
    """A layout with its estimates; ``over`` > 0 is how many bytes it exceeds the usable memory by."""

    layout: Layout
    memory: MemoryEstimate
    time: StepTime | None
    """None for a layout rejected as out of memory (it is not priced)."""
    collectives: list[Collective]
    over: float

    @property
    def fits(self) -> bool:
        """Whether the peak fits in the cluster's usable memory."""
        return self.over <= 0


@dataclass
class SearchResult:
    """The fitting candidates (best first), every rejection by reason, and the search's size."""

    candidates: list[Candidate]
    rejected: Counter[str] = field(default_factory=Counter)
    over_by: dict[str, tuple[float, float]] = field(default_factory=dict)
    """Out-of-memory reasons: (least, most) bytes over the limit."""
    evaluated: int = 0


def _powers(limit: int) -> list[int]:
    out, p = [], 1
    while p <= limit:
        out.append(p)
        p *= 2
    return out


def _divisors(n: int, options: list[int]) -> list[int]:
    return [d for d in options if n % d == 0]


def evaluate(shape: ModelShape, layout: Layout, cluster: Cluster) -> Candidate:
    """Price one (legal) layout: memory, traffic, step time and how far over the memory it is."""
    memory = estimate_memory(shape, layout)
    collectives = estimate_traffic(shape, layout)
    time = estimate_time(shape, layout, cluster, collectives)
    return Candidate(layout, memory, time, collectives, memory.peak - cluster.usable_bytes)


def _pipelines(shape: ModelShape, pp: int, sequences: int) -> Iterator[dict[str, object]]:
    """Schedules and microbatch counts for ``pp`` stages and ``sequences`` per data-parallel rank."""
    if pp == 1:
        yield {}
        return
    counts = sorted({m for m in (pp, 2 * pp, 4 * pp) if sequences % m == 0})
    for m in counts:
        yield {"pp_schedule": "1f1b", "pp_microbatches": m}
        if shape.num_layers >= 2 * pp:
            yield {"pp_schedule": "interleaved_1f1b", "pp_microbatches": m, "stages_per_rank": 2}


def _choices(pin: Mapping[str, int], axis: str, searched: list[int]) -> list[int]:
    """A pinned size alone (searched or not), else the searched sizes."""
    return [pin[axis]] if axis in pin else searched


def _sizes(
    shape: ModelShape, cluster: Cluster, seq_len: int, pin: Mapping[str, int]
) -> Iterator[dict[str, int]]:
    world, node = cluster.world_size, cluster.gpus_per_node
    for tp in _choices(pin, "tp", _divisors(node, _powers(node))):
        for cp in _choices(pin, "cp", _powers(min(world // tp, max(1, seq_len // MIN_CP_TOKENS)))):
            for pp in _choices(pin, "pp", _powers(min(shape.num_layers, world))):
                if world % (tp * cp * pp):
                    continue
                dp = world // (tp * cp * pp)
                in_node = max(1, node // (tp * cp))  # HSDP: shard within a node, replicate across
                hsdp = {1, dp // in_node} if dp % in_node == 0 and dp > in_node else {1}
                for dp_replicate in _choices(pin, "dp_replicate", sorted(hsdp)):
                    if dp % dp_replicate:
                        continue
                    experts = _choices(pin, "ep", _powers(min(shape.num_experts, MAX_EP)))
                    eps = experts if shape.moe or "ep" in pin else [1]
                    for ep in eps:
                        sizes = {"tp": tp, "cp": cp, "pp": pp, "dp_replicate": dp_replicate, "ep": ep}
                        sizes["dp_shard"] = dp // dp_replicate
                        if all(sizes.get(k) == v for k, v in pin.items()):
                            yield sizes


def _layouts(
    shape: ModelShape,
    cluster: Cluster,
    global_tokens: int,
    seq_len: int,
    pin: Mapping[str, int],
    offload: bool = False,
) -> Iterator[Layout]:
    sequences = max(1, global_tokens // seq_len)
    for sizes in _sizes(shape, cluster, seq_len, pin):
        dp = sizes["dp_replicate"] * sizes["dp_shard"]
        if sequences % dp:
            continue
        per_rank = sequences // dp
        fsdp = sizes["dp_shard"] * sizes["cp"]
        group = cluster.gpus_per_node // (sizes["tp"] * sizes["cp"])
        reshards: list[bool | int] = [True, False] + (
            [group] if 1 < group < fsdp and fsdp % group == 0 else []
        )
        batches = [per_rank] if sizes["pp"] > 1 else _divisors(per_rank, _powers(min(per_rank, 8)))
        variants = ("ring", "all_gather") if sizes["cp"] > 1 else ("all_gather",)
        for mb in batches:
            for pipe in _pipelines(shape, sizes["pp"], mb):
                for sp in (True, False) if sizes["tp"] > 1 else (False,):
                    for ac in ("none", "selective", "full"):
                        for variant in variants:
                            for reshard in reshards if sizes["pp"] == 1 else [True]:
                                yield Layout(
                                    seq_len=seq_len,
                                    micro_batch=mb,
                                    grad_accum=per_rank // mb,
                                    sp=sp,
                                    ac=ac,
                                    cp_variant=variant,
                                    reshard=reshard,
                                    offload=offload,
                                    **sizes,
                                    **pipe,
                                )


def _pinned_keys(pin: Mapping[str, int]) -> None:
    known = {"tp", "cp", "pp", "dp_replicate", "dp_shard", "ep"}
    unknown = sorted(set(pin) - known)
    if unknown:
        raise ValueError(f"cannot pin {', '.join(unknown)}; pin any of: {', '.join(sorted(known))}")


def _rank(c: Candidate) -> tuple[float, int, float]:
    """Faster first (within 1 %), then fewer parallel axes (simpler to run), then less memory."""
    assert c.time is not None
    speed = round(math.log(c.time.tokens_per_second_per_gpu) / math.log(1.01))
    axes = sum(1 for n in ("tp", "cp", "pp", "ep", "dp_replicate") if getattr(c.layout, n) > 1)
    extras = (c.layout.grad_accum > 1) + (c.layout.reshard is not True) + c.layout.offload
    return (-speed, axes + extras, c.memory.peak)


def _consider(result: SearchResult, shape: ModelShape, layout: Layout, cluster: Cluster) -> None:
    """Count ``layout`` into ``result``: refused by its reason, out of (host) memory, or priced."""
    result.evaluated += 1
    reason = refusal(layout, shape)
    if reason is not None:
        result.rejected[reason.split(":")[0]] += 1
        return
    memory = estimate_memory(shape, layout)
    if memory.host > cluster.host_bytes:
        result.rejected["offloaded state over the host memory"] += 1
        return
    over = memory.peak - cluster.usable_bytes
    if over > 0:
        result.rejected["out of memory"] += 1
        low, high = result.over_by.get("out of memory", (over, over))
        result.over_by["out of memory"] = (min(low, over), max(high, over))
        result.candidates.append(Candidate(layout, memory, None, [], over))
        return
    result.candidates.append(evaluate(shape, layout, cluster))


def search(
    shape: ModelShape,
    cluster: Cluster,
    *,
    global_tokens: int,
    seq_len: int,
    pin: Mapping[str, int] | None = None,
    top: int | None = 10,
    offload: bool = True,
) -> SearchResult:
    """Every layout of ``shape`` on ``cluster`` for ``global_tokens`` per step at ``seq_len``.

    ``pin`` fixes sizes (e.g. ``{"pp": 4, "ep": 8}``); the rest are searched. Fitting candidates are
    sorted by estimated tokens/s/GPU; each rejected layout is counted under its reason's kind.
    Where no layout fits, the same layouts with CPU offload are tried too (unless ``offload`` is False).
    """
    pin = dict(pin or {})
    _pinned_keys(pin)
    if global_tokens < seq_len:
        raise ValueError(f"global_tokens {global_tokens} is less than one sequence of {seq_len} tokens")
    result = SearchResult([])
    for layout in _layouts(shape, cluster, global_tokens, seq_len, pin):
        _consider(result, shape, layout, cluster)
    if offload and not any(c.fits for c in result.candidates):  # nothing fits on the GPUs: offload
        for layout in _layouts(shape, cluster, global_tokens, seq_len, pin, offload=True):
            _consider(result, shape, layout, cluster)
    fitting = sorted((c for c in result.candidates if c.fits), key=_rank)
    closest = sorted((c for c in result.candidates if not c.fits), key=lambda c: c.over)
    result.candidates = fitting[:top] if top else fitting
    if not fitting:
        result.candidates = closest[: top or 10]
    return result
