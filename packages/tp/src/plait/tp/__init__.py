"""Tensor- and sequence-parallel plans, styles and validation."""

from plait.tp.apply import apply_tp
from plait.tp.async_tp import enable_async_tp
from plait.tp.discovery import find_decoder, model_embeddings, module_fqn
from plait.tp.embedding import VocabParallelEmbedding
from plait.tp.experts import (
    AllReduceParallel,
    ExpertsTensorParallel,
    IdentityExpertParallel,
    LocalParamsParallel,
    MlaKvAProjParallel,
    param_placement,
)
from plait.tp.hf import hf_tp_plan, is_remote_code_model
from plait.tp.hf_sequence import layer_containers
from plait.tp.llama import llama_tp_plan
from plait.tp.regions import plan_regions
from plait.tp.registry import register_model_tp_plan, register_tp_plan
from plait.tp.replicate import (
    ReplicatedWithGradAllReduce,
    ReplicateOwnParams,
    ReplicateParallel,
    ShardedRegion,
)
from plait.tp.resolve import ResolvedTPPlan, resolve_tp_plan
from plait.tp.sequence import (
    GatherSequenceInput,
    RotaryEmbeddingParallel,
    SequenceParallelAllGather,
    SequenceParallelBlock,
    SequenceParallelNorm,
)
from plait.tp.styles import REFUSED_STYLES, RowwiseLocalCopy, loss_parallel_head, parse_style
from plait.tp.validate import validate_tp_mesh

__all__ = [
    "ResolvedTPPlan",
    "AllReduceParallel",
    "REFUSED_STYLES",
    "ExpertsTensorParallel",
    "IdentityExpertParallel",
    "GatherSequenceInput",
    "LocalParamsParallel",
    "MlaKvAProjParallel",
    "ReplicateOwnParams",
    "ReplicateParallel",
    "ReplicatedWithGradAllReduce",
    "RowwiseLocalCopy",
    "RotaryEmbeddingParallel",
    "SequenceParallelAllGather",
    "SequenceParallelBlock",
    "SequenceParallelNorm",
    "ShardedRegion",
    "VocabParallelEmbedding",
    "apply_tp",
    "enable_async_tp",
    "find_decoder",
    "hf_tp_plan",
    "is_remote_code_model",
    "layer_containers",
    "llama_tp_plan",
    "loss_parallel_head",
    "model_embeddings",
    "module_fqn",
    "param_placement",
    "parse_style",
    "plan_regions",
    "register_model_tp_plan",
    "register_tp_plan",
    "resolve_tp_plan",
    "validate_tp_mesh",
]
