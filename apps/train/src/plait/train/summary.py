"""Describe a parallelized model: mesh, FSDP units, TP placements, parameters per rank."""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from plait.mesh import MeshContext
from plait.train.init import clean_fqn

__all__ = [
    "ModelLayout",
    "compile_text",
    "describe_mesh",
    "format_bytes",
    "fsdp_unit_modules",
    "layout_of",
    "model_class_name",
    "pattern_of",
    "weights_text",
]

_INDEX = re.compile(r"\.\d+(?=\.|$)")


def pattern_of(name: str) -> str:
    """``model.layers.3._checkpoint_wrapped_module.mlp`` → ``model.layers.*.mlp`` (clean, indices collapsed)."""
    return _INDEX.sub(".*", clean_fqn(name))


def model_class_name(model: nn.Module) -> str:
    """The model's own class name (FSDP2 wraps the class as ``FSDP<Name>``, DDP holds it as ``.module``)."""
    inner = getattr(model, "module", None)
    if isinstance(inner, nn.Module):
        model = inner
    cls = type(model)
    if isinstance(model, FSDPModule):
        cls = next(c for c in cls.__mro__[1:] if not issubclass(c, FSDPModule))
    return cls.__name__


def format_bytes(n: float) -> str:
    """Human-readable bytes (binary units)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:,.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    raise AssertionError("unreachable")


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _placement_text(param: torch.Tensor) -> str:
    if not isinstance(param, DTensor):
        return "local"
    names = param.device_mesh.mesh_dim_names or tuple(str(i) for i in range(param.device_mesh.ndim))
    return ", ".join(f"{n}:{p}" for n, p in zip(names, param.placements, strict=True))


def _is_tp_sharded(param: torch.Tensor) -> bool:
    if not isinstance(param, DTensor):
        return False
    names = param.device_mesh.mesh_dim_names or ()
    return any(
        n == "tp" and not (p.is_replicate() or p.is_partial())
        for n, p in zip(names, param.placements, strict=True)
    )


@dataclass
class ModelLayout:
    """What parallelization did to a model, as seen from this rank."""

    fsdp_units: list[str] = field(default_factory=list)
    """FQNs of FSDP units (``<root>`` for the model itself), in module order."""
    tp_placements: dict[str, str] = field(default_factory=dict)
    """TP-sharded parameter pattern → placements (``dp_shard:Shard(0), tp:Shard(0)``)."""
    total_params: int = 0
    """Parameters of the full model."""
    local_params: Counter[torch.dtype] = field(default_factory=Counter)
    """Elements this rank stores, by dtype."""
    local_trainable: Counter[torch.dtype] = field(default_factory=Counter)
    """Trainable elements this rank stores (gradients and optimizer state follow these), by dtype."""
    stage_params: int | None = None
    """Pipeline parallel: parameters of this rank's stages (``total_params`` is the whole model's)."""

    def brief(self) -> str:
        """Three lines for the training summary: parameters, FSDP units, TP-sharded patterns."""
        units = Counter(pattern_of(u) for u in self.fsdp_units)
        local = sum(self.local_params.values())
        by_dtype = ", ".join(f"{_dtype_name(d)} {n:,}" for d, n in self.local_params.items()) or "none"
        listed = ", ".join(p + (f" x{n}" if n > 1 else "") for p, n in units.items())
        return "\n".join(
            [
                f"parameters: {self.total_params:,} total, {local:,} per rank ({by_dtype})",
                f"FSDP units: {len(self.fsdp_units)} ({listed or 'none'})",
                f"TP-sharded parameters: {len(self.tp_placements)} patterns (plait-train plan lists them)",
            ]
        )

    def text(self, max_lines: int = 12) -> str:
        """A short multi-line report."""
        units = Counter(pattern_of(u) for u in self.fsdp_units)
        lines = [f"parameters: {self.total_params:,} total"]
        if self.stage_params is not None:
            lines.append(f"parameters of this pp rank's stages: {self.stage_params:,}")
        local = sum(self.local_params.values())
        by_dtype = ", ".join(f"{_dtype_name(d)} {n:,}" for d, n in self.local_params.items()) or "none"
        lines.append(f"parameters per rank: {local:,} ({by_dtype})")
        lines.append(f"FSDP units: {len(self.fsdp_units)}")
        for pattern, count in list(units.items())[:max_lines]:
            lines.append(f"  {pattern}" + (f"  x{count}" if count > 1 else ""))
        lines.append(f"TP-sharded parameters: {len(self.tp_placements)} patterns")
        for pattern, text in list(self.tp_placements.items())[:max_lines]:
            lines.append(f"  {pattern}: {text}")
        if len(self.tp_placements) > max_lines:
            lines.append(f"  ... {len(self.tp_placements) - max_lines} more")
        return "\n".join(lines)


def fsdp_unit_modules(model: nn.Module) -> dict[int, list[str]]:
    """The FSDP units in module order: one entry per ``fully_shard`` call, keyed by the id of its
    state, listing the names of the modules it wrapped (``<root>`` for the model itself)."""
    units: dict[int, list[str]] = {}
    for name, module in model.named_modules():
        if isinstance(module, FSDPModule):
            units.setdefault(id(module._get_fsdp_state()), []).append(name or "<root>")
    return units


def layout_of(model: nn.Module) -> ModelLayout:
    """Walk the model once and collect units, TP placements and per-rank parameter counts."""
    layout = ModelLayout(fsdp_units=["+".join(names) for names in fsdp_unit_modules(model).values()])
    for name, param in model.named_parameters():
        local = param.to_local() if isinstance(param, DTensor) else param
        layout.total_params += param.numel()
        layout.local_params[local.dtype] += local.numel()
        if param.requires_grad:
            layout.local_trainable[local.dtype] += local.numel()
        if _is_tp_sharded(param):
            layout.tp_placements.setdefault(pattern_of(name), _placement_text(param))
    return layout


def describe_mesh(ctx: MeshContext, world_size: int) -> str:
    """One line: strategy, world size, mesh dims and sizes, activation checkpointing."""
    strategy = type(ctx.strategy_config).__name__
    mesh = ctx.device_mesh
    dims = (
        " x ".join(f"{n}={s}" for n, s in zip(mesh.mesh_dim_names, mesh.shape, strict=True))
        if mesh is not None
        else "none (DDP over all ranks)"
    )
    parts = [f"{strategy} on {world_size} rank(s)", f"mesh {dims}"]
    if ctx.moe_mesh is not None:
        parts.append(
            f"moe mesh {' x '.join(f'{n}={s}' for n, s in zip(ctx.moe_mesh.mesh_dim_names, ctx.moe_mesh.shape, strict=True))}"
        )
    parts.append(f"dp={ctx.dp_size or world_size} tp={ctx.tp_size} ep={ctx.ep_size}")
    sp = getattr(ctx.strategy_config, "sequence_parallel", False) and ctx.tp_size > 1
    parts.append(f"sp={'on' if sp else 'off'} ac={ctx.activation_checkpointing or 'off'}")
    return " | ".join(parts)


def weights_text(pretrained_path: str | None, seed: int, mixed_precision: str) -> str:
    """Where the weights came from and the precision they train in, for the summary's model line."""
    origin = (
        f"pretrained {pretrained_path}"
        if pretrained_path
        else f"fresh init (plait.mesh.materialize, seed {seed}: normal(0, initializer_range), "
        "residual outputs scaled by 1/sqrt(2 x layers), norms 1, biases 0; a model's own init is not used)"
    )
    precision = "bf16 parameters, fp32 reduce" if mixed_precision == "bf16" else "fp32"
    return f"weights {origin} | precision {precision}"


def compile_text(model: nn.Module) -> str:
    """``on (N layers compiled)`` after ``torch.compile`` of submodules in place, else ``off``."""
    # nn.Module.compile() stores the compiled forward in _compiled_call_impl (no public accessor).
    count = sum(getattr(m, "_compiled_call_impl", None) is not None for m in model.modules())
    return f"on ({count} layer{'s' if count != 1 else ''} compiled)" if count else "off"
