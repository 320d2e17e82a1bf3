"""A candidate layout (sizes, techniques, batch) and whether plait builds it for a model."""

from __future__ import annotations

import functools
from dataclasses import dataclass

from plait.mesh import FSDP2Config, ParallelismSizes, combination_request, refusal_of
from plait.planner.shape import ModelShape

__all__ = ["AC_MODES", "CP_VARIANTS", "PP_SCHEDULES", "Layout", "refusal"]

AC_MODES = ("none", "selective", "full")
CP_VARIANTS = ("all_gather", "ring", "all_to_all")
PP_SCHEDULES = (
    "gpipe",
    "1f1b",
    "interleaved_1f1b",
    "looped_bfs",
    "interleaved_zero_bubble",
    "zbv_zero_bubble",
)
_MULTI_STAGE = frozenset({"interleaved_1f1b", "looped_bfs", "interleaved_zero_bubble", "zbv_zero_bubble"})


@dataclass(frozen=True, kw_only=True)
class Layout:
    """One way to run a job: mesh sizes, techniques and the per-rank batch (FSDP2 flow).

    ``micro_batch`` sequences of ``seq_len`` tokens per data-parallel rank per forward (split into
    ``pp_microbatches`` under pipeline parallel); ``grad_accum`` forwards per optimizer step.
    """

    seq_len: int
    micro_batch: int = 1
    grad_accum: int = 1
    pp: int = 1
    pp_schedule: str = "1f1b"
    pp_microbatches: int = 1
    stages_per_rank: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    cp_variant: str = "all_gather"
    tp: int = 1
    sp: bool = False
    ep: int = 1
    ac: str = "full"
    reshard: bool | int = True
    """FSDP2 ``reshard_after_forward`` of the layer units: True, False, or a group size (hpZ)."""
    offload: bool = False
    """FSDP2 CPU offload: sharded parameters, their gradients and AdamW state live in host memory,
    the optimizer steps on the CPU (recipe ``parallel.options.offload_policy: cpu``)."""
    bf16: bool = True
    """bf16 compute, fp32 master weights, gradients and reduction (plait's ``bf16`` policy)."""
    forward_prefetch: int = 1
    backward_prefetch: int = 1
    gqa_expanded: bool = False
    """Attention saves K and V repeated to every query head (torch's CPU flash kernel); CUDA's does not."""

    def __post_init__(self) -> None:
        if self.ac not in AC_MODES:
            raise ValueError(f"Layout.ac must be one of {AC_MODES}, got {self.ac!r}")
        if self.cp_variant not in CP_VARIANTS:
            raise ValueError(f"Layout.cp_variant must be one of {CP_VARIANTS}, got {self.cp_variant!r}")
        if self.pp_schedule not in PP_SCHEDULES:
            raise ValueError(f"Layout.pp_schedule must be one of {PP_SCHEDULES}, got {self.pp_schedule!r}")
        for name in ("seq_len", "micro_batch", "grad_accum", "pp", "pp_microbatches", "stages_per_rank"):
            if getattr(self, name) < 1:
                raise ValueError(f"Layout.{name} must be >= 1, got {getattr(self, name)}")

    @property
    def world(self) -> int:
        """Ranks the layout needs."""
        return self.pp * self.dp_replicate * self.dp_shard * self.cp * self.tp

    @property
    def dp(self) -> int:
        """Data-parallel ranks (replicas x shards)."""
        return self.dp_replicate * self.dp_shard

    @property
    def fsdp(self) -> int:
        """Ranks a dense parameter is sharded over (dp_shard x cp: cp ranks shard parameters too)."""
        return self.dp_shard * self.cp

    @property
    def ep_shard(self) -> int:
        """Ranks one expert's weights are sharded over: ``dp * cp * tp // ep`` (HSDP replicas included:
        plait carves ep from every non-pipeline rank)."""
        return self.dp * self.cp * self.tp // self.ep

    @property
    def stages(self) -> int:
        """Pipeline stages in all (``pp * stages_per_rank``)."""
        return self.pp * self.stages_per_rank

    def describe(self) -> str:
        """``pp2(1f1b,m8) dp_shard4 tp8+sp ep8 cp2(ring) ac=full mb1 reshard=2``."""
        parts = []
        if self.pp > 1:
            virtual = f",v{self.stages_per_rank}" if self.stages_per_rank > 1 else ""
            parts.append(f"pp{self.pp}({self.pp_schedule},m{self.pp_microbatches}{virtual})")
        for name in ("dp_replicate", "dp_shard"):
            if getattr(self, name) > 1:
                parts.append(f"{name}{getattr(self, name)}")
        if self.cp > 1:
            parts.append(f"cp{self.cp}({self.cp_variant})")
        if self.tp > 1:
            parts.append(f"tp{self.tp}{'+sp' if self.sp else ''}")
        if self.ep > 1:
            parts.append(f"ep{self.ep}")
        parts.append(f"ac={self.ac} mb{self.micro_batch}")
        if self.grad_accum > 1:
            parts.append(f"accum{self.grad_accum}")
        if self.reshard is not True:
            parts.append(f"reshard={self.reshard}")
        if self.offload:
            parts.append("offload=cpu")
        return " ".join(parts)


@functools.cache
def _config(sequence_parallel: bool) -> FSDP2Config:
    return FSDP2Config(sequence_parallel=sequence_parallel)


@functools.cache
def _table_refusal(sizes: tuple[int, ...], sp: bool, ac: str, moe: bool) -> str | None:
    dp, dp_replicate, tp, pp, cp, ep = sizes
    request = combination_request(
        _config(sp),
        ParallelismSizes(
            dp_size=dp, dp_replicate_size=dp_replicate, tp_size=tp, pp_size=pp, cp_size=cp, ep_size=ep
        ),
        activation_checkpointing=False if ac == "none" else ac,
        features=("moe",) if moe else (),
    )
    return refusal_of(request)


def _request_refusal(layout: Layout, shape: ModelShape) -> str | None:
    """The combination table's refusal of the layout (the one that run and ``validate`` give)."""
    sizes = (layout.dp, layout.dp_replicate, layout.tp, layout.pp, layout.cp, layout.ep)
    return _table_refusal(sizes, layout.sp, layout.ac, shape.moe)


def refusal(layout: Layout, shape: ModelShape) -> str | None:
    """Why plait cannot run ``layout`` for ``shape`` (a short reason, its kind first), or None.

    The kinds (the part before ``:``) are what the search counts rejections by.
    """
    checks = (
        (
            shape.num_heads % layout.tp != 0,
            f"heads not divisible: {shape.num_heads} heads over tp {layout.tp}",
        ),
        (
            shape.num_kv_heads % layout.tp != 0 and not shape.kv_lora_rank,
            f"kv heads not divisible: {shape.num_kv_heads} kv heads over tp {layout.tp}",
        ),
        (layout.ep > 1 and not shape.moe, "ep without experts: a dense model has no expert axis"),
        (
            shape.moe and layout.ep > 1 and shape.num_experts % layout.ep != 0,
            f"experts not divisible: {shape.num_experts} experts over ep {layout.ep}",
        ),
        (
            layout.ep > 1 and (layout.dp * layout.cp * layout.tp) % layout.ep != 0,
            f"ep does not divide the non-pipeline ranks dp*cp*tp: ep {layout.ep}",
        ),
        (layout.seq_len % (2 * layout.cp) != 0, f"sequence not divisible: {layout.seq_len} over 2*cp"),
        (
            layout.sp and layout.seq_len % (layout.tp * layout.cp) != 0,
            "sequence not divisible: by tp under sp",
        ),
        (layout.stages > shape.num_layers, f"too few layers: {shape.num_layers} for {layout.stages} stages"),
        (
            layout.pp > 1 and layout.micro_batch % layout.pp_microbatches != 0,
            "microbatches not divisible: the micro-batch does not split into pp microbatches",
        ),
        (
            layout.pp > 1 and layout.pp_microbatches < layout.pp,
            "too few microbatches: a pipeline needs >= pp microbatches",
        ),
        (
            (layout.stages_per_rank > 1) != (layout.pp_schedule in _MULTI_STAGE) and layout.pp > 1,
            f"schedule and stages disagree: {layout.pp_schedule} with {layout.stages_per_rank} stage(s) per rank",
        ),
        (
            isinstance(layout.reshard, int)
            and not isinstance(layout.reshard, bool)
            and not (1 < layout.reshard < layout.fsdp and layout.fsdp % layout.reshard == 0),
            f"reshard group does not divide: {layout.reshard} of {layout.fsdp} shard ranks",
        ),
    )
    for failed, reason in checks:
        if failed:
            return reason
    table = _request_refusal(layout, shape)
    return f"not built: {table}" if table else None
