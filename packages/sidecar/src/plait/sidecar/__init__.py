"""ModelParallelizer sidecars, the plan, resolution and compile: parallelize_model; the chunked loss."""

from plait.sidecar.chunked_loss import (
    check_chunked_loss_model,
    chunked_linear_cross_entropy,
    chunked_loss,
    chunked_loss_sum,
)
from plait.sidecar.compile import compile_layers, compile_parallelized_model
from plait.sidecar.parallel_plan import ParallelPlan
from plait.sidecar.parallelizer import ModelParallelizer
from plait.sidecar.plan import compile_requested, model_features, plan_parallelism
from plait.sidecar.resolution import (
    get_model_parallelizer,
    get_parallel_plan,
    parallelize_model,
    register_model_parallelizer,
)

__all__ = [
    "ModelParallelizer",
    "ParallelPlan",
    "check_chunked_loss_model",
    "chunked_linear_cross_entropy",
    "chunked_loss",
    "chunked_loss_sum",
    "compile_layers",
    "compile_parallelized_model",
    "compile_requested",
    "get_model_parallelizer",
    "get_parallel_plan",
    "model_features",
    "parallelize_model",
    "plan_parallelism",
    "register_model_parallelizer",
]
