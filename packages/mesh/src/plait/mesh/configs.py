"""Strategy configs (FSDP2, DDP, Megatron-FSDP) and the MoE config: pure, validated data."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Self

import torch
from torch.distributed.fsdp import MixedPrecisionPolicy, OffloadPolicy

from plait.mesh.normalize import normalize_ac_scope, normalize_frozen_multimodal_sharding
from plait.mesh.parsing import (
    check_types,
    from_dict,
    parse_dtype,
    parse_mp_policy,
    parse_offload_policy,
)

__all__ = [
    "CP_ATTENTION_VARIANTS",
    "CP_SEQUENCE_MIXERS",
    "DDPConfig",
    "FLOAT8_SCALINGS",
    "FSDP2Config",
    "Float8Config",
    "MegatronFSDPConfig",
    "MoEConfig",
    "default_mp_policy",
]

CP_ATTENTION_VARIANTS = ("all_gather", "ring", "all_to_all")
"""The context-parallel attention algorithms; ``FSDP2Config.cp_attention`` also takes ``"auto"``."""
CP_SEQUENCE_MIXERS = ("refuse", "gather")
"""Values of ``FSDP2Config.cp_sequence_mixers``."""
FLOAT8_SCALINGS = ("tensorwise", "rowwise")
"""Values of ``Float8Config.scaling`` (torchao's recipes of the same names)."""


def default_mp_policy() -> MixedPrecisionPolicy:
    """bf16 parameters and outputs, fp32 gradient reduction, forward inputs cast to bf16."""
    return MixedPrecisionPolicy(
        param_dtype=torch.bfloat16,
        reduce_dtype=torch.float32,
        output_dtype=torch.bfloat16,
        cast_forward_inputs=True,
    )


def _check_tp_plan(owner: str, plan: object) -> object:
    if plan is None:
        return None
    if isinstance(plan, str):
        if not plan.strip():
            raise ValueError(f"{owner}.tp_plan is an empty string; give a registered name or 'pkg.mod:ATTR'")
        return plan
    if isinstance(plan, Mapping):
        bad = [k for k in plan if not isinstance(k, str)]
        if bad:
            raise TypeError(f"{owner}.tp_plan keys must be module FQN patterns (str), got {bad}")
        return dict(plan)
    raise TypeError(
        f"{owner}.tp_plan must be a dict {{pattern: style}}, a registered plan name or an import path "
        f"'pkg.mod:ATTR', got {plan!r} ({type(plan).__name__})"
    )


def _check_non_negative(owner: str, name: str, value: int) -> None:
    if value < 0:
        raise ValueError(f"{owner}.{name} must be >= 0, got {value}")


@dataclass(frozen=True, kw_only=True)
class _Config:
    """Shared behaviour: normalise, type-check, validate; strict ``from_dict``."""

    def __post_init__(self) -> None:
        self._normalize()
        check_types(self)
        self._validate()

    def _normalize(self) -> None:
        """Parse fields given in a looser form (strings, dicts) into their stored form."""

    def _validate(self) -> None:
        """Reject nonsense values once the types are known to be right."""

    def _set(self, name: str, value: object) -> None:
        object.__setattr__(self, name, value)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Self:
        """Build the config from a YAML mapping; unknown keys -> ValueError, wrong types -> TypeError."""
        return from_dict(cls, data, cls.__name__)


def _patterns(owner: str, name: str, value: object) -> object:
    """A list or one string of FQN patterns as a tuple; an empty pattern is refused."""
    if isinstance(value, str):
        value = (value,)
    if isinstance(value, list | tuple):
        if any(isinstance(p, str) and not p.strip() for p in value):
            raise ValueError(f"{owner}.{name} holds an empty pattern: {list(value)}; remove it")
        return tuple(value)
    return value


@dataclass(frozen=True, kw_only=True)
class Float8Config(_Config):
    """Float8 training (torchao's ``Float8Linear``) for the eligible ``nn.Linear`` modules; see docs/float8.md.

    Never converted, whatever the patterns say: the output head (``get_output_embeddings`` /
    ``lm_head``), MoE routers and gates and everything inside an ``experts`` block, linears whose
    (per-rank, after TP) in or out features are not multiples of 16, and under tp > 1 the linears
    the TP plan does not shard column- or row-wise. The plan lists every linear left out and why.
    """

    scaling: str = "tensorwise"
    """``tensorwise`` (one scale per tensor) or ``rowwise`` (one per row; power-of-2 scales)."""
    fsdp_all_gather: bool = False
    """All-gather the weights in float8 under FSDP2 (tensorwise only): call
    ``plait.float8.precompute_float8_scales(model)`` after every optimizer step."""
    include: tuple[str, ...] = ("*",)
    """``fnmatch`` patterns of module FQNs that may be converted (default: every linear)."""
    skip: tuple[str, ...] = ()
    """``fnmatch`` patterns of module FQNs never converted, on top of the automatic skips above."""
    emulate: bool | None = None
    """Emulate the float8 matmuls in high precision; None = emulate on CPU meshes, hardware float8 on CUDA."""

    def _normalize(self) -> None:
        self._set("include", _patterns("Float8Config", "include", self.include))
        self._set("skip", _patterns("Float8Config", "skip", self.skip))

    def _validate(self) -> None:
        if self.scaling not in FLOAT8_SCALINGS:
            raise ValueError(
                f"Float8Config.scaling must be one of {list(FLOAT8_SCALINGS)}, got {self.scaling!r}"
            )
        if not self.include:
            raise ValueError(
                "Float8Config.include is empty, so nothing would be converted; use ['*'] or turn float8 off"
            )
        if self.scaling == "rowwise" and self.fsdp_all_gather:
            raise ValueError(
                "Float8Config(scaling='rowwise', fsdp_all_gather=True): torchao all-gathers float8 weights "
                "with one tensorwise scale only; set fsdp_all_gather=False or scaling='tensorwise'"
            )


def _parse_float8(value: object) -> object:
    """``FSDP2Config.float8`` given as a config, None, a bool (True = defaults) or a dict of its fields."""
    if isinstance(value, bool):
        return Float8Config() if value else None
    if isinstance(value, Mapping):
        return from_dict(Float8Config, value, "FSDP2Config.float8")
    return value


@dataclass(frozen=True, kw_only=True)
class FSDP2Config(_Config):
    """FSDP2 (``fully_shard``) with optional tensor, sequence and context parallelism."""

    sequence_parallel: bool = False
    """Shard activations between blocks on the sequence dim (needs tp > 1; ignored with a warning otherwise)."""
    tp_plan: dict[str, Any] | str | None = None
    """TP plan: a dict ``{fqn_pattern: style}``, a registered plan name, or an import path ``"pkg.mod:ATTR"``."""
    mp_policy: MixedPrecisionPolicy | None = field(default_factory=default_mp_policy)
    """Mixed precision; default bf16 params/outputs, fp32 reduce. YAML: a dict of its fields, or null."""
    offload_policy: OffloadPolicy | None = None
    """Parameter offload; YAML: ``cpu`` or ``{pin_memory: bool}``; None = keep on device."""
    activation_checkpointing_scope: tuple[str, ...] | str = "all"
    """Layer groups to checkpoint (all, language, vision, audio, multimodal); stored as a tuple."""
    reshard_after_forward: bool | int | None = None
    """Free gathered parameters after forward; None = per-unit default (all but the last of a container).
    An int N >= 2 keeps them sharded over groups of N ranks instead (ZeRO++'s hpZ: backward all-gathers
    within the group); N must divide the FSDP shard group (dp_shard x cp)."""
    enable_async_tensor_parallel: bool = False
    """Overlap TP communication with compute (needs sequence_parallel and CUDA)."""
    enable_compile: bool = False
    """Compile each transformer layer in place, the last step of ``parallelize_model``."""
    enable_fsdp2_prefetch: bool = True
    """Explicitly prefetch neighbouring FSDP units in forward and backward."""
    fsdp2_forward_prefetch_depth: int = 1
    """How many following units each unit all-gathers ahead of time in forward; 0 = off."""
    fsdp2_backward_prefetch_depth: int = 2
    """How many preceding units each unit all-gathers ahead of time in backward; 0 = off."""
    frozen_multimodal_sharding: str = "root"
    """Fully frozen towers/projectors: ``root`` (in the root unit), ``per_layer`` or ``replicate``."""
    cp_attention: str = "all_gather"
    """Context-parallel attention (cp > 1): ``all_gather`` (gather K/V), ``ring`` (pass K/V round), ``all_to_all`` (split heads) or ``auto`` (see docs/cp.md)."""
    cp_sequence_mixers: str = "refuse"
    """Sequence mixers cp cannot split (convolutions over time, Mamba, linear attention): ``refuse`` names
    them; ``gather`` runs each on the whole sequence on every cp rank (exact; no memory saved in it)."""
    float8: Float8Config | None = None
    """Float8 training of the eligible linears (needs torchao: ``plait-float8[torchao]``); YAML: a dict, true or null."""

    def _normalize(self) -> None:
        self._set("float8", _parse_float8(self.float8))
        self._set("mp_policy", parse_mp_policy("FSDP2Config.mp_policy", self.mp_policy))
        self._set("offload_policy", parse_offload_policy("FSDP2Config.offload_policy", self.offload_policy))
        self._set("activation_checkpointing_scope", normalize_ac_scope(self.activation_checkpointing_scope))
        self._set(
            "frozen_multimodal_sharding",
            normalize_frozen_multimodal_sharding(self.frozen_multimodal_sharding),
        )
        self._set("tp_plan", _check_tp_plan("FSDP2Config", self.tp_plan))

    def _validate(self) -> None:
        _check_non_negative("FSDP2Config", "fsdp2_forward_prefetch_depth", self.fsdp2_forward_prefetch_depth)
        _check_non_negative(
            "FSDP2Config", "fsdp2_backward_prefetch_depth", self.fsdp2_backward_prefetch_depth
        )
        if self.enable_async_tensor_parallel and not self.sequence_parallel:
            raise ValueError(
                "FSDP2Config.enable_async_tensor_parallel=True needs sequence_parallel=True; "
                "turn sequence_parallel on or async TP off"
            )
        value = self.reshard_after_forward
        if not isinstance(value, bool) and isinstance(value, int) and value < 2:
            raise ValueError(
                f"FSDP2Config.reshard_after_forward={value}: an int is the group size parameters stay "
                "sharded over after forward and must be >= 2; use False to keep them gathered"
            )
        if self.cp_sequence_mixers not in CP_SEQUENCE_MIXERS:
            raise ValueError(
                f"FSDP2Config.cp_sequence_mixers must be one of {list(CP_SEQUENCE_MIXERS)}, got "
                f"{self.cp_sequence_mixers!r}"
            )
        if self.cp_attention not in (*CP_ATTENTION_VARIANTS, "auto"):
            raise ValueError(
                f"FSDP2Config.cp_attention must be one of {[*CP_ATTENTION_VARIANTS, 'auto']}, got {self.cp_attention!r}"
            )


@dataclass(frozen=True, kw_only=True)
class DDPConfig(_Config):
    """Plain ``DistributedDataParallel`` over all ranks (no tensor, context, pipeline or expert parallelism)."""

    broadcast_buffers: bool = False
    """Broadcast module buffers from rank 0 at every forward."""
    find_unused_parameters: bool = False
    """Tolerate parameters that get no gradient in a step (slower)."""
    static_graph: bool = False
    """Promise the same set of used parameters every step (enables DDP optimisations)."""
    bucket_cap_mb: float | None = None
    """Gradient bucket size in MiB; None = DDP's default (25)."""
    gradient_as_bucket_view: bool = False
    """Let gradients alias the all-reduce buckets (saves memory)."""
    activation_checkpointing_scope: tuple[str, ...] | str = "all"
    """Layer groups to checkpoint (all, language, vision, audio, multimodal); stored as a tuple."""

    def _normalize(self) -> None:
        self._set("activation_checkpointing_scope", normalize_ac_scope(self.activation_checkpointing_scope))

    def _validate(self) -> None:
        if self.bucket_cap_mb is not None and self.bucket_cap_mb <= 0:
            raise ValueError(f"DDPConfig.bucket_cap_mb must be > 0 or None, got {self.bucket_cap_mb}")


@dataclass(frozen=True, kw_only=True)
class MegatronFSDPConfig(_Config):
    """Megatron-FSDP (the ``megatron-fsdp`` package) over a ``(dp, cp, tp)`` mesh."""

    sequence_parallel: bool = False
    """Not supported with Megatron-FSDP; must stay False."""
    tp_plan: dict[str, Any] | str | None = None
    """TP plan: a dict ``{fqn_pattern: style}``, a registered plan name, or an import path ``"pkg.mod:ATTR"``."""
    unit_modules: tuple[str | type, ...] | None = None
    """Classes (or ``"pkg.mod.Class"`` paths) sharded as units; None = the model's ``_no_split_modules``."""
    zero_dp_strategy: int = 3
    """0 no sharding, 1 optimizer state, 2 + gradients, 3 + parameters (ZeRO-3)."""
    init_with_meta_device: bool = False
    """Materialise a meta-device model layer by layer through ``reset_parameters``."""
    grad_reduce_in_fp32: bool = False
    """Reduce gradients in fp32."""
    preserve_fp32_weights: bool = False
    """Keep fp32 main weights for the optimizer."""
    overlap_grad_reduce: bool = True
    """Overlap gradient reduce-scatter with backward compute."""
    overlap_param_gather: bool = True
    """Overlap parameter all-gather with compute."""
    check_for_nan_in_grad: bool = True
    """Check gradients for NaN before reduction."""
    average_in_collective: bool = False
    """Average (instead of sum, then scale) inside the gradient collective."""
    disable_bucketing: bool = False
    """Communicate each parameter separately instead of in buckets."""
    calculate_per_token_loss: bool = False
    """The loss is a per-token sum; skip gradient scaling by the data-parallel size."""
    keep_fp8_transpose_cache: bool = False
    """Keep TransformerEngine's fp8 transpose cache between steps."""
    nccl_ub: bool = False
    """Register NCCL user buffers (implies double buffering)."""
    fsdp_double_buffer: bool = False
    """Double-buffer parameter gathers."""
    activation_checkpointing_scope: tuple[str, ...] | str = "all"
    """Layer groups to checkpoint (all, language, vision, audio, multimodal); stored as a tuple."""

    def _normalize(self) -> None:
        self._set("activation_checkpointing_scope", normalize_ac_scope(self.activation_checkpointing_scope))
        self._set("tp_plan", _check_tp_plan("MegatronFSDPConfig", self.tp_plan))
        if isinstance(self.unit_modules, list):
            self._set("unit_modules", tuple(self.unit_modules))

    def _validate(self) -> None:
        if self.sequence_parallel:
            raise ValueError(
                "MegatronFSDPConfig.sequence_parallel=True: Megatron-FSDP does not support sequence "
                "parallel; set sequence_parallel to False or use FSDP2Config"
            )
        if self.zero_dp_strategy not in (0, 1, 2, 3):
            raise ValueError(
                f"MegatronFSDPConfig.zero_dp_strategy must be 0, 1, 2 or 3, got {self.zero_dp_strategy}"
            )
        if self.unit_modules is not None and not self.unit_modules:
            raise ValueError(
                "MegatronFSDPConfig.unit_modules is empty; list the block classes or use None to derive "
                "them from the model's _no_split_modules"
            )


@dataclass(frozen=True, kw_only=True)
class MoEConfig(_Config):
    """Mixture-of-experts options used when ``ep_size > 1``."""

    ignore_router_for_ac: bool = True
    """Save (never recompute) the router under activation checkpointing, so routing cannot change."""
    reshard_after_forward: bool | None = None
    """Reshard the layer and expert FSDP units after forward; None = ``FSDP2Config.reshard_after_forward``."""
    lm_head_precision: torch.dtype | None = None
    """Dtype the output head computes in (e.g. float32); None = the mixed-precision default."""
    wrap_outer_model: bool = True
    """Wrap the whole model as the root FSDP unit."""
    mp_policy: MixedPrecisionPolicy | None = None
    """Mixed precision of the MoE units; None = FSDP's default (no casting)."""

    def _normalize(self) -> None:
        self._set("lm_head_precision", parse_dtype("MoEConfig.lm_head_precision", self.lm_head_precision))
        self._set("mp_policy", parse_mp_policy("MoEConfig.mp_policy", self.mp_policy))
