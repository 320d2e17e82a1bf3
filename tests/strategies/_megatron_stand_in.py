"""A stand-in ``megatron_fsdp`` package (both API generations) that records its calls, for CPU tests."""

from __future__ import annotations

import dataclasses
import inspect
import types
from typing import Any

import torch
from torch.distributed.tensor import DTensor

COMMON = [
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
]


@dataclasses.dataclass
class Policy:
    main_params_dtype: torch.dtype | None = torch.float32
    main_grads_dtype: torch.dtype | None = None
    grad_comm_dtype: torch.dtype | None = None


def stand_in(version: str, params: list[str], calls: list[dict[str, Any]]) -> types.ModuleType:
    """A fake ``megatron_fsdp`` whose entry points have exactly ``params`` and record their calls."""

    def entry(**kwargs: Any) -> Any:
        calls.append(
            {
                **kwargs,
                "tp_applied": isinstance(kwargs["module"].model.layers[0].self_attn.q_proj.weight, DTensor),
            }
        )
        return (kwargs["module"], kwargs["optimizer"]) if "optimizer" in kwargs else kwargs["module"]

    signature = inspect.Signature([inspect.Parameter(p, inspect.Parameter.KEYWORD_ONLY) for p in params])
    module = types.ModuleType("megatron_fsdp")
    module.__version__ = version
    module.MixedPrecisionPolicy = Policy
    for name in ("fully_shard_model", "fully_shard"):
        fn = lambda **kw: entry(**kw)  # noqa: E731
        fn.__signature__ = signature.replace(
            parameters=[*signature.parameters.values()]
            + (
                [inspect.Parameter("optimizer", inspect.Parameter.KEYWORD_ONLY)]
                if name == "fully_shard"
                else []
            )
        )
        setattr(module, name, fn)
    return module


CURRENT = [*COMMON, "mixed_precision_policy", "report_nan_in_param_grad"]
LEGACY = [*COMMON, "grad_reduce_in_fp32", "preserve_fp32_weights", "check_for_nan_in_grad"]
