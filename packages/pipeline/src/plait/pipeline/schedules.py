"""The pipeline schedules `torch.distributed.pipelining` offers, by name, and which stages a rank holds."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleLoopedBFS,
    ScheduleZBVZeroBubble,
)
from torch.distributed.pipelining.schedules import _PipelineSchedule

__all__ = ["SCHEDULES", "ScheduleInfo", "build_schedule", "local_stage_indices"]


@dataclass(frozen=True)
class ScheduleInfo:
    """A schedule class and how it places stages on ranks."""

    cls: type[_PipelineSchedule]
    multi_stage: bool
    """Several (virtual) stages per rank."""
    v_shape: bool = False
    """Stages placed in a V (rank r holds r and 2p-1-r) instead of looping (r, r+p, ...)."""
    fixed_stages_per_rank: int | None = None


SCHEDULES: dict[str, ScheduleInfo] = {
    "gpipe": ScheduleInfo(ScheduleGPipe, multi_stage=False),
    "1f1b": ScheduleInfo(Schedule1F1B, multi_stage=False),
    "interleaved_1f1b": ScheduleInfo(ScheduleInterleaved1F1B, multi_stage=True),
    "looped_bfs": ScheduleInfo(ScheduleLoopedBFS, multi_stage=True),
    "interleaved_zero_bubble": ScheduleInfo(ScheduleInterleavedZeroBubble, multi_stage=True),
    "zbv_zero_bubble": ScheduleInfo(
        ScheduleZBVZeroBubble, multi_stage=True, v_shape=True, fixed_stages_per_rank=2
    ),
}
"""Schedule names accepted by `PipelineConfig.schedule`."""


def local_stage_indices(schedule: str, pp_rank: int, pp_size: int, stages_per_rank: int) -> list[int]:
    """The global stage indices rank ``pp_rank`` holds, in increasing order."""
    if SCHEDULES[schedule].v_shape:
        return sorted({pp_rank, 2 * pp_size - 1 - pp_rank})
    return [pp_rank + v * pp_size for v in range(stages_per_rank)]


def build_schedule(
    schedule: str,
    stages: list[PipelineStage],
    microbatches: int,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
) -> _PipelineSchedule:
    """Instantiate ``schedule`` over this rank's ``stages``; gradients are averaged over microbatches."""
    info = SCHEDULES[schedule]
    if info.multi_stage:
        return info.cls(stages, n_microbatches=microbatches, loss_fn=loss_fn, scale_grads=True)
    (stage,) = stages
    return info.cls(stage, n_microbatches=microbatches, loss_fn=loss_fn, scale_grads=True)
