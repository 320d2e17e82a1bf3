"""Tensor- and sequence-parallel plans, styles and validation."""

from plait.tp.apply import apply_tp
from plait.tp.async_tp import enable_async_tp
from plait.tp.hf import hf_tp_plan, is_remote_code_model
from plait.tp.plans import llama_tp_plan, register_model_tp_plan, register_tp_plan
from plait.tp.resolve import resolve_tp_plan
from plait.tp.styles import (
    GatherSequenceInput,
    ReplicatedWithGradAllReduce,
    ReplicateParallel,
    RotaryEmbeddingParallel,
    SequenceParallelAllGather,
    SequenceParallelNorm,
    VocabParallelEmbedding,
    loss_parallel_head,
    parse_style,
)
from plait.tp.validate import validate_tp_mesh

__all__ = [
    "GatherSequenceInput",
    "ReplicateParallel",
    "ReplicatedWithGradAllReduce",
    "RotaryEmbeddingParallel",
    "SequenceParallelAllGather",
    "SequenceParallelNorm",
    "VocabParallelEmbedding",
    "apply_tp",
    "enable_async_tp",
    "hf_tp_plan",
    "is_remote_code_model",
    "llama_tp_plan",
    "loss_parallel_head",
    "parse_style",
    "register_model_tp_plan",
    "register_tp_plan",
    "resolve_tp_plan",
    "validate_tp_mesh",
]
