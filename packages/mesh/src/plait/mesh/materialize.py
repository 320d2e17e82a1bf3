"""Materialise a (possibly meta, possibly sharded) model with mesh-independent weights.

Every parameter's *full* value is generated on CPU from its own seed (run seed + the parameter's
clean FQN), or taken from a caller's source of full tensors (e.g. pretrained files), and each rank
copies only its local shard (``distribute_tensor(..., src_data_rank=None)`` splits locally, no
communication). So the full weights are identical whatever the mesh (and equal to an unsharded
model's): DTensor's own random ops are not relied on. Buffers left empty by the meta device (RoPE
``inv_freq``) are recomputed.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

__all__ = ["FullTensorSource", "clean_fqn", "init_value", "materialize", "param_seed"]

_WRAPPER_PARTS = ("_checkpoint_wrapped_module", "_orig_mod", "_fsdp_wrapped_module")
_OUTPUT_PROJECTIONS = ("o_proj", "down_proj", "w2", "proj", "fc2")

FullTensorSource = Callable[[str, torch.Size], torch.Tensor]
"""``(clean fqn, full shape) -> full tensor`` on CPU."""


def clean_fqn(name: str) -> str:
    """A parameter name without wrapper segments (checkpoint, compile, FSDP1, DDP's ``module.``)."""
    parts = [p for p in name.split(".") if p not in _WRAPPER_PARTS]
    if parts and parts[0] == "module":
        parts = parts[1:]
    return ".".join(parts)


def param_seed(seed: int, fqn: str) -> int:
    """The seed of one parameter: a stable function of the run seed and its clean name."""
    return (seed * 1_000_003 + zlib.crc32(fqn.encode())) % (2**63)


def init_value(
    fqn: str, shape: torch.Size, *, seed: int, std: float = 0.02, num_layers: int = 1
) -> torch.Tensor:
    """The full fp32 initial value of parameter ``fqn`` (on CPU, deterministic).

    Biases are zero, 1-D weights (norm scales) one, everything else normal(0, std), with output
    projections of residual branches scaled by ``1/sqrt(2 * num_layers)``.
    """
    leaf = fqn.rsplit(".", 1)[-1]
    owner = fqn.rsplit(".", 2)[-2] if fqn.count(".") >= 1 else ""
    if leaf == "bias":
        return torch.zeros(shape)
    if len(shape) == 1:
        return torch.ones(shape)
    scale = std / math.sqrt(2 * num_layers) if owner in _OUTPUT_PROJECTIONS or leaf == "w2" else std
    generator = torch.Generator().manual_seed(param_seed(seed, fqn))
    return torch.empty(shape).normal_(0.0, scale, generator=generator)


def _config_value(model: nn.Module, name: str, default: float) -> float:
    config = getattr(model, "config", None)
    text = getattr(config, "text_config", None) or config
    return getattr(text, name, None) or default


def materialize(
    model: nn.Module,
    *,
    seed: int,
    device: torch.device | str = "cpu",
    source: FullTensorSource | None = None,
) -> nn.Module:
    """Allocate meta tensors on ``device`` and fill every parameter and buffer.

    Args:
        model: the model, before or after ``parallelize_model`` (DTensor parameters get their shard).
        seed: run seed; with ``source=None`` each parameter is :func:`init_value` of its clean FQN.
        device: where meta tensors are allocated.
        source: ``(clean fqn, full shape) -> full tensor`` (e.g. read from pretrained files) instead
            of random init.

    Raises:
        ValueError: a meta buffer whose module cannot recompute it.
    """
    meta_buffers = {name for name, b in model.named_buffers() if b.is_meta}
    if meta_buffers or any(p.is_meta for p in model.parameters()):
        model.to_empty(device=device)
    std = _config_value(model, "initializer_range", 0.02)
    layers = int(_config_value(model, "num_hidden_layers", 1))
    with torch.no_grad():
        for name, param in model.named_parameters():
            fqn = clean_fqn(name)
            full = (
                source(fqn, param.shape)
                if source
                else init_value(fqn, param.shape, seed=seed, std=std, num_layers=layers)
            )
            _copy_shard(param, full)
        _reset_buffers(model, meta_buffers)
    return model


def _copy_shard(param: torch.Tensor, full: torch.Tensor) -> None:
    if isinstance(param, DTensor):
        local = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None).to_local()
        param.to_local().copy_(local)
    else:
        param.copy_(full)


_REBUILD_LIMIT = 1 << 26
"""Elements a module (with its children) may have for its buffers to be recomputed by building it on CPU."""


def _template(module: nn.Module, model: nn.Module) -> nn.Module | None:
    """A CPU copy of a small ``module`` built from its config, or from the model's (transformers'
    DeepseekV3TopkRouter takes the model config, keeps none, and holds a weight and a score bias);
    None when it is too large or its constructor does not take that config."""
    if sum(p.numel() for p in module.parameters()) > _REBUILD_LIMIT:
        return None
    root = getattr(model, "config", None)
    for config in (getattr(module, "config", None), getattr(root, "text_config", None), root):
        if config is None:
            continue
        try:
            with torch.device("cpu"):
                return type(module)(config)
        except (TypeError, AttributeError):
            continue
    return None


def _reset_buffers(model: nn.Module, names: set[str]) -> None:
    owners: dict[str, nn.Module] = {}
    for name in names:
        owner_name = name.rpartition(".")[0]
        owners[owner_name] = model.get_submodule(owner_name)
    for owner_name, module in owners.items():
        reset = getattr(module, "reset_buffers", None)
        template = None if callable(reset) else _template(module, model)
        if callable(reset):
            reset()
        elif template is not None:
            device = next(module.buffers()).device
            for key, value in template.named_buffers(recurse=False):
                getattr(module, key).copy_(value.to(device))
        else:
            raise ValueError(
                f"cannot recompute buffer(s) of {owner_name or 'the model'} ({type(module).__name__}) after a "
                f"meta-device build; give it a reset_buffers() method or build the model on CPU instead"
            )
