"""Async tensor parallel: overlap TP collectives with matmuls (torch.compile micro-pipelining)."""

from __future__ import annotations

import warnings

import torch
from torch.distributed.device_mesh import DeviceMesh

__all__ = ["enable_async_tp"]


def enable_async_tp(tp_mesh: DeviceMesh, *, sequence_parallel: bool) -> None:
    """Turn on async TP for ``tp_mesh``: CUDA symmetric memory for its group + inductor micro-pipelining.

    Takes effect in ``torch.compile``-d regions: ``parallelize_model`` compiles the layers as its last
    step whenever async TP is on at tp > 1.

    Raises:
        ValueError: ``sequence_parallel`` is off (async TP fuses the SP all-gather / reduce-scatter into
            the matmuls), the mesh is not a CUDA mesh, CUDA is unavailable, or the group has no CUDA
            symmetric memory.
    """
    if not sequence_parallel:
        raise ValueError(
            "enable_async_tensor_parallel=True needs sequence_parallel=True (async TP overlaps the sequence-"
            "parallel all-gather/reduce-scatter with matmuls); enable sequence_parallel or turn async TP off"
        )
    if tp_mesh.device_type != "cuda" or not torch.cuda.is_available():
        raise ValueError(
            f"async tensor parallel needs CUDA symmetric memory, but the TP mesh is on {tp_mesh.device_type!r} "
            f"(CUDA available: {torch.cuda.is_available()}); set enable_async_tensor_parallel=False"
        )
    try:
        from torch.distributed import _symmetric_memory as symm_mem
    except ImportError as exc:
        raise ValueError(
            f"async tensor parallel needs torch symmetric memory ({exc}); upgrade torch"
        ) from None
    group_name = tp_mesh.get_group().group_name
    if not symm_mem.is_symm_mem_enabled_for_group(group_name):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # newer torch: explicit enabling is deprecated
            symm_mem.enable_symm_mem_for_group(group_name)
    if not symm_mem.is_symm_mem_enabled_for_group(group_name):
        raise ValueError(
            f"CUDA symmetric memory is not available for the TP group {group_name!r} (needs NCCL on CUDA devices "
            "with peer access); set enable_async_tensor_parallel=False"
        )
    torch._inductor.config._micro_pipeline_tp = True
