"""`ParallelPlan`: the record of every decision `plan_parallelism` made (built in `plait.sidecar.plan`).

The flow applies it, ``plait-train plan`` prints it (`ParallelPlan.text`), and tests compare its
rank-independent `ParallelPlan.describe` between a dry run and the ranks.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from torch import nn
from torch.distributed.tensor.parallel import ParallelStyle

from plait.float8 import Float8Plan
from plait.sharding import FSDPUnit, LayerGroup
from plait.strategies import MoEBlockInfo

__all__ = ["ParallelPlan"]


@dataclass(frozen=True)
class ParallelPlan:
    """What `parallelize_model` applies to one model (or one pipeline stage), decided once.

    ``describe()`` is its rank-independent summary (what ``plait-train plan`` prints and what tests
    compare between a dry run and the ranks); the fields with module references are for the flow.
    """

    strategy: str
    """``fsdp2``, ``ddp`` or ``megatron_fsdp``."""
    sizes: tuple[tuple[str, int], ...]
    """Mesh axes larger than 1, in mesh order."""
    tp_plan: Mapping[str, ParallelStyle] = field(default_factory=lambda: MappingProxyType({}))
    """The TP plan to apply (empty without TP)."""
    tp_plan_source: str | None = None
    """Where it came from: config, sidecar, registry, Hugging Face or the default plan."""
    sequence_parallel: bool = False
    async_tp: bool = False
    cp_attention: str | None = None
    """The context-parallel variant, None without CP."""
    cp_gathered: tuple[str, ...] = ()
    """Sequence mixers cp runs on the whole sequence (``cp_sequence_mixers='gather'``)."""
    moe_blocks: tuple[MoEBlockInfo, ...] = ()
    """The MoE blocks expert parallel shards (empty without EP)."""
    ac_mode: str | None = None
    """``full`` or ``selective``; None without activation checkpointing."""
    ac_scope: tuple[str, ...] = ()
    ac_whole_layer: bool = False
    ac_save_inside: tuple[str, ...] = ()
    """Modules (routers) whose ops checkpointing saves instead of recomputing."""
    layer_groups: tuple[LayerGroup, ...] = ()
    frozen_modules: tuple[str, ...] = ()
    """Fully frozen multimodal towers and projectors."""
    ignored_params: frozenset[nn.Parameter] = frozenset()
    """Parameters no FSDP unit shards (frozen towers under ``replicate``)."""
    layer_reshard_after_forward: bool | int | None = None
    """The explicit value the layer units get (None = the per-unit default)."""
    fsdp_units: tuple[FSDPUnit, ...] = ()
    """Every FSDP unit, in the order the flow creates them; empty when nothing is sharded."""
    pipeline_stage: bool = False
    compile: bool = False
    float8: Float8Plan | None = None

    @property
    def tp(self) -> bool:
        """Tensor parallel applies."""
        return bool(self.tp_plan)

    @property
    def cp(self) -> bool:
        """Context parallel applies."""
        return self.cp_attention is not None

    @property
    def ep(self) -> bool:
        """Expert parallel applies."""
        return bool(self.moe_blocks)

    @property
    def shard(self) -> bool:
        """FSDP units are created."""
        return bool(self.fsdp_units)

    def describe(self) -> dict[str, Any]:
        """Every decision as plain values (styles by their repr), identical on every rank of a stage."""
        return {
            "strategy": self.strategy,
            "sizes": dict(self.sizes),
            "tp_plan": {pattern: _style_text(style) for pattern, style in self.tp_plan.items()},
            "tp_plan_source": self.tp_plan_source,
            "sequence_parallel": self.sequence_parallel,
            "async_tp": self.async_tp,
            "cp_attention": self.cp_attention,
            "cp_gathered": list(self.cp_gathered),
            "moe_blocks": [b.fqn for b in self.moe_blocks],
            "activation_checkpointing": self.ac_mode,
            "ac_scope": list(self.ac_scope),
            "ac_whole_layer": self.ac_whole_layer,
            "ac_save_inside": list(self.ac_save_inside),
            "layer_groups": [f"{g.path} ({g.kind}, {len(g.layers)} layers)" for g in self.layer_groups],
            "frozen_modules": list(self.frozen_modules),
            "fsdp_units": [
                f"{u.name} [{u.role}, {u.mesh}, reshard={u.reshard_after_forward}]" for u in self.fsdp_units
            ],
            "pipeline_stage": self.pipeline_stage,
            "compile": self.compile,
            "float8": self.float8.describe() if self.float8 else None,
        }

    def text(self, title: str = "parallel plan") -> str:
        """The plan as indented lines under ``title`` (``plait-train plan``)."""
        lines = [f"{title}:"]
        for key, value in self.describe().items():
            if isinstance(value, dict) and value:
                lines.append(f"  {key}:")
                lines.extend(f"    {k}: {v}" for k, v in value.items())
            elif isinstance(value, list) and value:
                lines.append(f"  {key}:")
                lines.extend(f"    {item}" for item in value)
            elif value not in (None, False, [], {}):
                lines.append(f"  {key}: {value}")
        return "\n".join(lines)


def _style_text(style: ParallelStyle) -> str:
    fields = {k: v for k, v in vars(style).items() if not k.startswith("_")}
    return f"{type(style).__name__}({', '.join(f'{k}={v}' for k, v in sorted(fields.items()))})"
