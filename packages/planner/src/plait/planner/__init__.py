"""Analytic layout planner: per-rank memory, traffic and step time of a layout, and the search over layouts.

Nothing is built: a :class:`ModelShape` (read from a Hugging Face-style config), a :class:`Layout`
and a :class:`Cluster` are enough, so thousands of layouts are priced in seconds. The model is stated
in docs/planner.md and held to measured runs by ``tools/memory_model``.
"""

from __future__ import annotations

from plait.planner.cluster import GIB, GPU_PRESETS, Cluster, cluster
from plait.planner.layout import AC_MODES, CP_VARIANTS, PP_SCHEDULES, Layout, refusal
from plait.planner.memory import MemoryEstimate, estimate_memory, estimate_memory_by_rank
from plait.planner.params import ParamSizes, StageShare, param_sizes, stage_shares
from plait.planner.search import Candidate, SearchResult, evaluate, search
from plait.planner.shape import ModelShape
from plait.planner.timing import StepTime, estimate_time
from plait.planner.traffic import Collective, estimate_traffic, traffic_by_kind

__all__ = [
    "AC_MODES",
    "CP_VARIANTS",
    "GIB",
    "GPU_PRESETS",
    "PP_SCHEDULES",
    "Candidate",
    "Cluster",
    "Collective",
    "Layout",
    "MemoryEstimate",
    "ParamSizes",
    "ModelShape",
    "SearchResult",
    "StageShare",
    "StepTime",
    "cluster",
    "estimate_memory",
    "estimate_memory_by_rank",
    "estimate_time",
    "estimate_traffic",
    "evaluate",
    "param_sizes",
    "refusal",
    "search",
    "stage_shares",
    "traffic_by_kind",
]
