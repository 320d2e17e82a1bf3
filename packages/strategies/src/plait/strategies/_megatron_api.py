"""The ``megatron-fsdp`` package as plait uses it: lazy import, API check, config translation, unit modules.

Two API generations exist. megatron-fsdp >= 0.4 takes a ``MixedPrecisionPolicy`` and
``report_nan_in_param_grad``; 0.2-0.3 take ``grad_reduce_in_fp32`` / ``preserve_fp32_weights`` /
``check_for_nan_in_grad`` flags. Anything older (``dp_shard_dim`` etc. missing) is refused.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch
from torch import nn

from plait.mesh import MegatronFSDPConfig

INSTALL_HINT = "pip install 'plait-strategies[megatron]'"
REQUIRED_VERSION = "megatron-fsdp>=0.2 (tested with 0.6.1)"

_COMMON_PARAMS = (
    "module",
    "device_mesh",
    "dp_shard_dim",
    "tp_dim",
    "fsdp_unit_modules",
    "zero_dp_strategy",
    "device",
    "init_model_with_meta_device",
    "overlap_grad_reduce",
    "overlap_param_gather",
    "average_in_collective",
    "disable_bucketing",
    "calculate_per_token_loss",
    "keep_fp8_transpose_cache",
    "nccl_ub",
    "fsdp_double_buffer",
)
_POLICY_PARAMS = ("mixed_precision_policy", "report_nan_in_param_grad")
_FLAG_PARAMS = ("grad_reduce_in_fp32", "preserve_fp32_weights", "check_for_nan_in_grad")


@dataclass(frozen=True)
class MegatronAPI:
    """The entry point plait calls and which API generation it belongs to."""

    package: ModuleType
    version: str
    entry: Callable[..., Any]
    """``fully_shard_model(module, ...)``, or ``fully_shard(module, optimizer, ...)`` with an optimizer."""
    policy_api: bool
    """True: megatron-fsdp >= 0.4 (``mixed_precision_policy``); False: 0.2-0.3 flags."""


def import_megatron_fsdp() -> ModuleType:
    """Import ``megatron_fsdp`` or raise an ImportError that says how to install it."""
    try:
        return importlib.import_module("megatron_fsdp")
    except ImportError as err:
        raise ImportError(
            f"Megatron-FSDP needs the optional megatron-fsdp package, which is not importable ({err}); "
            f"install it with: {INSTALL_HINT}"
        ) from err


def load_api(*, with_optimizer: bool) -> MegatronAPI:
    """Import the package and check its entry point's signature.

    Raises:
        ImportError: the package is missing, or its entry point lacks parameters plait passes
            (naming the version needed).
    """
    package = import_megatron_fsdp()
    version = str(getattr(package, "__version__", "unknown"))
    name = "fully_shard" if with_optimizer else "fully_shard_model"
    entry = getattr(package, name, None)
    needed = (*_COMMON_PARAMS, "optimizer") if with_optimizer else _COMMON_PARAMS
    params = set(inspect.signature(entry).parameters) if callable(entry) else set()
    missing = [p for p in needed if p not in params]
    policy_api = all(p in params for p in _POLICY_PARAMS)
    if entry is None or missing or not (policy_api or all(p in params for p in _FLAG_PARAMS)):
        what = (
            f"has no {name}()"
            if entry is None
            else f"{name}() lacks parameters {missing or list(_FLAG_PARAMS)}"
        )
        raise ImportError(
            f"megatron-fsdp {version} is not supported: megatron_fsdp.{what}; plait needs {REQUIRED_VERSION}. "
            f"Upgrade with: pip install -U 'plait-strategies[megatron]'"
        )
    if policy_api and not hasattr(package, "MixedPrecisionPolicy"):
        raise ImportError(
            f"megatron-fsdp {version} is not supported: {name}() takes mixed_precision_policy but the package "
            f"has no MixedPrecisionPolicy; plait needs {REQUIRED_VERSION}"
        )
    return MegatronAPI(package=package, version=version, entry=entry, policy_api=policy_api)


def translate_config(config: MegatronFSDPConfig, api: MegatronAPI) -> dict[str, Any]:
    """Keyword arguments for the entry point from ``config`` (mesh, module and units excluded)."""
    kwargs: dict[str, Any] = {
        "zero_dp_strategy": config.zero_dp_strategy,
        "init_model_with_meta_device": config.init_with_meta_device,
        "overlap_grad_reduce": config.overlap_grad_reduce,
        "overlap_param_gather": config.overlap_param_gather,
        "average_in_collective": config.average_in_collective,
        "disable_bucketing": config.disable_bucketing,
        "calculate_per_token_loss": config.calculate_per_token_loss,
        "keep_fp8_transpose_cache": config.keep_fp8_transpose_cache,
        "nccl_ub": config.nccl_ub,
        "fsdp_double_buffer": config.fsdp_double_buffer,
    }
    if api.policy_api:
        fp32_grads = torch.float32 if config.grad_reduce_in_fp32 else None
        kwargs["mixed_precision_policy"] = api.package.MixedPrecisionPolicy(
            main_params_dtype=torch.float32 if config.preserve_fp32_weights else None,
            main_grads_dtype=fp32_grads,
            grad_comm_dtype=fp32_grads,
        )
        kwargs["report_nan_in_param_grad"] = config.check_for_nan_in_grad
    else:
        kwargs["grad_reduce_in_fp32"] = config.grad_reduce_in_fp32
        kwargs["preserve_fp32_weights"] = config.preserve_fp32_weights
        kwargs["check_for_nan_in_grad"] = config.check_for_nan_in_grad
    return kwargs


def _import_class(path: str) -> type:
    module_name, sep, attr = path.partition(":")
    if not sep:
        module_name, _, attr = path.rpartition(".")
    try:
        found = getattr(importlib.import_module(module_name), attr) if module_name and attr else None
    except (ImportError, AttributeError):
        found = None
    if not isinstance(found, type):
        raise ValueError(
            f"MegatronFSDPConfig.unit_modules entry {path!r} is not an importable class; use 'pkg.module.Class' "
            "or 'pkg.module:Class'"
        )
    return found


def _no_split_names(model: nn.Module) -> list[str]:
    names: list[str] = []
    for module in model.modules():
        for name in getattr(module, "_no_split_modules", None) or ():
            if isinstance(name, str) and name not in names:
                names.append(name)
    return names


def resolve_unit_modules(model: nn.Module, config: MegatronFSDPConfig) -> list[type[nn.Module]]:
    """The classes Megatron-FSDP shards as units: ``config.unit_modules``, else ``_no_split_modules``.

    ``_no_split_modules`` names (of the model and its submodules) are matched by class name against the
    model's modules. Only classes that occur in the model are returned.

    Raises:
        ValueError: an entry is not an importable module class, or no unit class occurs in the model.
    """
    present = list(dict.fromkeys(type(m) for m in model.modules()))
    if config.unit_modules:
        wanted = [_import_class(u) if isinstance(u, str) else u for u in config.unit_modules]
        for cls in wanted:
            if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
                raise ValueError(f"MegatronFSDPConfig.unit_modules entry {cls!r} is not an nn.Module class")
        source = f"MegatronFSDPConfig.unit_modules {[c.__qualname__ for c in wanted]}"
        units = [cls for cls in present if cls in wanted]
    else:
        names = _no_split_names(model)
        source = f"_no_split_modules {names}" if names else "no _no_split_modules"
        units = [cls for cls in present if cls.__name__ in names]
    if not units:
        raise ValueError(
            f"no Megatron-FSDP unit modules found in {type(model).__name__} ({source} match none of its modules); "
            "set MegatronFSDPConfig.unit_modules to its transformer-block classes, e.g. "
            "['transformers.models.llama.modeling_llama.LlamaDecoderLayer']"
        )
    return units
