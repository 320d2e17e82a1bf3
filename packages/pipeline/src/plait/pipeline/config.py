"""`PipelineConfig`: schedule, microbatches, stages per rank and the optional explicit layer split."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from plait.pipeline.schedules import SCHEDULES

__all__ = ["PipelineConfig"]


@dataclass(frozen=True)
class PipelineConfig:
    """How the model is split and scheduled; validated on construction (every rank, no collectives)."""

    schedule: str = "1f1b"
    """One of ``gpipe``, ``1f1b``, ``interleaved_1f1b``, ``looped_bfs``, ``interleaved_zero_bubble``,
    ``zbv_zero_bubble`` (the ``torch.distributed.pipelining`` schedules)."""
    microbatches: int | None = None
    """Microbatches per step; must divide the per-rank batch. None = the number of stages."""
    stages_per_rank: int | None = None
    """Virtual stages per rank: 1 for ``gpipe``/``1f1b``, 2 for ``zbv_zero_bubble``, >= 2 for the
    other multi-stage schedules. None = that default (2 for multi-stage schedules)."""
    layers_per_stage: tuple[int, ...] | None = None
    """Explicit layer counts, one per stage in stage order; None = balanced by parameter count."""

    def __post_init__(self) -> None:
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule={self.schedule!r} is not one of {sorted(SCHEDULES)}")
        info = SCHEDULES[self.schedule]
        if self.microbatches is not None and (
            not isinstance(self.microbatches, int)
            or isinstance(self.microbatches, bool)
            or self.microbatches < 1
        ):
            raise ValueError(f"microbatches must be a positive int or None, got {self.microbatches!r}")
        spr = self.stages_per_rank
        if spr is not None and (not isinstance(spr, int) or isinstance(spr, bool) or spr < 1):
            raise ValueError(f"stages_per_rank must be a positive int or None, got {spr!r}")
        if spr is not None:
            if not info.multi_stage and spr != 1:
                raise ValueError(
                    f"schedule {self.schedule!r} runs one stage per rank, got stages_per_rank={spr}; "
                    "use interleaved_1f1b, looped_bfs or a zero-bubble schedule for virtual stages."
                )
            if info.fixed_stages_per_rank is not None and spr != info.fixed_stages_per_rank:
                raise ValueError(
                    f"schedule {self.schedule!r} needs stages_per_rank={info.fixed_stages_per_rank}, got {spr}"
                )
            if info.multi_stage and spr < 2:
                raise ValueError(f"schedule {self.schedule!r} needs stages_per_rank >= 2, got {spr}")
        if self.layers_per_stage is not None:
            counts = tuple(self.layers_per_stage)
            if not counts or any(not isinstance(c, int) or isinstance(c, bool) or c < 1 for c in counts):
                raise ValueError(f"layers_per_stage must list positive ints, got {self.layers_per_stage!r}")
            object.__setattr__(self, "layers_per_stage", counts)

    @property
    def local_stages(self) -> int:
        """Stages each rank holds."""
        if self.stages_per_rank is not None:
            return self.stages_per_rank
        return 2 if SCHEDULES[self.schedule].multi_stage else 1

    def num_microbatches(self, pp_size: int) -> int:
        """The microbatch count for ``pp_size`` ranks (default: one per stage)."""
        return self.microbatches if self.microbatches is not None else pp_size * self.local_stages

    def check_for(self, pp_size: int) -> None:
        """Refuse microbatch counts the schedule cannot run with ``pp_size`` ranks."""
        m = self.num_microbatches(pp_size)
        if self.schedule == "1f1b" and m < pp_size:
            raise ValueError(f"schedule '1f1b' needs microbatches >= pp_size ({pp_size}), got {m}")
        if SCHEDULES[self.schedule].multi_stage and self.schedule != "zbv_zero_bubble":
            rounds = max(1, m // pp_size)
            if m % rounds:
                raise ValueError(
                    f"schedule {self.schedule!r} needs microbatches to be a multiple of "
                    f"max(1, microbatches // pp_size) = {rounds}, got {m}; use a multiple of pp_size={pp_size}."
                )
        if self.layers_per_stage is not None and len(self.layers_per_stage) != pp_size * self.local_stages:
            raise ValueError(
                f"layers_per_stage has {len(self.layers_per_stage)} entries but there are "
                f"{pp_size * self.local_stages} stages (pp_size {pp_size} x stages_per_rank {self.local_stages})"
            )

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PipelineConfig:
        """Build from a mapping (YAML); unknown keys are an error."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown pipeline option(s) {unknown}; known: {sorted(known)}")
        values = dict(data)
        if values.get("layers_per_stage") is not None:
            values["layers_per_stage"] = tuple(values["layers_per_stage"])
        return cls(**values)
