"""The process group (NCCL on a GPU, gloo in the dry run) and the paths one GPU cannot run."""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist

from plait.mesh import (
    Float8Config,
    FSDP2Config,
    ParallelismSizes,
    check_combination,
    combination_request,
    init_distributed,
)

__all__ = ["FLOAT8_VARIANTS", "async_tp_check", "float8_skip_reason", "init_process_group"]

FLOAT8_VARIANTS = ("compile+float8_tensorwise", "compile+float8_rowwise")


def init_process_group(device: torch.device) -> dict[str, Any]:
    """Start the one-rank group (NCCL on CUDA) and run one all-reduce through it."""
    start = time.perf_counter()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    info = init_distributed("nccl" if device.type == "cuda" else "gloo")
    value = torch.full((1,), 2.0, device=device)
    dist.all_reduce(value)  # NCCL creates its communicator here (lazily)
    ok = value.item() == 2.0 * info.world_size
    return {
        "check": "process_group",
        "backend": dist.get_backend(),
        "world_size": info.world_size,
        "all_reduce_ok": ok,
        "init_s": time.perf_counter() - start,
    }


def async_tp_check(device: torch.device) -> dict[str, Any]:
    """Async TP overlaps TP collectives across ranks: gpu_check runs one rank, so it is skipped."""
    gpus = torch.cuda.device_count() if device.type == "cuda" else 0
    return {
        "check": "async_tp",
        "skipped": f"async TP needs tp >= 2 (>= 2 GPUs, one rank each); gpu_check runs one rank ({gpus} GPU(s) seen)",
    }


def float8_skip_reason() -> str:
    """Why the compile + float8 variants are skipped: the combination table's refusal, verbatim."""

    config = FSDP2Config(float8=Float8Config(), enable_compile=True)
    try:
        check_combination(combination_request(config, ParallelismSizes(dp_size=1)))
    except ValueError as err:
        return f"refused by plait: {err}"
    return "plait builds float8 with compile now, but tools/gpu_check does not drive it yet"
