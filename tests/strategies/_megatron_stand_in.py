"""A stand-in ``megatron_fsdp`` package (both API generations) that records its calls, for CPU tests."""

from __future__ import annotations

import dataclasses
import inspect
import sys
import types
from typing import Any

import pytest
import torch
from torch.distributed.tensor import DTensor

from plait.strategies._megatron_api import _COMMON_PARAMS

COMMON = list(_COMMON_PARAMS)
"""The parameters both API generations of the package take (as plait checks them)."""


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


def install_stand_in(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """Install the stand-in (current API) as ``megatron_fsdp`` for one test; return its recorded calls."""
    recorded: list[dict[str, Any]] = []
    monkeypatch.setitem(sys.modules, "megatron_fsdp", stand_in("0.6.1", CURRENT, recorded))
    return recorded
