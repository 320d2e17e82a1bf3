"""ModelParallelizer sidecars, resolution, dispatch and compile: parallelize_model."""

from plait.sidecar.compile import compile_parallelized_model
from plait.sidecar.parallelizer import ModelParallelizer
from plait.sidecar.resolution import get_model_parallelizer, parallelize_model, register_model_parallelizer

__all__ = [
    "ModelParallelizer",
    "compile_parallelized_model",
    "get_model_parallelizer",
    "parallelize_model",
    "register_model_parallelizer",
]
